"""Connecting stream sockets into a world: the handshake (:func:`hello`,
:func:`introduce`, :func:`admit`, with a world key's challenge-response), the mesh at
start (:func:`connect_stream_mesh`), a newcomer's connections to every member
(:func:`join_stream_mesh`), and the :class:`Doorway` that admits later ones.
:class:`~rpcx.transport_kit.sockets.StreamTransport` builds on it; so may any transport
over stream sockets.
"""

from __future__ import annotations

import contextlib
import json
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rpcx._wire import auth as _auth
from rpcx.errors import AuthenticationError, RpcError, RpcTimeoutError
from rpcx.transport import TransportContext
from rpcx.transport_kit.starting import connect_limit

__all__ = [
    "ADMITTED", "HANDSHAKE_TIMEOUT", "Doorway", "admit", "connect_stream_mesh", "dial_pair",
    "dial_tcp", "hello", "introduce", "join_stream_mesh", "publish_stream_address",
    "receive_exactly",
]

log = logging.getLogger("rpcx.transport_kit")

HANDSHAKE_TIMEOUT = 10.0  # seconds a new connection may take to introduce itself
_HELLO = struct.Struct("<16sI")  # magic (the transport's label), rank of the connecting worker
_NONCE, _PROOF = _auth.NONCE_BYTES, _auth.TAG_BYTES


# ------------------------------------------------------------------------- handshake


def _magic(label: str) -> bytes:
    return f"rpcx-{label}".encode()[:16]


def receive_exactly(sock: socket.socket, count: int) -> bytes:
    """Read exactly ``count`` bytes; ``EOFError`` if the connection closes first."""
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise EOFError("connection closed during the handshake")
        data += chunk
    return bytes(data)


def introduce(sock: socket.socket, ctx: TransportContext, rank: int, label: str) -> None:
    """This worker's side of a new connection to ``rank``: its hello and, with a world
    key, a mutual challenge-response (``rank`` proves the key first).
    ``AuthenticationError`` if ``rank`` fails."""
    sock.sendall(_HELLO.pack(_magic(label), ctx.rank))
    if ctx.auth is None:
        return
    challenge = ctx.auth.challenge()
    sock.sendall(challenge)
    answer = receive_exactly(sock, _NONCE + _PROOF)
    theirs, proof = answer[:_NONCE], answer[_NONCE:]
    if not ctx.auth.check(f"{label} accept", rank, ctx.rank, challenge, proof):
        raise AuthenticationError(
            f"init_rpc: worker {ctx.names[ctx.rank]!r} (rank {ctx.rank}): the {label} "
            f"connection to rank {rank} failed authentication (its socket is not that "
            "worker's)")
    sock.sendall(ctx.auth.proof(f"{label} connect", ctx.rank, rank, theirs))


def admit(conn: socket.socket, ctx: TransportContext, label: str,
          expected: Callable[[int], bool], joining: bool = False) -> int | None:
    """The rank of a connection this worker accepted, or ``None`` (logged: "refused an
    <label> connection ...") for one that is no ``expected`` rank's or, with a world key,
    fails the challenge-response. A stranger that sends nothing is given up on after
    ``HANDSHAKE_TIMEOUT`` seconds. ``joining``: the connection is a worker's joining a
    dynamic world (its session is read first: ``ConnectionAuth.renew``)."""
    me = ctx.names[ctx.rank]
    conn.settimeout(HANDSHAKE_TIMEOUT)
    try:
        magic, rank = _HELLO.unpack(receive_exactly(conn, _HELLO.size))
        rank = int(rank)
        if magic != _magic(label).ljust(16, b"\0") or not expected(rank):
            log.warning("%s: refused an %s connection that is no expected worker's", me, label)
            return None
        if ctx.auth is not None:
            if joining:
                ctx.auth.renew(rank)
            challenge = ctx.auth.challenge()
            theirs = receive_exactly(conn, _NONCE)
            conn.sendall(challenge + ctx.auth.proof(f"{label} accept", ctx.rank, rank, theirs))
            proof = receive_exactly(conn, _PROOF)
            if not ctx.auth.check(f"{label} connect", rank, ctx.rank, challenge, proof):
                log.warning("%s: refused an %s connection claiming to be rank %d: it failed "
                            "authentication", me, label, rank)
                return None
    except (OSError, EOFError, RpcError) as exc:
        log.warning("%s: refused an %s connection: %s", me, label, exc)
        return None
    return rank


def hello(ctx: TransportContext, label: str, rank: int | None = None) -> bytes:
    """The hello a worker of rank ``rank`` (default: this one) opens a connection with."""
    return _HELLO.pack(_magic(label), ctx.rank if rank is None else rank)


# ------------------------------------------------------------------------------ mesh


def _published(ctx: TransportContext, label: str, ranks: list[int]) -> dict[int, Any]:
    """The addresses ``ranks`` published under ``label``, waiting for them: one store
    operation (a large world's workers would otherwise each make one per peer)."""
    if not ranks:
        return {}
    values = ctx.store.multi_get([f"{label}/{rank}" for rank in ranks])
    return {rank: json.loads(value) for rank, value in zip(ranks, values, strict=True)}


def connect_stream_mesh(
    ctx: TransportContext,
    listener: socket.socket | Sequence[socket.socket],
    address: Any,
    dial: Callable[[Any, float | None], socket.socket],
    label: str,
    check: Callable[[dict[int, Any]], None] | None = None,
) -> dict[int, socket.socket]:
    """One connected, introduced stream socket per peer, bounded by ``rpc_timeout``.

    ``listener`` is bound and listening (or several, e.g. a Unix socket for peers on
    this host and a TCP one for the others); ``address`` (anything JSON can write) is how
    peers reach it, published in the store as ``"<label>/<rank>"``. ``check(addresses)``
    may refuse the world (raise) once every peer's address is known. Each worker dials
    the lower ranks (``dial(address, timeout)`` returns a connected socket) and accepts
    the higher ones; each connection runs :func:`introduce` / :func:`admit`. The sockets
    are returned blocking (no timeout); the caller closes the listener.
    """
    limit = connect_limit(ctx)
    ctx.store.set(f"{label}/{ctx.rank}", json.dumps(address))
    addresses = _published(ctx, label, [r for r in range(ctx.world_size) if r != ctx.rank])
    if check is not None:
        check(addresses)
    sockets: dict[int, socket.socket] = {}
    acceptor = _Acceptor(listener, limit)
    try:
        for rank in range(ctx.rank):
            sock = sockets[rank] = dial(addresses[rank], limit)
            sock.settimeout(limit)
            introduce(sock, ctx, rank, label)
        while len(sockets) < ctx.world_size - 1:
            try:
                conn = acceptor.accept()
            except TimeoutError:
                missing = [ctx.names[r] for r in range(ctx.rank + 1, ctx.world_size)
                           if r not in sockets]
                raise RpcTimeoutError(
                    f"init_rpc: worker {ctx.names[ctx.rank]!r} (rank {ctx.rank}): no {label} "
                    f"connection from {', '.join(missing)} within {limit:g} s (rpc_timeout)"
                ) from None
            admitted = admit(conn, ctx, label,
                             lambda r: ctx.rank < r < ctx.world_size and r not in sockets)
            if admitted is None:
                conn.close()
            else:
                sockets[admitted] = conn
    except BaseException:
        for sock in sockets.values():
            sock.close()
        raise
    finally:
        acceptor.close()
    for sock in sockets.values():
        sock.settimeout(None)
    return sockets


# A member's answer to a newcomer of a dynamic world, once its hello is checked.
ADMITTED, _REFUSED = b"\x01", b"\x00"
# An on-demand mesh's answers besides ADMITTED: the pair's connection is the one the
# answering worker dials (wait for it), or that worker is closing or has given this one
# up (do not wait).
THEIRS_WINS, GONE = b"\x02", b"\x03"


def dial_tcp(address: dict[str, Any], timeout: float | None) -> socket.socket:
    """Connect to ``address["tcp"]`` (``[host, port]``, as published for a doorway),
    bounded by ``timeout``: the ``dial`` a transport whose doorway is a plain TCP
    listener gives :func:`join_stream_mesh`."""
    where, port = address["tcp"]
    sock = socket.socket(socket.AF_INET6 if ":" in where else socket.AF_INET,
                         socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect((where, port))
    except BaseException:
        sock.close()
        raise
    return sock


def join_stream_mesh(
    ctx: TransportContext,
    address: Any,
    dial: Callable[[Any, float | None], socket.socket],
    label: str,
    check: Callable[[dict[int, Any]], None] | None = None,
) -> dict[int, socket.socket]:
    """A newcomer's connections in a dynamic world: one per member, each admitted.

    Publishes ``address`` as :func:`connect_stream_mesh` does, then dials every member
    (every rank but this one that ``ctx.vacant`` does not call vacant), introduces
    itself and waits, bounded by ``rpc_timeout``, for the member's :class:`Doorway` to
    admit it. ``RpcError`` naming the member if one refuses.
    """
    limit = connect_limit(ctx)
    ctx.store.set(f"{label}/{ctx.rank}", json.dumps(address))
    members = [rank for rank in range(len(ctx.names))
               if rank != ctx.rank and not ctx.vacant(rank)]
    addresses = _published(ctx, label, members)
    if check is not None:
        check(addresses)
    sockets: dict[int, socket.socket] = {}
    try:
        for rank in members:
            sock = sockets[rank] = dial(addresses[rank], limit)
            sock.settimeout(limit)
            introduce(sock, ctx, rank, label)
            try:
                answer = receive_exactly(sock, 1)
            except TimeoutError:
                raise RpcTimeoutError(
                    f"init_rpc: worker {ctx.names[ctx.rank]!r} (rank {ctx.rank}): worker "
                    f"{ctx.names[rank]!r} did not admit it within {limit:g} s "
                    "(rpc_timeout)") from None
            except (EOFError, OSError) as exc:  # it closed the connection: refused
                answer = _REFUSED
                log.debug("%s: %s ended the connection: %s", ctx.names[ctx.rank],
                          ctx.names[rank], exc)
            if answer != ADMITTED:
                raise RpcError(
                    f"init_rpc: worker {ctx.names[rank]!r} (rank {rank}) refused worker "
                    f"{ctx.names[ctx.rank]!r} (rank {ctx.rank}) into the dynamic world "
                    "(its log says why)")
            sock.settimeout(None)
    except BaseException:
        for sock in sockets.values():
            sock.close()
        raise
    return sockets


def publish_stream_address(ctx: TransportContext, address: Any, label: str
                           ) -> dict[int, Any]:
    """An on-demand mesh's start: publish ``address`` as :func:`connect_stream_mesh`
    does and read every peer's, connecting to none (:func:`dial_pair` does, when a pair
    first talks). Two store operations, whatever the world's size."""
    ctx.store.set(f"{label}/{ctx.rank}", json.dumps(address))
    return _published(ctx, label, [r for r in range(ctx.world_size) if r != ctx.rank])


_DIAL_RETRY_FIRST, _DIAL_RETRY_LAST = 0.005, 0.2  # pauses between tries on a full backlog


def dial_pair(ctx: TransportContext, rank: int, address: Any,
              dial: Callable[[Any, float | None], socket.socket], label: str,
              timeout: float) -> socket.socket | None:
    """Connect to ``rank`` of an on-demand mesh, within ``timeout`` seconds: dial its
    published ``address``, introduce this worker, read its answer.

    The connected socket (blocking) when ``rank`` admitted it; ``None`` when it refused
    it because its own connection to this worker wins (see
    :meth:`StreamTransport.pair`). A listener whose backlog is full (many workers
    dialing one at once) is tried again until ``timeout``. ``OSError`` (``TimeoutError``,
    ``ConnectionError``: it is closing, gave this worker up, or ended the connection)
    or ``EOFError`` when ``rank`` cannot be reached; ``AuthenticationError`` when it is
    not who it should be.
    """
    deadline = time.monotonic() + timeout
    pause = _DIAL_RETRY_FIRST
    while True:
        try:
            sock = dial(address, max(0.001, deadline - time.monotonic()))
            break
        except (BlockingIOError, InterruptedError):  # EAGAIN: the backlog is full
            if time.monotonic() + pause > deadline:
                raise TimeoutError(f"rank {rank}'s listener stayed full for "
                                   f"{timeout:g} s") from None
            time.sleep(pause)  # (nothing to wait on: the listener is another process's)
            pause = min(2 * pause, _DIAL_RETRY_LAST)
    try:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        introduce(sock, ctx, rank, label)
        try:
            answer = receive_exactly(sock, 1)
        except EOFError:
            raise ConnectionError("it closed the connection during the handshake (a "
                                  "different world key, or it ended)") from None
        if answer == THEIRS_WINS:
            sock.close()
            return None
        if answer != ADMITTED:
            raise ConnectionError("it is shutting down, or gave this worker up")
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise


class Doorway:
    """Admits the workers that join a dynamic world after this one started.

    A thread accepts connections on ``listeners`` until :meth:`close`. Each one runs
    :func:`admit` (a newcomer is any rank ``expected`` accepts), then
    ``welcome(rank, sock)``, which makes the newcomer a peer: it calls
    ``TransportContext.admit``, then writes :data:`ADMITTED` on the socket as its very
    first byte (before any frame: a sender may find the newcomer as soon as the agent
    admitted it) and starts receiving (:meth:`StreamTransport.welcome` does all that). A
    ``welcome`` that raises refuses the newcomer (logged). ``cleanup`` runs once the
    thread is done with the listeners (close them, remove a socket file).
    """

    def __init__(self, ctx: TransportContext, listeners: Sequence[socket.socket], label: str,
                 expected: Callable[[int], bool],
                 welcome: Callable[[int, socket.socket], None],
                 cleanup: Callable[[], None]) -> None:
        self._ctx = ctx
        self._label = label
        self._expected = expected
        self._welcome = welcome
        self._cleanup = cleanup
        self._selector = selectors.DefaultSelector()
        for listener in listeners:
            listener.setblocking(False)
            self._selector.register(listener, selectors.EVENT_READ)
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"rpcx-{ctx.names[ctx.rank]}-{label}-doorway", daemon=True)

    def start(self) -> None:
        """Start admitting newcomers."""
        self._thread.start()

    def close(self, timeout: float = HANDSHAKE_TIMEOUT) -> None:
        """Admit nobody from now on; waits (bounded) for a newcomer being admitted."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        elif not self._thread.is_alive():
            self._release()

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                for key, _ in self._selector.select():
                    if key.fileobj is self._wake_read or self._closed.is_set():
                        continue
                    listener: socket.socket = key.fileobj  # type: ignore[assignment]
                    try:
                        conn, _ = listener.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as exc:
                        log.warning("%s: accepting a worker that joins failed: %s",
                                    self._ctx.names[self._ctx.rank], exc)
                        continue
                    conn.setblocking(True)
                    self._greet(conn)
        finally:
            self._release()

    def _greet(self, conn: socket.socket) -> None:
        ctx = self._ctx
        rank = admit(conn, ctx, self._label, self._expected, joining=True)
        if rank is None:
            conn.close()
            return
        try:
            self._welcome(rank, conn)
        except Exception as exc:
            log.warning("%s: refused rank %d into the dynamic world: %s",
                        ctx.names[ctx.rank], rank, exc)
            with contextlib.suppress(OSError):
                conn.sendall(_REFUSED)
            conn.close()

    def _release(self) -> None:
        with contextlib.suppress(Exception):
            for key in list(self._selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            self._wake_write.close()
        self._cleanup()


class _Acceptor:
    """Accepts the next connection on any of several listeners, all within one bound."""

    def __init__(self, listener: socket.socket | Sequence[socket.socket],
                 limit: float | None) -> None:
        listeners = [listener] if isinstance(listener, socket.socket) else list(listener)
        self._selector = selectors.DefaultSelector()
        for each in listeners:
            each.setblocking(False)
            self._selector.register(each, selectors.EVENT_READ)
        self._deadline = None if limit is None else time.monotonic() + limit

    def accept(self) -> socket.socket:
        """The next connection, blocking; ``TimeoutError`` past the bound."""
        while True:
            left = None if self._deadline is None else self._deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError
            for key, _ in self._selector.select(left):
                listener: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    conn, _ = listener.accept()
                except BlockingIOError:  # the connection attempt went away meanwhile
                    continue
                conn.setblocking(True)
                return conn

    def close(self) -> None:
        self._selector.close()
