"""Options of the socket backends (``auto``, the default; ``shm``; ``tcp``)."""

from __future__ import annotations

import os
from typing import Any

from rpcx.options import TensorPipeRpcBackendOptions

__all__ = ["CONNECT_ON_DEMAND_ENV", "SocketRpcBackendOptions"]

CONNECT_ON_DEMAND_ENV = "RPCX_CONNECT_ON_DEMAND"  # the option's default, for launchers


class SocketRpcBackendOptions(TensorPipeRpcBackendOptions):
    """torch's TensorPipe fields, plus where large tensors leave the socket and where a
    worker listens for peers on other hosts.

    Args:
        shm_min_bytes: between workers of one host, a tensor buffer of at least this many
            bytes goes through a shared memory file (one copy, by the sender) instead of
            the socket (two copies, through the kernel). Default 256 KiB.
        shm_pool_bytes: shared memory kept paged in per peer for those buffers, reused
            as the peer frees them. Past it, a buffer goes through a one-off segment
            (slower: fresh pages). Default 1 GiB.
        hostname: address or hostname to listen on for peers on other hosts. By default
            the local address that routes to the rendezvous host (``127.0.0.1`` when
            that host is local), so no interface variable is needed on a cluster.
        connect_on_demand: connect a pair of workers when one first sends to the other,
            instead of every pair in ``init_rpc`` (a static world). ``None`` (the
            default): ``$RPCX_CONNECT_ON_DEMAND`` says (``1``), else ``False``.
            A large world then starts without connecting anyone, and a worker that
            talks to few peers holds few connections; what is sent to a peer not
            connected yet queues while the connection is made. Where every worker soon
            talks to every other, connecting up front costs less in all. Every worker
            of a world must agree (``init_rpc`` refuses a world that does not).
    """

    DEFAULT_SHM_MIN_BYTES = 256 << 10
    DEFAULT_SHM_POOL_BYTES = 1 << 30

    def __init__(
        self, *, shm_min_bytes: int = DEFAULT_SHM_MIN_BYTES,
        shm_pool_bytes: int = DEFAULT_SHM_POOL_BYTES, hostname: str | None = None,
        connect_on_demand: bool | None = None, **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.shm_min_bytes = int(shm_min_bytes)
        self.shm_pool_bytes = int(shm_pool_bytes)
        self.hostname = hostname
        if connect_on_demand is None:
            connect_on_demand = os.environ.get(CONNECT_ON_DEMAND_ENV, "").strip().lower() in (
                "1", "true", "yes", "on")
        self.connect_on_demand = bool(connect_on_demand)

    def validate(self) -> None:
        """Raise ``ValueError`` for a threshold below one byte or a negative pool."""
        super().validate()
        if self.shm_min_bytes < 1:
            raise ValueError(f"shm_min_bytes must be at least 1, got {self.shm_min_bytes}")
        if self.shm_pool_bytes < 0:
            raise ValueError(f"shm_pool_bytes must be at least 0, got {self.shm_pool_bytes}")
