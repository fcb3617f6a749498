""":class:`StreamTransport`, with which a socket backend writes only ``connect``,
``read_one`` and ``pack``. Each peer is a
:class:`~rpcx.transport_kit.socket_link.SocketLink` (its reader, and writes that never
wait on the socket); the handshake and the mesh are :mod:`~rpcx.transport_kit.mesh`.
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
from typing import ClassVar

from rpcx.errors import AuthenticationError, LostCause, PeerLostError
from rpcx.options import DEFAULT_MAX_FRAME_BYTES
from rpcx.transport import Capabilities, Frame, TransportContext
from rpcx.transport_kit.basics import connect_limit, describe, unreachable
from rpcx.transport_kit.connector import Connector
from rpcx.transport_kit.links import Arrivals, Peers
from rpcx.transport_kit.mesh import ADMITTED, GONE, HANDSHAKE_TIMEOUT, THEIRS_WINS, Doorway
from rpcx.transport_kit.socket_link import Buffer, SocketLink, send_all

__all__ = ["StreamTransport"]

log = logging.getLogger("rpcx.transport_kit")

# An on-demand mesh: threads that connect pairs (per worker; see connector.py), and how
# long a worker whose dial lost a crossing waits before it looks (and dials) again.
CONNECTING_THREADS = 4
STARTING_THREADS = 1  # (for the links its doorway admits: never behind a dial)
LOOK_AGAIN_S = 1.0

# ------------------------------------------------------------------------- transport


class StreamTransport:
    """A transport over one stream socket per pair of workers, most of it written.

    A subclass sets ``capabilities``, ``label`` (names store keys, the handshake and
    messages, e.g. ``"shm"``) and ``bye`` (the bytes of its goodbye), and writes:

    * ``connect(ctx)``: one connected socket per peer rank (usually through
      :func:`connect_stream_mesh`);
    * ``read_one(link)``: the peer's next frame from ``link.reader`` (``fill``, ``take``),
      ``None`` for the goodbye; raise ``ProtocolError`` for what is no frame (check
      announced sizes with :func:`~rpcx.transport_kit.basics.check_frame_size` against
      ``self.max_frame`` before reading them);
    * ``pack(frame)``: the bytes that carry one frame (views of the tensors are fine:
      what is not written at once is copied).

    The kit does the rest: links, receive loops on lanes, goodbyes, lost peers, sends
    that never wait past ``frame.deadline``, corked replies, and ``close``.
    """

    capabilities: ClassVar[Capabilities]
    label: ClassVar[str]
    bye: ClassVar[bytes]
    cork_bytes: ClassVar[int] = 64 << 10  # replies corked at most (0: never cork)

    def __init__(self) -> None:
        self._ctx: TransportContext | None = None
        self.peers: Peers[SocketLink] | None = None
        self.max_frame = DEFAULT_MAX_FRAME_BYTES
        # In a dynamic world, what admits later workers (``connect`` sets it), and the
        # ranks being admitted now (set once their link is in ``peers``).
        self.doorway: Doorway | None = None
        self.arrivals: Arrivals[SocketLink] = Arrivals()
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
        raise NotImplementedError

    def read_one(self, link: SocketLink) -> Frame | None:
        raise NotImplementedError

    def pack(self, frame: Frame) -> list[Buffer]:
        raise NotImplementedError

    # ----------------------------------------------------------- hooks, if it needs

    def make_link(self, rank: int, sock: socket.socket | None) -> SocketLink:
        """The link for ``rank`` over ``sock`` (``None``: a link of an on-demand mesh, to be
        connected; override to add state of its own)."""
        ctx = self._ctx
        assert ctx is not None
        me = ctx.names[ctx.rank]
        return SocketLink(rank, ctx.names[rank], sock, f"rpcx-{me}-send-{ctx.names[rank]}",
                          ctx.progress)

    def loop_ended(self, link: SocketLink) -> None:
        """A receive loop is over, on its thread: release what only it used."""
        link.reader.close()

    def released(self, timeout: float) -> None:
        """After ``close`` closed the sockets: release anything else (bounded)."""

    def tune_socket(self, rank: int, sock: socket.socket) -> socket.socket:
        """Socket options for a connection to ``rank`` made on demand (see :meth:`pair`)."""
        return sock

    def retire(self, link: SocketLink) -> None:
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
        self.max_frame = int(getattr(ctx.options, "max_frame_bytes", self.max_frame))
        try:
            links = {rank: self.make_link(rank, sock)
                     for rank, sock in self.connect(ctx).items()}
        except BaseException:
            if self.doorway is not None:
                self.doorway.close()
            raise
        self.peers = Peers(ctx, links, self.read_one, self.write_bye,
                           end=SocketLink.shutdown, ended=self.loop_ended)
        self.peers.start_receiving()
        if self.doorway is not None:
            self.doorway.start()

    def newcomer(self, rank: int) -> bool:
        """Whether a connection from ``rank`` may be a worker joining (a dynamic world):
        not this worker, and no live link to it (a worker that left the rank may still
        be ending its goodbye: waited for, bounded)."""
        assert self.peers is not None
        return self.arrivals.make_room(self.peers, rank, HANDSHAKE_TIMEOUT, self.retire)

    def welcome(self, rank: int, sock: socket.socket) -> None:
        """A worker joined at ``rank`` over ``sock``: enter it (``TransportContext.admit``),
        tell it it is in, start receiving from it (the :class:`Doorway` calls this).

        Between the agent's admission and the link, a sender that found the newcomer
        waits for the link (:meth:`link`); the answer is written under the link's send
        lock before anyone can send on it, so it is the first byte the newcomer reads.
        """
        ctx, peers = self._ctx, self.peers
        assert ctx is not None and ctx.admit is not None and peers is not None
        with self.arrivals.linking(rank):
            ctx.admit(rank)
            sock.settimeout(None)
            link = self.make_link(rank, sock)
            with link.lock:
                send_all(sock, [memoryview(ADMITTED)], ())
                peers.add(link)

    def link(self, dst: int) -> SocketLink:
        """The link to ``dst``. In an on-demand mesh, one not made yet is made now (it
        connects in the background; what is sent meanwhile queues). One for a worker
        being admitted right now (a dynamic world) is waited for, at most
        ``HANDSHAKE_TIMEOUT``. ``PeerLostError`` for a rank with none."""
        peers = self.peers
        assert peers is not None
        try:
            return peers.links[dst]  # (the hot path: one dict look-up)
        except KeyError:
            if self.dial_peer is not None:
                return self._link_on_demand(dst)
            return self.arrivals.link(peers, dst, HANDSHAKE_TIMEOUT)

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

    def _link_on_demand(self, dst: int) -> SocketLink:
        ctx, peers = self._ctx, self.peers
        assert ctx is not None and peers is not None
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
            self._lose(link, failure)
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
        ctx = self._ctx
        assert ctx is not None
        return Connector(f"rpcx-{ctx.names[ctx.rank]}-{self.label}-{role}", limit)

    def _connect(self, link: SocketLink, bound: float, deadline: float) -> None:
        """Connect ``link`` (a connector job): dial the peer. When the peer's own
        connection wins (it comes through the doorway: :meth:`pair`), look again in a
        while, dialing again if it has not come (a peer that died meanwhile then fails
        the dial). The peer is reported lost, and what was queued fails, if no
        connection comes by ``deadline`` (``bound`` seconds after the first send)."""
        ctx, peers, dial = self._ctx, self.peers, self.dial_peer
        assert ctx is not None and peers is not None and dial is not None
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
            self._report_lost(link, failure)

    def _attach(self, link: SocketLink, sock: socket.socket, how: str) -> str | None:
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

    def _give_up(self, link: SocketLink, failure: str) -> None:
        """(Under ``_pairing``.) ``link``'s peer cannot be reached, for good."""
        self._unreachable[link.rank] = failure
        link.ended.set()
        self._pairing.notify_all()

    def _fail_queued(self, link: SocketLink, failure: str) -> None:
        """What was sent to a link that will never connect fails (and so does what is
        sent to it later)."""
        assert link.backlog is not None
        with link.lock:
            link.backlog.fail(ConnectionError(failure))

    def _report_lost(self, link: SocketLink, failure: str) -> None:
        """(After :meth:`_give_up`.) What queued for ``link`` fails, and its peer is
        reported lost."""
        assert self.peers is not None
        self._fail_queued(link, failure)
        self.peers.lost(link, LostCause.CONNECTION_LOST, failure)

    def _lose(self, link: SocketLink, failure: str) -> None:
        """``link`` will never connect: give its peer up and report it lost."""
        with self._pairing:
            self._give_up(link, failure)
        self._report_lost(link, failure)

    def _receive_attached(self, link: SocketLink) -> None:
        """Write what queued for a link just attached and start receiving on it (not
        under ``_pairing``: a thread start waits for the new thread). A thread that
        cannot start (a crowded host) ends the connection and reports the peer lost."""
        peers = self.peers
        assert peers is not None
        try:
            with link.lock:
                link.release_queued()  # (done already for one the doorway admitted)
            peers.receive(link)
        except Exception as exc:
            self._abandon(link, exc)

    def _abandon(self, link: SocketLink, exc: BaseException) -> None:
        """An attached link whose threads could not start: end the connection, give
        the peer up and report it lost."""
        assert self.peers is not None and link.backlog is not None
        failure = f"could not start its threads: {describe(exc)}"
        with link.lock:
            link.gone = True
            link.why_gone, link.cause_gone = unreachable(failure), LostCause.CONNECTION_LOST
            link.shutdown()  # (the peer sees the connection end; a writer's write fails)
            if not link.backlog.running:
                link.backlog.fail(ConnectionError(failure))
        with self._pairing:
            self._give_up(link, failure)
        self.peers.lost(link, LostCause.CONNECTION_LOST, failure)

    def may_pair(self, rank: int) -> bool:
        """Whether a connection from ``rank`` may be an on-demand mesh's peer (its
        doorway asks before the handshake's proof)."""
        ctx = self._ctx
        assert ctx is not None
        return 0 <= rank < ctx.world_size and rank != ctx.rank

    def pair(self, rank: int, sock: socket.socket) -> None:
        """A peer of an on-demand mesh connected (the doorway calls this, once the
        handshake passed): admit the connection as the pair's, unless this worker dials
        ``rank`` itself and is the lower rank (its own connection wins: the dialer is
        told to wait for it), or the pair has a connection already, or this worker is
        closing or gave ``rank`` up (the dialer is told not to wait)."""
        ctx, peers = self._ctx, self.peers
        assert ctx is not None and peers is not None
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
            self._report_lost(link, failure)
            return
        # What queued for the peer (its requests, when both dialed) goes now, on this
        # thread; the link's threads are started on a starter thread (never behind a
        # dial): the doorway answers the next worker meanwhile.
        try:
            with link.lock:
                link.release_queued()
        except Exception as exc:  # (a writer thread for a rest that cannot start)
            self._abandon(link, exc)
            return
        try:
            handed = starter.submit(functools.partial(self._receive_attached, link))
        except RuntimeError:
            handed = False
        if not handed:  # (no thread to hand it to, or this worker began closing)
            self._receive_attached(link)

    def close_pairs(self) -> None:
        """An on-demand mesh's part of :meth:`close`: connect no pair any more, and let
        go of the links still connecting (they have no goodbye to wait for)."""
        peers = self.peers
        if self.dial_peer is None or peers is None:
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
            self._fail_queued(link, "this worker is shutting down")
            link.ended.set()

    def connects_on_demand(self) -> bool:
        """Whether this is an on-demand mesh (pairs connect when they first talk)."""
        return self.dial_peer is not None

    def connected(self, rank: int) -> bool:
        """Whether this worker has a connection to ``rank`` now: in an on-demand mesh,
        once the pair first talked; otherwise always."""
        if self.dial_peer is None:
            return True
        peers = self.peers
        link = peers.links.get(rank) if peers is not None else None
        return link is not None and link.attached.is_set()

    def send(self, dst: int, frame: Frame) -> None:
        """Write ``frame`` to ``dst``; returns once written, or at ``frame.deadline``
        with the rest queued for the peer's writer."""
        self.link(dst).send(self.pack(frame), deadline=frame.deadline,
                            cork=0 if frame.buffers else self.cork_bytes,
                            settled=frame.settled)

    def write_bye(self, link: SocketLink) -> None:
        """Write the goodbye (under ``link.lock``; queued behind a peer that reads
        nothing: ``close`` shuts the socket down after waiting, which ends the writer)."""
        link.write_locked([self.bye])

    def close(self, timeout: float) -> None:
        """Goodbye to every peer, a bounded wait for theirs, then close the sockets (in a
        dynamic world the doorway closes first: nobody is admitted any more)."""
        if self.doorway is not None:
            self.doorway.close(min(timeout, HANDSHAKE_TIMEOUT))
        self.close_pairs()
        peers = self.peers
        if peers is None:
            return
        deadline = time.monotonic() + timeout
        peers.close(timeout)
        for link in peers:
            link.shutdown()
            assert link.backlog is not None
            link.backlog.stop()
        for link in peers:
            assert link.backlog is not None
            link.backlog.join(deadline - time.monotonic())
            link.sock.close()
        self.released(max(0.0, deadline - time.monotonic()))
