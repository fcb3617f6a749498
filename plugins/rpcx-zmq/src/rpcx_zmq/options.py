"""Options of the zmq backend."""

from __future__ import annotations

from typing import Any

from rpcx import TensorPipeRpcBackendOptions

__all__ = ["ZmqRpcBackendOptions"]

# ZeroMQ ends a connection that has been silent this many heartbeat_timeouts: rpcx has
# reported the peer unresponsive long before (it may still come back until then).
CONNECTION_TIMEOUT_FACTOR = 3


class ZmqRpcBackendOptions(TensorPipeRpcBackendOptions):
    """Options of the zmq backend: torch's fields plus where to listen and how to watch peers.

    Args:
        hostname: the address (or a hostname that resolves to one) this worker listens on
            for peers on other hosts. By default the local address that routes to the
            rendezvous host (``127.0.0.1`` when that host is local), so a cluster needs no
            interface variables.
        interface: a network interface (``"eth0"``) whose address to listen on instead.
        ipc: talk to peers on the same host over ``ipc://`` (Unix domain) sockets, which
            measured faster than TCP over loopback; ``False`` uses TCP for every peer.

    rpcx's ``heartbeat_interval`` and ``heartbeat_timeout`` (``RpcBackendOptions``, 1 s
    and 10 s) also set ZeroMQ's own heartbeats on each connection: one every interval,
    and a connection silent for ``CONNECTION_TIMEOUT_FACTOR`` (3) times the timeout is
    closed, its peer lost. A dead process is seen at once (its connections close); the
    heartbeats catch a host that vanished without closing them, after rpcx has reported
    it unresponsive. ``heartbeat_interval=0`` turns both off.
    """

    def __init__(
        self,
        *,
        hostname: str | None = None,
        interface: str | None = None,
        ipc: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.hostname = hostname
        self.interface = interface
        self.ipc = ipc

    def validate(self) -> None:
        """Check torch's fields, then the zmq ones."""
        super().validate()
        if self.hostname is not None and self.interface is not None:
            raise ValueError("give hostname or interface, not both")
        for name in ("hostname", "interface"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")

