""":class:`StreamTransport`, with which a socket backend writes only ``connect``,
``read_one`` and ``pack``: the kit's :class:`~rpcx.transport_kit.message.MessageTransport`
over stream sockets. Each peer is a :class:`~rpcx.transport_kit.socket_link.SocketLink`
(its reader, and writes that never wait on the socket); the handshake and the mesh are
:mod:`~rpcx.transport_kit.mesh`. A static world may connect its pairs on demand (when
they first talk), which this module does too.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import ClassVar, TypeVar, cast

from rpcx.errors import AuthenticationError, LostCause, PeerLostError
from rpcx.transport import Frame, TransportContext
from rpcx.transport_kit.connector import Connector
from rpcx.transport_kit.mesh import ADMITTED, GONE, HANDSHAKE_TIMEOUT, THEIRS_WINS
from rpcx.transport_kit.message import MessageTransport
from rpcx.transport_kit.sentences import describe, unreachable
from rpcx.transport_kit.socket_link import Buffer, SocketLink, send_all
from rpcx.transport_kit.starting import connect_limit

__all__ = ["StreamTransport"]

S = TypeVar("S", bound=SocketLink)

log = logging.getLogger("rpcx.transport_kit")

# An on-demand mesh: threads that connect pairs (per worker; see connector.py), and how
# long a worker whose dial lost a crossing waits before it looks (and dials) again.
CONNECTING_THREADS = 4
STARTING_THREADS = 1  # (for the links its doorway admits: never behind a dial)
LOOK_AGAIN_S = 1.0

# ------------------------------------------------------------------------- transport


class StreamTransport(MessageTransport[S]):
    """A transport over one stream socket per pair of workers, most of it written.

    A subclass sets ``capabilities``, ``label`` (names store keys, the handshake and
    messages, e.g. ``"shm"``) and ``bye`` (the bytes of its goodbye), and writes:

    * ``connect(ctx)``: one connected socket per peer rank (usually through
      :func:`connect_stream_mesh`);
    * ``read_one(link)``: the peer's next frame from ``link.reader`` (``fill``, ``take``),
      ``None`` for the goodbye; raise ``ProtocolError`` for what is no frame (check
      announced sizes with :func:`~rpcx.transport_kit.buffers.check_frame_size` against
      ``self.max_frame`` before reading them);
    * ``pack(frame)``: the bytes that carry one frame (views of the tensors are fine:
      what is not written at once is copied).

    The kit does the rest: links, receive loops on lanes, goodbyes, lost peers, sends
    that never wait past ``frame.deadline``, corked replies, and ``close``. In a
    dynamic world, ``connect`` sets ``doorway`` (a
    :class:`~rpcx.transport_kit.mesh.Doorway` calling :meth:`newcomer` and
    :meth:`welcome`) for the workers that join later.
    """

    bye: ClassVar[bytes]
    cork_bytes: ClassVar[int] = 64 << 10  # replies corked at most (0: never cork)

    def __init__(self) -> None:
        super().__init__()
        # In an on-demand mesh (a static world whose pairs connect when they first
        # talk), how to reach a peer (``connect`` sets it, and a doorway that calls
        # :meth:`pair`), and the peers that cannot be reached.
        self.dial_peer: Callable[[int, float], socket.socket | None] | None = None
        self._pairing = threading.Condition()
        # Threads that dial, and that start admitted links' threads (made when needed).
        self._connector: Connector | None = None
        self._starter: Connector | None = None
        self._unreachable: dict[int, str] = {}
        self._pairs_closed = False  # close() began: no pair connects any more
        # Connections this worker dialed, admitted and refused (tie-breaks), for tests.
        self.pairings: collections.Counter[str] = collections.Counter()

    # ----------------------------------------------------------- what a backend writes

    def connect(self, ctx: TransportContext) -> dict[int, socket.socket]:
        """One connected, introduced socket per peer rank (see the class)."""
        raise NotImplementedError

    def read_one(self, link: S) -> Frame | None:
        """The peer's next frame from ``link.reader``; ``None`` for its goodbye."""
        raise NotImplementedError

    def pack(self, frame: Frame) -> list[Buffer]:
        """The bytes that carry ``frame`` (views of its tensors are fine)."""
        raise NotImplementedError

    # ----------------------------------------------------------- hooks, if it needs

    def make_link(self, rank: int, sock: socket.socket | None) -> S:
        """The link for ``rank`` over ``sock`` (``None``: a link of an on-demand mesh, to be
        connected; override to add state of its own)."""
        ctx = self.ctx
        # (a plain SocketLink; a transport with links of its own type overrides this)
        return cast(S, SocketLink(rank, ctx.names[rank], sock,
                                  self.thread_name("send", ctx.names[rank]), ctx.progress))

    def end_connection(self, link: S) -> None:
        """Shut the socket down both ways (after a protocol error: the peer sees it)."""
        link.shutdown()

    def loop_ended(self, link: S) -> None:
        """A receive loop is over, on its thread: release what only it used."""
        link.reader.close()

    def tune_socket(self, rank: int, sock: socket.socket) -> socket.socket:
        """Socket options for a connection to ``rank`` made on demand (see :meth:`pair`)."""
        return sock

    def retire(self, link: S) -> None:
        """A new worker takes the rank of ``link``'s peer, which left (a dynamic world;
        its receive loop is over): release the old link (``close`` only sees the links
        of now). Override to release state of the transport's own, calling this."""
        link.shutdown()
        if link.backlog is not None:
            link.backlog.stop()
        link.sock.close()

    # ---------------------------------------------------------------- the contract

    def start(self, ctx: TransportContext) -> None:
        """Connect to every peer (``connect``) and start receiving; in a dynamic world,
        open the doorway ``connect`` set up for the workers that join later."""
        self._ctx = ctx
        try:
            links = {rank: self.make_link(rank, sock)
                     for rank, sock in self.connect(ctx).items()}
        except BaseException:
            if self.doorway is not None:
                self.doorway.close()
            raise
        self.begin(ctx, links)
        self.open_doorway()

    def link_newcomer(self, rank: int, sock: socket.socket) -> S:
        """A worker joined at ``rank`` over ``sock``: its link, and the answer that it is
        in (the first byte it reads: nobody can send on the link before it is added)."""
        sock.settimeout(None)
        link = self.make_link(rank, sock)
        send_all(sock, [memoryview(ADMITTED)], ())
        return link

    def link_missing(self, dst: int) -> S:
        """In an on-demand mesh, a link not made yet is made now (it connects in the
        background; what is sent meanwhile queues); otherwise the kit's wait for a
        worker being admitted."""
        if self.dial_peer is not None:
            return self._link_on_demand(dst)
        return super().link_missing(dst)

    # ------------------------------------------------------------- on-demand pairs
    #
    # Each pair of an on-demand mesh shares one connection, made by whichever worker
    # first sends to the other. The link exists at once (senders queue on its held
    # backlog and go on); a connector thread (one of a few per worker) connects it.
    # When both workers dial at once, the connection dialed by the lower rank wins:
    # each worker's doorway refuses a dial from a higher rank while it dials that rank
    # itself, and attaches one from a lower rank to its own link; the dial refused
    # looks again a while later. Every decision is taken under ``_pairing``, so a link
    # is attached once; no thread is started under it (a start waits for the thread).

    def _link_on_demand(self, dst: int) -> S:
        ctx, peers = self.ctx, self.peers
        if not 0 <= dst < ctx.world_size or dst == ctx.rank:
            raise PeerLostError(unreachable(f"no peer has rank {dst}"),
                                cause=LostCause.CONNECTION_LOST)
        with self._pairing:
            link = peers.links.get(dst)
            if link is not None:
                return link
            if dst in self._unreachable:
                raise PeerLostError(unreachable(self._unreachable[dst]),
                                    cause=LostCause.CONNECTION_LOST)
            if peers.closing or self._pairs_closed:
                raise PeerLostError(unreachable("this worker is shutting down"),
                                    cause=LostCause.CONNECTION_LOST)
            link = self.make_link(dst, None)  # (its backlog holds what is sent)
            peers.add(link, receive=False)
            connector = self._connecting()
        bound = connect_limit(ctx) or HANDSHAKE_TIMEOUT
        try:
            connector.submit(functools.partial(self._connect, link, bound,
                                               time.monotonic() + bound))
        except RuntimeError as exc:  # (a crowded host: no thread to connect with)
            failure = f"could not connect: {describe(exc)}"
            with self._pairing:
                self._give_up(link, failure)
            self._lost(link, failure)
            raise PeerLostError(unreachable(failure),
                                cause=LostCause.CONNECTION_LOST) from None
        return link

    def _connecting(self) -> Connector:
        """(Under ``_pairing``.) The connector that dials, made with the first dial."""
        if self._connector is None:
            self._connector = self._new_connector("connect", CONNECTING_THREADS)
        return self._connector

    def _starting(self) -> Connector:
        """(Under ``_pairing``.) The connector that starts admitted links' threads."""
        if self._starter is None:
            self._starter = self._new_connector("start", STARTING_THREADS)
        return self._starter

    def _new_connector(self, role: str, limit: int) -> Connector:
        return Connector(self.thread_name(f"{self.label}-{role}"), limit)

    def _connect(self, link: S, bound: float, deadline: float) -> None:
        """Connect ``link`` (a connector job): dial the peer. When the peer's own
        connection wins (it comes through the doorway: :meth:`pair`), look again in a
        while, dialing again if it has not come (a peer that died meanwhile then fails
        the dial). The peer is reported lost, and what was queued fails, if no
        connection comes by ``deadline`` (``bound`` seconds after the first send)."""
        dial = self.dial_peer
        assert dial is not None
        if link.attached.is_set() or link.ended.is_set():
            return
        failure = None
        sock = None
        try:
            sock = dial(link.rank, max(0.001, deadline - time.monotonic()))
        except (OSError, EOFError, AuthenticationError) as exc:
            failure = f"could not connect: {describe(exc)}"
        with self._pairing:
            if link.attached.is_set() or link.ended.is_set():  # its connection came
                if sock is not None:
                    sock.close()
                return
            if self._pairs_closed:
                failure = "this worker is shutting down"
            elif failure is None and sock is not None:
                failure = self._attach(link, sock, "dialed")
                sock = None  # (the link's now, or closed)
            elif failure is None:  # its connection wins: it comes through the doorway
                now = time.monotonic()
                if now < deadline:
                    assert self._connector is not None
                    self._connector.submit(functools.partial(self._connect, link, bound,
                                                             deadline),
                                           at=min(deadline, now + LOOK_AGAIN_S))
                    return
                failure = (f"its connection to this worker did not come within "
                           f"{bound:g} s")
            if failure is not None:
                if sock is not None:
                    sock.close()
                self._give_up(link, failure)
        if failure is None:
            self._receive_attached(link)
        else:
            self._lost(link, failure)

    def _attach(self, link: S, sock: socket.socket, how: str) -> str | None:
        """(Under ``_pairing``.) ``sock`` is ``link``'s connection from now on;
        :meth:`_receive_attached` follows, after the lock. What went wrong, if it
        could not be (the socket is then closed)."""
        try:
            with link.lock:
                link.attach(self.tune_socket(link.rank, sock))
        except Exception as exc:  # (a socket option the system refuses)
            sock.close()
            return f"could not use its connection: {describe(exc)}"
        self.pairings[how] += 1
        self._pairing.notify_all()
        return None

    def _give_up(self, link: S, failure: str) -> None:
        """(Under ``_pairing``.) ``link``'s peer cannot be reached, for good: no dial or
        connection is taken for it from now on. :meth:`_lost` follows, after the lock."""
        self._unreachable[link.rank] = failure
        link.ended.set()
        self._pairing.notify_all()

    def _lost(self, link: S, failure: str) -> None:
        """(After :meth:`_give_up`.) The link ends: what queued for it fails, and so do
        later sends; its connection, if it has one, is shut down; the peer is reported
        lost."""
        with link.lock:
            link.end(LostCause.CONNECTION_LOST, failure)
            if link.attached.is_set():
                link.shutdown()  # (the peer sees the connection end; a writer's write fails)
            assert link.backlog is not None
            if not link.backlog.running:
                link.backlog.fail(ConnectionError(failure))
        self.peers.lost(link, LostCause.CONNECTION_LOST, failure)

    def _receive_attached(self, link: S) -> None:
        """Write what queued for a link just attached and start receiving on it (not
        under ``_pairing``: a thread start waits for the new thread). A thread that
        cannot start (a crowded host) ends the connection and reports the peer lost."""
        try:
            with link.lock:
                link.release_queued()  # (done already for one the doorway admitted)
            self.peers.receive(link)
        except Exception as exc:
            self._threads_failed(link, exc)

    def _threads_failed(self, link: S, exc: BaseException) -> None:
        """An attached link whose threads could not start (a crowded host): the peer is
        given up and the link ends."""
        failure = f"could not start its threads: {describe(exc)}"
        with self._pairing:
            self._give_up(link, failure)
        self._lost(link, failure)

    def may_pair(self, rank: int) -> bool:
        """Whether a connection from ``rank`` may be an on-demand mesh's peer (its
        doorway asks before the handshake's proof)."""
        ctx = self.ctx
        return 0 <= rank < ctx.world_size and rank != ctx.rank

    def pair(self, rank: int, sock: socket.socket) -> None:
        """A peer of an on-demand mesh connected (the doorway calls this, once the
        handshake passed): admit the connection as the pair's, unless this worker dials
        ``rank`` itself and is the lower rank (its own connection wins: the dialer is
        told to wait for it), or the pair has a connection already, or this worker is
        closing or gave ``rank`` up (the dialer is told not to wait)."""
        ctx, peers = self.ctx, self.peers
        with self._pairing:
            link = peers.links.get(rank)
            if (self._pairs_closed or rank in self._unreachable
                    or (link is not None and (link.attached.is_set() or link.ended.is_set()))):
                answer = GONE
            elif link is not None and ctx.rank < rank:
                answer = THEIRS_WINS
                self.pairings["refused"] += 1
            else:
                answer = ADMITTED
            if answer != ADMITTED:
                log.debug("%s: %s's connection refused (%s)", ctx.names[ctx.rank],
                          ctx.names[rank], "this worker's wins" if answer == THEIRS_WINS
                          else "the pair has one, or this worker closes or gave it up")
                with contextlib.suppress(OSError):
                    sock.sendall(answer)
                sock.close()
                return
            try:
                sock.settimeout(None)
                send_all(sock, [memoryview(ADMITTED)], ())
            except OSError as exc:  # (it gave up meanwhile)
                log.debug("%s: admitting %s failed: %s", ctx.names[ctx.rank],
                          ctx.names[rank], exc)
                sock.close()
                return
            if link is None:
                link = self.make_link(rank, None)
                peers.add(link, receive=False)
            failure = self._attach(link, sock, "admitted")
            if failure is not None:
                self._give_up(link, failure)
            starter = self._starting()
        if failure is not None:  # (the dialer sees the connection end)
            self._lost(link, failure)
            return
        # What queued for the peer (its requests, when both dialed) goes now, on this
        # thread; the link's threads are started on a starter thread (never behind a
        # dial): the doorway answers the next worker meanwhile.
        try:
            with link.lock:
                link.release_queued()
        except Exception as exc:  # (a writer thread for a rest that cannot start)
            self._threads_failed(link, exc)
            return
        try:
            handed = starter.submit(functools.partial(self._receive_attached, link))
        except RuntimeError:
            handed = False
        if not handed:  # (no thread to hand it to, or this worker began closing)
            self._receive_attached(link)

    def stop_connecting(self) -> None:
        """An on-demand mesh's part of ``close``: connect no pair any more, and let go
        of the links still connecting (they have no goodbye to wait for)."""
        peers = self.peers
        if self.dial_peer is None:
            return
        with self._pairing:
            self._pairs_closed = True
            self._pairing.notify_all()
            waiting = [link for link in peers if not link.attached.is_set()]
            connector, starter = self._connector, self._starter
        if connector is not None:
            connector.close()  # (the links it would have dialed are waiting: below)
        if starter is not None:
            for start in starter.close():  # admitted links: receive their goodbyes
                start()
        for link in waiting:
            with link.lock:
                link.reported = True  # (closing: not a loss to report)
                assert link.backlog is not None
                link.backlog.fail(ConnectionError("this worker is shutting down"))
            link.ended.set()

    def connects_on_demand(self) -> bool:
        """Whether this is an on-demand mesh (pairs connect when they first talk)."""
        return self.dial_peer is not None

    def connected(self, rank: int) -> bool:
        """Whether this worker has a connection to ``rank`` now: in an on-demand mesh,
        once the pair first talked; otherwise always."""
        if self.dial_peer is None:
            return True
        link = self.links.get(rank)
        return link is not None and link.attached.is_set()

    def send(self, dst: int, frame: Frame) -> None:
        """Write ``frame`` to ``dst``; returns once written, or at ``frame.deadline``
        with the rest queued for the peer's writer."""
        self.link(dst).send(self.pack(frame), deadline=frame.deadline,
                            cork=0 if frame.buffers else self.cork_bytes,
                            settled=frame.settled)

    def write_bye(self, link: S) -> None:
        """Write the goodbye (under ``link.lock``; queued behind a peer that reads
        nothing: ``close`` shuts the socket down after waiting, which ends the writer)."""
        link.write_locked([self.bye])

    def release_link(self, link: S, deadline: float) -> None:
        """At ``close``, after the goodbyes: shut the connection down (a writer blocked
        on a peer that reads nothing ends), wait for the writer, close the socket."""
        link.shutdown()
        super().release_link(link, deadline)
        link.sock.close()
