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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rpcx.backends.socket_options import SocketRpcBackendOptions
from rpcx.hosts import address_towards, default_address, host_identity, resolve
from rpcx.transport import TransportContext
from rpcx.transport_kit import (
    connect_stream_mesh,
    dial_pair,
    join_stream_mesh,
    publish_stream_address,
)

__all__ = ["Policy", "Route", "connect_mesh", "join_mesh", "listen_mesh", "route_between",
           "route_to_newcomer", "tune"]

_SOCKET_BUFFER = 4 << 20  # SO_SNDBUF/SO_RCVBUF: room for a burst of small frames
# TCP_NOTSENT_LOWAT: bytes a TCP socket holds unsent at most before a write waits. Without
# it a bulk transfer fills the whole send buffer (8 MiB: 67 ms at 1 Gbit/s), and a small
# frame that passes the transfer's pieces still waits behind all of it in the kernel.
# Beside a 64 MiB transfer at 1 Gbit/s a small call took 70 ms without it, 4.4 ms at
# 128 KiB, 2.2 ms at 32 KiB (idle: 0.1 ms); bulk rates on loopback TCP did not drop.
_UNSENT_BYTES = 32 << 10
_TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)  # (Linux's value)


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
    routes, listeners = _routes_and_listeners(ctx, label, policy, options, host)
    try:
        sockets = connect_stream_mesh(ctx, listeners.sockets, listeners.address,
                                      listeners.dial(policy), label,
                                      check=lambda addresses: _same_way(ctx, addresses, False))
    finally:
        listeners.close()
    return _tuned(sockets, routes), routes


DialPeer = Callable[[int, float], "socket.socket | None"]  # (rank, timeout) -> socket


def listen_mesh(ctx: TransportContext, label: str, policy: Policy,
                options: SocketRpcBackendOptions, host: str | None = None
                ) -> tuple[dict[int, Route], _Listeners, DialPeer]:
    """An on-demand mesh's :func:`connect_mesh`: learn every peer's route and address
    and open the listeners, connecting to nobody. Returns the routes, the listeners
    (the caller opens a doorway on them and closes them at the end) and how to connect
    to a peer when the pair first talks (see :func:`~rpcx.transport_kit.dial_pair`)."""
    routes, listeners = _routes_and_listeners(ctx, label, policy, options, host)
    try:
        addresses = publish_stream_address(ctx, {**listeners.address, "on_demand": True},
                                           label)
        _same_way(ctx, addresses, True)
    except BaseException:
        listeners.close()
        raise
    dial = listeners.dial(policy)

    def dial_peer(rank: int, timeout: float) -> socket.socket | None:
        return dial_pair(ctx, rank, addresses[rank], dial, label, timeout)
    return routes, listeners, dial_peer


def join_mesh(ctx: TransportContext, label: str, policy: Policy,
              options: SocketRpcBackendOptions, host: str | None = None
              ) -> tuple[dict[int, socket.socket], dict[int, Route], _Listeners]:
    """A dynamic world's :func:`connect_mesh`: connect to every member (one socket
    each, admitted by its doorway), and keep listening, for the routes later workers
    may need, on what the returned listeners hold (the caller opens a doorway on them
    and closes them at the end)."""
    host = host if host is not None else host_identity()
    members = [rank for rank in range(len(ctx.names))
               if rank != ctx.rank and not ctx.vacant(rank)]
    routes = _learn_routes(ctx, label, policy, host, members)
    listeners = _Listeners(ctx, options, host, local=policy is not Policy.TCP,
                           remote=policy is not Policy.SHM)
    try:
        sockets = join_stream_mesh(ctx, listeners.address, listeners.dial(policy), label)
    except BaseException:
        listeners.close()
        raise
    return _tuned(sockets, routes), routes, listeners


def route_to_newcomer(ctx: TransportContext, label: str, policy: Policy, rank: int,
                      host: str | None = None) -> Route:
    """The route to a worker that joined a dynamic world at ``rank`` (it published its
    host before connecting); ``RuntimeError`` where the policy refuses it."""
    host = host if host is not None else host_identity()
    theirs = ctx.store.get(f"{label}/host/{rank}").decode()
    if policy is Policy.SHM:
        _refuse_other_hosts(ctx, host, {rank: theirs})
    return route_between(policy, host, theirs)


def tune(sock: socket.socket, route: Route) -> socket.socket:
    """Socket options for a peer's socket on ``route``."""
    if not route.local:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with contextlib.suppress(OSError):  # (a kernel without it: small frames wait longer)
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, _UNSENT_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
    return sock


def _tuned(sockets: dict[int, socket.socket], routes: dict[int, Route]
           ) -> dict[int, socket.socket]:
    return {rank: tune(sock, routes[rank]) for rank, sock in sockets.items()}


def _routes_and_listeners(ctx: TransportContext, label: str, policy: Policy,
                          options: SocketRpcBackendOptions, host: str | None
                          ) -> tuple[dict[int, Route], _Listeners]:
    """A static world's routes to every peer, and the listeners those routes need (a
    worker with no peer on another host listens on no network address)."""
    host = host if host is not None else host_identity()
    routes = _learn_routes(ctx, label, policy, host,
                           [rank for rank in range(ctx.world_size) if rank != ctx.rank])
    listeners = _Listeners(ctx, options, host,
                           local=any(route.local for route in routes.values()),
                           remote=not all(route.local for route in routes.values()))
    return routes, listeners


def _learn_routes(ctx: TransportContext, label: str, policy: Policy, host: str,
                  peers: list[int]) -> dict[int, Route]:
    """Publish this worker's host, read the ``peers``' hosts; their routes."""
    ctx.store.set(f"{label}/host/{ctx.rank}", host)
    values = ctx.store.multi_get([f"{label}/host/{rank}" for rank in peers]) if peers else []
    hosts = {rank: value.decode() for rank, value in zip(peers, values, strict=True)}
    if policy is Policy.SHM:
        _refuse_other_hosts(ctx, host, hosts)
    return {rank: route_between(policy, host, theirs) for rank, theirs in hosts.items()}


class _Listeners:
    """The listeners a worker opens: a Unix socket (``local``: peers on this host) and
    a TCP one (``remote``: peers elsewhere), and the address peers dial them at."""

    def __init__(self, ctx: TransportContext, options: SocketRpcBackendOptions, host: str,
                 *, local: bool, remote: bool) -> None:
        self.sockets: list[socket.socket] = []
        self.address: dict[str, Any] = {"host": host}
        self._host = host
        self._directory: str | None = None
        try:
            if local:
                self._directory = tempfile.mkdtemp(prefix="rpcx-shm-")
                self.address["path"] = os.path.join(self._directory, "socket")
                self.sockets.append(_listen(socket.AF_UNIX, self.address["path"],
                                            ctx.world_size))
            if remote:
                where = _listen_host(ctx, options)
                family = socket.AF_INET6 if ":" in where else socket.AF_INET
                listener = _listen(family, (where, 0), ctx.world_size)
                self.sockets.append(listener)
                self.address["tcp"] = [where, listener.getsockname()[1]]
        except BaseException:
            self.close()
            raise

    def dial(self, policy: Policy) -> Callable[[dict[str, Any], float | None], socket.socket]:
        """How this worker dials a peer's published address."""
        host = self._host

        def dial(theirs: dict[str, Any], timeout: float | None) -> socket.socket:
            if route_between(policy, host, theirs["host"]).local:
                return _dial(socket.AF_UNIX, theirs["path"], timeout)
            where, port = theirs["tcp"]
            return _dial(socket.AF_INET6 if ":" in where else socket.AF_INET,
                         (where, port), timeout)
        return dial

    def close(self) -> None:
        """Close the listeners and remove the Unix socket's file and folder."""
        for listener in self.sockets:
            listener.close()
        if self._directory is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address["path"])
            with contextlib.suppress(OSError):
                os.rmdir(self._directory)
            self._directory = None


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


def _same_way(ctx: TransportContext, addresses: dict[int, Any], on_demand: bool) -> None:
    """Refuse a world whose workers do not all connect the same way (on demand or up
    front: ``connect_on_demand``, ``$RPCX_CONNECT_ON_DEMAND``), naming the others."""
    others = sorted(rank for rank, theirs in addresses.items()
                    if bool(theirs.get("on_demand")) != on_demand)
    if not others:
        return
    names = ", ".join(repr(ctx.names[rank]) for rank in others[:8])
    more = f" and {len(others) - 8} more" if len(others) > 8 else ""
    mine, theirs = ("on demand", "up front") if on_demand else ("up front", "on demand")
    raise RuntimeError(
        f"init_rpc: worker {ctx.names[ctx.rank]!r} (rank {ctx.rank}) connects its peers "
        f"{mine}, but {names}{more} connect {theirs}: give every worker the same "
        "connect_on_demand (or $RPCX_CONNECT_ON_DEMAND)")


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
