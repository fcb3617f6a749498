"""Options of the zmq backend."""

from __future__ import annotations

from typing import Any

from rpcx import TensorPipeRpcBackendOptions

__all__ = ["ZmqRpcBackendOptions"]

DEFAULT_HEARTBEAT_INTERVAL = 3.0
DEFAULT_HEARTBEAT_TIMEOUT = 30.0


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
        heartbeat_interval: seconds between ZeroMQ heartbeats on each connection. A dead
            process is seen at once (its connections close); heartbeats catch a host that
            vanished without closing them. ``0`` turns heartbeats off.
        heartbeat_timeout: seconds without any traffic (heartbeats included) after which
            a connection, and so its peer, counts as lost.
    """

    def __init__(
        self,
        *,
        hostname: str | None = None,
        interface: str | None = None,
        ipc: bool = True,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.hostname = hostname
        self.interface = interface
        self.ipc = ipc
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout

    def validate(self) -> None:
        """Check torch's fields, then the zmq ones."""
        super().validate()
        if self.hostname is not None and self.interface is not None:
            raise ValueError("give hostname or interface, not both")
        for name in ("hostname", "interface"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.heartbeat_interval < 0:
            raise ValueError(
                f"heartbeat_interval must be >= 0 seconds, got {self.heartbeat_interval}"
            )
        if self.heartbeat_interval > 0 and self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout} s) must exceed "
                f"heartbeat_interval ({self.heartbeat_interval} s)"
            )
