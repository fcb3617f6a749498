"""Options of the socket backends (``auto``, the default; ``shm``; ``tcp``)."""

from __future__ import annotations

from typing import Any

from rpcx.options import TensorPipeRpcBackendOptions

__all__ = ["SocketRpcBackendOptions"]


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
    """

    DEFAULT_SHM_MIN_BYTES = 256 << 10
    DEFAULT_SHM_POOL_BYTES = 1 << 30

    def __init__(
        self, *, shm_min_bytes: int = DEFAULT_SHM_MIN_BYTES,
        shm_pool_bytes: int = DEFAULT_SHM_POOL_BYTES, hostname: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.shm_min_bytes = int(shm_min_bytes)
        self.shm_pool_bytes = int(shm_pool_bytes)
        self.hostname = hostname

    def validate(self) -> None:
        """Raise ``ValueError`` for a threshold below one byte or a negative pool."""
        super().validate()
        if self.shm_min_bytes < 1:
            raise ValueError(f"shm_min_bytes must be at least 1, got {self.shm_min_bytes}")
        if self.shm_pool_bytes < 0:
            raise ValueError(f"shm_pool_bytes must be at least 0, got {self.shm_pool_bytes}")
