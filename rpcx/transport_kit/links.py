"""Per-peer links and what happens to them: the receive loop, goodbyes, loss, close.

A :class:`Link` is one peer's state every transport keeps; :class:`Peers` holds the
links to every peer and runs, for the transport, the parts every transport shares:

* the **receive loop** that honours the lane protocol (:class:`rpcx.transport.ReceiveLane`):
  enter, read one frame (the transport's ``read_one``), deliver it, ask ``still_held``,
  leave. Reading is under ``link.reading``; a thread that read a frame after its role
  moved on leaves it in ``link.stash`` for the new holder, so nothing is read twice,
  lost, or delivered out of order.
* **goodbyes**: a worker that leaves sends ``BYE`` (the transport's ``write_bye``) as its
  last frame to each peer; one that receives a goodbye it did not expect answers with
  its own, so the peer's receive loop ends too, and reports the peer ``DEPARTED``.
* **loss**: a receive loop that ends on an error reports the peer once, with the cause
  and detail :func:`~rpcx.transport_kit.sentences.classify` reads from the error, and ends
  the connection on a protocol error (the transport's ``end``) so the peer sees it.
* **close**: goodbye to every peer, a bounded wait for theirs, and the warning
  ``"<me>: no goodbye from <peers> within <t> s; closing anyway"``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from rpcx.errors import LostCause, PeerLostError, ProtocolError, lost_reason
from rpcx.transport import Frame, ReceiveLane, TransportContext
from rpcx.transport_kit.sentences import SHUT_DOWN, classify, unreachable
from rpcx.transport_kit.writer import Backlog

__all__ = ["BYE_TIMEOUT", "Arrivals", "Link", "LinkEnded", "Peers", "StopReceiving",
           "thread_name"]

log = logging.getLogger("rpcx.transport_kit")

BYE_TIMEOUT = 10.0  # seconds answering a peer's goodbye may wait for the send lock


def thread_name(ctx: TransportContext, role: str, peer: str | None = None) -> str:
    """``"rpcx-<me>-<role>"``, or ``"rpcx-<me>-<role>-<peer>"``: how rpcx names a
    transport's threads."""
    name = f"rpcx-{ctx.names[ctx.rank]}-{role}"
    return name if peer is None else f"{name}-{peer}"


class StopReceiving(Exception):
    """Raised by a transport's ``read_one`` to end the receive loop quietly: this worker
    ended it (``close``, for a peer that sent no goodbye); nothing is reported."""


class LinkEnded(Exception):
    """Raised by ``read_one`` once the link was ended from another thread
    (:meth:`Link.end`: a monitor saw the connection drop) and what had arrived before is
    delivered: the loop ends, and the peer is reported with the cause the link recorded."""


class Link:
    """One peer, as every transport keeps it.

    Attributes:
        rank, name: the peer's.
        lock: the send lock: frames to the peer are written under it, one at a time, so
            they leave in order. The goodbye flags below are read and set under it.
        bye_sent: this worker's goodbye went (or is queued): nothing more may follow.
        gone: the peer said goodbye or its connection broke: sends fail.
        bye_received: the peer said goodbye (its connection may now close).
        why_gone, cause_gone, detail_gone: once the link ended (:meth:`end`), the
            sentence sends fail with (e.g. "is unreachable: could not connect: ..."),
            its cause and detail; until then "has shut down", ``None`` and ``""``.
        lane: the receive loop's role, when the agent offers lanes (else ``None``).
        reading: held by the thread reading the peer's frames.
        stash: a frame read by a thread whose role moved on, for the next holder.
        ended: set when the receive loop is over: nothing more arrives.
        reported: ``peer_lost`` was called for the peer (or is not to be).
        backlog: the peer's writer (:class:`~rpcx.transport_kit.writer.Backlog`), for
            transports whose writes can wait on the peer; set by the transport.

    Subclass it for the transport's own per-peer state (a socket, a ring of receives);
    give the subclass ``__slots__`` too.
    """

    __slots__ = ("backlog", "bye_received", "bye_sent", "cause_gone", "detail_gone", "ended",
                 "gone", "lane", "lock", "name", "rank", "reading", "reported", "stash",
                 "why_gone")

    def __init__(self, rank: int, name: str) -> None:
        self.rank = rank
        self.name = name
        self.lock = threading.Lock()
        self.bye_sent = False
        self.bye_received = False
        self.gone = False
        self.lane: ReceiveLane | None = None
        self.reading = threading.Lock()
        self.stash: Frame | None = None
        self.ended = threading.Event()
        self.reported = False
        self.why_gone = SHUT_DOWN
        self.cause_gone: LostCause | None = None
        self.detail_gone = ""
        self.backlog: Backlog | None = None

    def end(self, cause: LostCause, detail: str = "") -> bool:
        """The one way a link ends: sends fail from now on, with why (call under
        ``lock``). The first cause recorded stays (a monitor that saw the connection
        drop knows more than the receive loop that ends on it next); ``False`` if one
        was recorded already. Reporting the peer is :meth:`Peers.lost`'s."""
        self.gone = True
        if self.cause_gone is not None:
            return False
        self.cause_gone, self.detail_gone = cause, detail
        self.why_gone = lost_reason(cause, detail)
        return True

    def check_open(self) -> None:
        """Raise ``PeerLostError`` if nothing may be sent to the peer (call under
        ``lock``): with why it was reported lost, or ``"has shut down"``."""
        if self.gone:
            raise PeerLostError(self.why_gone, cause=self.cause_gone)
        if self.bye_sent:
            raise PeerLostError(SHUT_DOWN)


L = TypeVar("L", bound=Link)


class Arrivals(Generic[L]):
    """Workers joining a dynamic world whose link is being made right now.

    Between the agent's admission of a newcomer (``TransportContext.admit``) and its
    link, a sender may already have found it; :meth:`link` makes that sender wait for the
    link instead of failing. Hold :meth:`linking` around admitting and linking.
    """

    def __init__(self) -> None:
        self._linking: dict[int, threading.Event] = {}

    @contextlib.contextmanager
    def linking(self, rank: int) -> Iterator[None]:
        """The block admits ``rank`` and makes its link; senders to it wait until it ends."""
        linked = self._linking[rank] = threading.Event()
        try:
            yield
        finally:
            linked.set()
            self._linking.pop(rank, None)

    def link(self, peers: Peers[L], rank: int, timeout: float) -> L:
        """``peers[rank]``, waiting at most ``timeout`` for one being made;
        ``PeerLostError`` for a rank with none (no worker holds it, or its admission
        failed)."""
        try:
            return peers[rank]
        except KeyError:
            linked = self._linking.get(rank)
            if linked is not None:
                linked.wait(timeout)
        try:  # (again: the link may have come between the two looks)
            return peers[rank]
        except KeyError:
            raise PeerLostError(unreachable(f"no connection to rank {rank}")) from None

    def make_room(self, peers: Peers[L], rank: int, timeout: float,
                  retire: Callable[[L], None] = lambda link: None) -> bool:
        """Whether a connection from ``rank`` may be a worker joining a dynamic world;
        a transport's doorway asks before admitting it. Not this worker's rank; and if
        a worker that left the rank still has a link, its receive loop must end within
        ``timeout`` (its departure is then reported): the link leaves ``peers`` (a
        sender waits for the new one) and ``retire(link)`` releases it."""
        if rank < 0 or rank == peers.ctx.rank:
            return False
        old = peers.links.get(rank)
        if old is None:
            return True
        if not old.ended.wait(timeout):
            return False
        peers.links = {r: link for r, link in peers.links.items() if r != rank}
        retire(old)
        return True


class Peers(Generic[L]):
    """The links to every peer, and the receive loops, goodbyes and close they share.

    Args:
        ctx: the transport's context.
        links: a started link per peer rank (every rank but this worker's).
        read_one: ``read_one(link)`` reads the peer's next frame, blocking: the frame,
            or ``None`` for the peer's goodbye. It raises when the connection ends
            (``EOFError``, ``OSError``) or the peer sent what is no frame
            (``ProtocolError``). It may handle messages of the transport's own (and
            read on) before returning a frame.
        write_bye: ``write_bye(link)`` writes the goodbye, called under ``link.lock``;
            it must not wait for the peer (queue it on the backlog instead).
        end: ``end(link)``: end the connection at once, so the peer's receive loop sees
            it end (after a protocol error; e.g. ``socket.shutdown``). Optional.
        ended: ``ended(link)``: the receive loop is over, on its thread (release what
            only it used). Optional.
        connection_errors: exceptions of the library a transport reads through that
            mean its connection is gone (``zmq.ZMQError``): the peer is reported lost
            with the exception's message, not as a protocol error.
    """

    def __init__(
        self,
        ctx: TransportContext,
        links: Mapping[int, L],
        read_one: Callable[[L], Frame | None],
        write_bye: Callable[[L], None],
        end: Callable[[L], None] | None = None,
        ended: Callable[[L], None] | None = None,
        connection_errors: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.ctx = ctx
        self.links: dict[int, L] = dict(links)
        self.closing = False  # close() began: losses are expected, not reported
        self._read_one = read_one
        self._write_bye = write_bye
        self._end = end
        self._ended = ended
        self._connection_errors = connection_errors

    # --------------------------------------------------------------------- access

    def __getitem__(self, rank: int) -> L:
        return self.links[rank]

    def __iter__(self) -> Iterator[L]:
        return iter(self.links.values())

    def __len__(self) -> int:
        return len(self.links)

    # -------------------------------------------------------------------- receive

    def start_receiving(self) -> None:
        """Give every link its lane (when the agent offers lanes) and start its receive
        loop on a thread of its own."""
        for link in list(self.links.values()):
            self._receive_from(link)

    def add(self, link: L, receive: bool = True) -> None:
        """A peer that joined a dynamic world (or took a rank again, or that this worker
        connects to on demand): from now on it is one of the links, and its receive
        loop runs (``receive`` False: once :meth:`receive` is called, when the link is
        connected). It replaces an ended link."""
        old = self.links.get(link.rank)
        if old is not None and not old.ended.is_set():
            raise ValueError(f"rank {link.rank} ({old.name}) is connected already")
        self.links = {**self.links, link.rank: link}  # (readers iterate a stable dict)
        if receive:
            self._receive_from(link)

    def receive(self, link: L) -> None:
        """Start the receive loop of a link added with ``receive=False``."""
        self._receive_from(link)

    def _receive_from(self, link: L) -> None:
        ctx = self.ctx
        name = thread_name(ctx, "recv", link.name)
        if ctx.receive_lane is not None:
            link.lane = ctx.receive_lane(name, functools.partial(self.receive_loop,
                                                                 link.rank))
        threading.Thread(target=self.receive_loop, args=(link.rank,), name=name,
                         daemon=True).start()

    def receive_loop(self, rank: int) -> None:
        """Receive and deliver the peer's frames, in order, until its goodbye or loss.

        Runs on whichever thread holds the peer's lane: it returns early, leaving the
        loop to that thread (``resume``), when a request it served moved the role.
        """
        link = self.links[rank]
        lane = link.lane
        deliver = self.ctx.deliver
        if lane is not None:
            lane.enter()
        while True:
            with link.reading:
                if link.ended.is_set():  # the loop ended while this thread waited
                    if lane is not None:
                        lane.leave()
                    return
                frame, link.stash = link.stash, None
                if frame is None:
                    try:
                        frame = self._read_one(link)
                    except BaseException as exc:  # the connection ended, or is no use
                        self._finish(link, exc)
                        return
                    if frame is None:  # the peer's goodbye
                        self._finish(link, None)
                        return
                if lane is not None and not lane.held_here() and not lane.still_held():
                    link.stash = frame  # the new holder delivers it, first thing
                    return
            try:
                deliver(rank, frame)
            except ProtocolError as exc:  # refused above the transport (authentication)
                with link.reading:
                    self._finish(link, exc)
                return
            except Exception:
                log.exception("%s: delivering a frame from %s failed",
                              self.ctx.names[self.ctx.rank], link.name)
            del frame
            if lane is not None and not lane.still_held():
                return  # a follower receives from here on

    def _finish(self, link: L, exc: BaseException | None) -> None:
        """The receive loop is over (under ``link.reading``): a goodbye (``exc`` None)
        or an error; report the peer, release, mark ended."""
        try:
            if exc is None:
                self.goodbye_received(link)
            else:
                self.broken(link, exc)
        finally:
            if self._ended is not None:
                try:
                    self._ended(link)
                except Exception:
                    log.exception("ending the receive loop for %s", link.name)
            if link.lane is not None:
                link.lane.leave()
            link.ended.set()

    # ------------------------------------------------------------------ goodbyes

    def goodbye_received(self, link: L) -> None:
        """The peer said goodbye: answer with ours if we had not said it (so its
        receive loop for us ends too) and report it ``DEPARTED`` (not while closing)."""
        link.bye_received = True
        with link.lock:
            link.gone = True
            answer = not link.bye_sent
        if answer:
            self.send_bye(link, BYE_TIMEOUT)
        self.lost(link, LostCause.DEPARTED)

    def send_bye(self, link: L, timeout: float) -> None:
        """Send our goodbye after every frame sent or queued before it, once; waits for
        the send lock (held only briefly) at most ``timeout`` seconds."""
        if not link.lock.acquire(timeout=max(0.0, timeout)):
            log.debug("goodbye to %s not sent: the send lock stayed taken", link.name)
            return
        try:
            if link.bye_sent:
                return
            link.bye_sent = True
            try:
                self._write_bye(link)
            except (OSError, PeerLostError) as exc:
                log.debug("goodbye to %s not delivered: %s", link.name, exc)
        finally:
            link.lock.release()

    # ---------------------------------------------------------------------- loss

    def broken(self, link: L, exc: BaseException) -> None:
        """The receive loop ended with ``exc``: :class:`StopReceiving` reports nothing,
        :class:`LinkEnded` the loss the link recorded, one of ``connection_errors`` (the
        library's own) a lost connection; otherwise the peer is reported with the cause
        and detail :func:`~rpcx.transport_kit.sentences.classify` reads. A protocol error
        also ends the connection, so the peer sees it end."""
        if isinstance(exc, StopReceiving):
            return
        if isinstance(exc, LinkEnded):
            self.lost(link, link.cause_gone or LostCause.CONNECTION_LOST, link.detail_gone)
            return
        if isinstance(exc, self._connection_errors):
            self.lost(link, LostCause.CONNECTION_LOST, str(exc))
            return
        cause, detail = classify(exc)
        if cause is LostCause.PROTOCOL_ERROR and not self.closing:
            log.warning("%s: protocol error from %s: %s", self.ctx.names[self.ctx.rank],
                        link.name, detail)
            if self._end is not None:
                with contextlib.suppress(OSError):
                    self._end(link)
        self.lost(link, cause, detail)

    def lost(self, link: L, cause: LostCause, detail: str = "") -> None:
        """End the link (:meth:`Link.end`) and call ``peer_lost`` once, unless this
        worker is closing (its peers' goodbyes and losses are expected). A loss is
        reported with the first cause the link recorded; a goodbye as a departure."""
        with link.lock:
            link.end(cause, detail)
            report = not link.reported
            link.reported = True
            if cause is not LostCause.DEPARTED and link.cause_gone is not None:
                cause, detail = link.cause_gone, link.detail_gone
        if report and not self.closing:
            self.ctx.peer_lost(link.rank, cause, detail)

    # --------------------------------------------------------------------- close

    def close(self, timeout: float, then: str = "closing anyway") -> list[L]:
        """Say goodbye to every peer and wait, until ``timeout`` at most, for every
        receive loop to end (on the peers' goodbyes). Returns the links whose loops did
        not end, after the warning ``"<me>: no goodbye from <names> within <t> s;
        <then>"``. The transport then releases its connections."""
        self.closing = True
        deadline = time.monotonic() + timeout
        links = list(self.links.values())
        for link in links:
            self.send_bye(link, deadline - time.monotonic())
        for link in links:
            link.ended.wait(max(0.0, deadline - time.monotonic()))
        stuck = [link for link in links if not link.ended.is_set()]
        if stuck:
            log.warning("%s: no goodbye from %s within %.1f s; %s",
                        self.ctx.names[self.ctx.rank], ", ".join(each.name for each in stuck),
                        timeout, then)
        return stuck
