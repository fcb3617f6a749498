"""Which socket each pair of workers shares, and connecting them.

Every worker publishes its host (:func:`rpcx.hosts.host_identity`) in the store first;
from the hosts, each pair's route follows, the same on both ends: a Unix socket when the
two share a host (and so its shared memory), TCP otherwise. Only then does a worker open
the listeners its routes need (a worker with no peer on another host listens on no
network address) and join the kit's stream mesh through them.
"""

from __future__ import annotations

import contextlib
import enum
import os
import socket
import tempfile
from dataclasses import dataclass
from typing import Any

from rpcx.backends.socket_options import SocketRpcBackendOptions
from rpcx.hosts import address_towards, default_address, host_identity, resolve
from rpcx.transport import TransportContext
from rpcx.transport_kit import connect_stream_mesh

__all__ = ["Policy", "Route", "connect_mesh", "route_between"]

_SOCKET_BUFFER = 4 << 20  # SO_SNDBUF/SO_RCVBUF: room for a burst of small frames


class Policy(str, enum.Enum):
    """How a backend routes its pairs of workers."""

    AUTO = "auto"
    """Shared memory within a host, TCP across hosts."""
    SHM = "shm"
    """Shared memory only: every worker must share this host."""
    TCP = "tcp"
    """TCP for every pair, even on one host."""


@dataclass(frozen=True)
class Route:
    """How this worker reaches one peer, and why."""

    local: bool
    """True: a Unix socket, large tensors through shared memory. False: TCP."""
    why: str

    @property
    def via(self) -> str:
        """``"shm"`` or ``"tcp"``."""
        return "shm" if self.local else "tcp"

    def describe(self) -> str:
        """E.g. ``"shm (same host)"``: what ``debug_info()`` shows for the peer."""
        return f"{self.via} ({self.why})"


def route_between(policy: Policy, mine: str, theirs: str) -> Route:
    """The route between a worker on host ``mine`` and one on host ``theirs``."""
    if policy is Policy.TCP:
        return Route(False, "the tcp backend uses TCP for every pair")
    if mine == theirs:
        return Route(True, "same host")
    name = theirs.split("|", 1)[0]
    if name == mine.split("|", 1)[0]:  # a container, or a reused name: its memory differs
        return Route(False, f"other host: {name}, another boot or mount namespace")
    return Route(False, f"other host: {name}")


def connect_mesh(ctx: TransportContext, label: str, policy: Policy,
                 options: SocketRpcBackendOptions, host: str | None = None
                 ) -> tuple[dict[int, socket.socket], dict[int, Route]]:
    """One connected, introduced socket per peer, and each peer's route. ``host``: this
    worker's host identity (default :func:`~rpcx.hosts.host_identity`)."""
    host = host if host is not None else host_identity()
    ctx.store.set(f"{label}/host/{ctx.rank}", host)
    hosts = {rank: ctx.store.get(f"{label}/host/{rank}").decode()
             for rank in range(ctx.world_size) if rank != ctx.rank}
    routes = {rank: route_between(policy, host, theirs) for rank, theirs in hosts.items()}
    if policy is Policy.SHM:
        _refuse_other_hosts(ctx, host, hosts)
    listeners: list[socket.socket] = []
    address: dict[str, Any] = {"host": host}
    directory = None
    try:
        if any(route.local for route in routes.values()):
            directory = tempfile.mkdtemp(prefix="rpcx-shm-")
            address["path"] = os.path.join(directory, "socket")
            listeners.append(_listen(socket.AF_UNIX, address["path"], ctx.world_size))
        if not all(route.local for route in routes.values()):
            where = _listen_host(ctx, options)
            family = socket.AF_INET6 if ":" in where else socket.AF_INET
            listener = _listen(family, (where, 0), ctx.world_size)
            listeners.append(listener)
            address["tcp"] = [where, listener.getsockname()[1]]

        def dial(theirs: dict[str, Any], timeout: float | None) -> socket.socket:
            if route_between(policy, host, theirs["host"]).local:
                return _dial(socket.AF_UNIX, theirs["path"], timeout)
            where, port = theirs["tcp"]
            return _dial(socket.AF_INET6 if ":" in where else socket.AF_INET,
                         (where, port), timeout)

        sockets = connect_stream_mesh(ctx, listeners, address, dial, label)
    finally:
        for listener in listeners:
            listener.close()
        if directory is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address["path"])
            os.rmdir(directory)
    for rank, sock in sockets.items():
        if not routes[rank].local:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
    return sockets, routes


def _listen_host(ctx: TransportContext, options: SocketRpcBackendOptions) -> str:
    """The address this worker listens on for peers on other hosts."""
    if options.hostname:
        return resolve(options.hostname)
    return address_towards(ctx.init_method) or default_address()


def _listen(family: int, where: Any, backlog: int) -> socket.socket:
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind(where)
        listener.listen(max(1, backlog))
    except BaseException:
        listener.close()
        raise
    return listener


def _dial(family: int, where: Any, timeout: float | None) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(where)
    except BaseException:
        sock.close()
        raise
    return sock


def _refuse_other_hosts(ctx: TransportContext, host: str, hosts: dict[int, str]) -> None:
    """The shm backend's refusal of a world that spans hosts, naming them."""
    elsewhere = {rank: theirs for rank, theirs in hosts.items() if theirs != host}
    if not elsewhere:
        return
    others = ", ".join(f"{ctx.names[rank]!r} (rank {rank}) on {theirs}"
                       for rank, theirs in elsewhere.items())
    raise RuntimeError(
        f"init_rpc: the shm backend connects workers of one host only: worker "
        f"{ctx.names[ctx.rank]!r} (rank {ctx.rank}) is on {host}, but {others}; use the "
        "default backend ('auto': shared memory within a host, TCP across hosts)"
    )
