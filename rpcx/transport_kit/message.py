""":class:`MessageTransport`: the skeleton every kit transport fills in.

A transport of the kit keeps one :class:`~rpcx.transport_kit.links.Link` per peer and
lets :class:`~rpcx.transport_kit.links.Peers` run the receive loops, goodbyes and loss
reports. What is left around them is the same in every such transport, whatever carries
its bytes (a socket, a gloo pair, ZeroMQ), and is written here once:

* **start**: the context and the peers, never ``None`` once started (:meth:`begin`);
* **a dynamic world**: joining through every member's doorway
  (:meth:`join_through_doorways`), admitting later workers (:meth:`newcomer`,
  :meth:`welcome`), and senders that wait for a link being made (:meth:`link`);
* **post now or queue**: a frame the connection takes at once goes on the sending thread,
  the rest on the peer's writer, waited for until the frame's deadline (:meth:`post`);
* **close**: the doorway, goodbyes with a bounded wait, the receive loops of peers that
  sent none stopped where the transport can (:meth:`stop_receiving`), then each link
  released (:meth:`release_link`) and whatever the transport holds besides
  (:meth:`released`).

A backend writes its wire format (``send``, ``read_one``, ``write_bye``), how it
connects, and the hooks it needs; :class:`~rpcx.transport_kit.sockets.StreamTransport`
is this skeleton for stream sockets.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

from rpcx.options import DEFAULT_MAX_FRAME_BYTES
from rpcx.transport import Capabilities, Frame, TransportContext
from rpcx.transport_kit.links import Arrivals, Link, Peers, thread_name
from rpcx.transport_kit.mesh import HANDSHAKE_TIMEOUT, Doorway, dial_tcp, join_stream_mesh

__all__ = ["MessageTransport"]

L = TypeVar("L", bound=Link)

STOP_GRACE_S = 0.5  # how long past close's deadline a stopped receive loop may take to end


class MessageTransport(Generic[L]):
    """The parts of a transport that do not depend on how its bytes travel.

    A subclass sets ``capabilities``, ``label`` (names threads, store keys and the
    doorway's handshake) and, if its library raises its own, ``connection_errors``;
    it writes:

    * ``start(ctx)``: connect, make a link per peer, then :meth:`begin` with them;
    * ``send(dst, frame)``: pack the frame and write it, usually through :meth:`post`;
    * ``read_one(link)``: the peer's next frame, ``None`` for its goodbye (see
      :class:`~rpcx.transport_kit.links.Peers`);
    * ``write_bye(link)``: write the goodbye (under ``link.lock``; never waits);

    and overrides the hooks it needs (each documented below): :meth:`make_peers`,
    :meth:`end_connection`, :meth:`loop_ended`, :meth:`link_newcomer`, :meth:`retire`,
    :meth:`stop_connecting`, :meth:`stop_receiving`, :meth:`release`,
    :meth:`release_link`, :meth:`released`.
    """

    capabilities: ClassVar[Capabilities]
    label: ClassVar[str]
    when_stuck: ClassVar[str] = "closing anyway"  # the end of close's "no goodbye" warning
    # The library's exceptions that mean a connection is gone (Peers' connection_errors).
    connection_errors: ClassVar[tuple[type[BaseException], ...]] = ()

    def __init__(self) -> None:
        self._ctx: TransportContext | None = None
        self._started: Peers[L] | None = None
        self.max_frame = DEFAULT_MAX_FRAME_BYTES
        # In a dynamic world, what admits later workers, and the ranks being admitted now
        # (a sender to one waits for its link).
        self.doorway: Doorway | None = None
        self.arrivals: Arrivals[L] = Arrivals()
        self.admission_bound = HANDSHAKE_TIMEOUT  # how long a sender waits for such a link

    # --------------------------------------------------------------------- state

    @property
    def ctx(self) -> TransportContext:
        """The context ``start`` was given."""
        if self._ctx is None:
            raise RuntimeError(f"the {self.label} transport is not started")
        return self._ctx

    @property
    def peers(self) -> Peers[L]:
        """The links to every peer, with their receive loops (once :meth:`begin` ran)."""
        if self._started is None:
            raise RuntimeError(f"the {self.label} transport has no peers yet")
        return self._started

    @property
    def links(self) -> dict[int, L]:
        """Every peer's link, by rank (none before :meth:`begin`)."""
        return self._started.links if self._started is not None else {}

    @property
    def closing(self) -> bool:
        """Whether ``close`` began."""
        return self._started is not None and self._started.closing

    def thread_name(self, role: str, peer: str | None = None) -> str:
        """How rpcx names this worker's threads (:func:`~rpcx.transport_kit.links.thread_name`)."""
        return thread_name(self.ctx, role, peer)

    # ------------------------------------------------------- what a backend writes

    def start(self, ctx: TransportContext) -> None:
        """Connect to every peer, make their links, then :meth:`begin` with them."""
        raise NotImplementedError

    def send(self, dst: int, frame: Frame) -> None:
        """Write ``frame`` to ``dst`` (the contract: :class:`rpcx.transport.Transport`)."""
        raise NotImplementedError

    def read_one(self, link: L) -> Frame | None:
        """The peer's next frame, blocking; ``None`` for its goodbye."""
        raise NotImplementedError

    def write_bye(self, link: L) -> None:
        """Write the goodbye to the peer (under ``link.lock``; never waits)."""
        raise NotImplementedError

    # ---------------------------------------------------------------------- hooks

    def make_peers(self, links: dict[int, L]) -> Peers[L]:
        """The :class:`~rpcx.transport_kit.links.Peers` over ``links``. Its library's
        errors that mean a lost connection: set ``connection_errors``. Override this
        only to read errors another way (gloo's ``_GlooPeers``), passing them on."""
        return Peers(self.ctx, links, self.read_one, self.write_bye,
                     end=self.end_connection, ended=self.loop_ended,
                     connection_errors=self.connection_errors)

    def end_connection(self, link: L) -> None:
        """End ``link``'s connection at once, so that the peer sees it end (after a
        protocol error)."""

    def loop_ended(self, link: L) -> None:
        """``link``'s receive loop is over, on its thread: release what only it used."""

    def link_newcomer(self, rank: int, sock: socket.socket) -> L:
        """A worker joins a dynamic world at ``rank`` (``sock``: its doorway connection,
        handshake done): make its link and tell it it is in (``ADMITTED`` on ``sock``,
        before it may read anything else). Its receive loop starts once this returns."""
        raise NotImplementedError

    def retire(self, link: L) -> None:
        """A new worker takes the rank of ``link``'s peer, which left (its receive loop
        is over): release the old link (``close`` only sees the links of now)."""

    def stop_connecting(self) -> None:
        """``close`` began (goodbyes follow): connect nothing more."""

    def stop_receiving(self, link: L) -> bool:
        """End ``link``'s receive loop now, wherever it waits (its ``read_one`` raises
        :class:`~rpcx.transport_kit.links.StopReceiving`); ``False`` if the transport
        cannot (the default). ``close`` asks it for the peers that sent no goodbye."""
        return False

    def release(self, stuck: list[L], deadline: float) -> None:
        """The last step of ``close``: every link released (:meth:`release_link`), then
        the rest (:meth:`released`). ``stuck``: links whose receive loops still run."""
        for link in self.links.values():
            self.release_link(link, deadline)
        self.released(max(0.0, deadline - time.monotonic()))

    def release_link(self, link: L, deadline: float) -> None:
        """Release ``link`` at ``close`` (its writer was told to stop): by ``deadline``."""
        if link.backlog is not None:
            link.backlog.join(deadline - time.monotonic())

    def released(self, timeout: float) -> None:
        """After the links: release anything else the transport holds (bounded)."""

    # ---------------------------------------------------------------------- start

    def begin(self, ctx: TransportContext, links: dict[int, L]) -> None:
        """Hold ``links`` (connected, one per peer) and start receiving from each. (In a
        dynamic world, :meth:`open_doorway` follows, once the transport is ready.)"""
        self._ctx = ctx
        self.max_frame = int(getattr(ctx.options, "max_frame_bytes", self.max_frame))
        self._started = self.make_peers(links)
        self._started.start_receiving()

    def open_doorway(self) -> None:
        """Start admitting the workers that join later (a dynamic world)."""
        if self.doorway is not None:
            self.doorway.start()

    # -------------------------------------------------------------- dynamic world

    def join_through_doorways(self, ctx: TransportContext, host: str,
                              label: str | None = None) -> dict[int, socket.socket]:
        """A newcomer to a dynamic world: tell every member, through its doorway, that
        this worker joins, and make a doorway (on ``host``; opened by
        :meth:`open_doorway`) for those that join later. The doorway connections, one
        per member, each admitted (a transport that needs no more of them closes them).
        """
        label = label or self.label
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                 socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(16)
            sockets = join_stream_mesh(ctx, {"tcp": [host, listener.getsockname()[1]]},
                                       dial_tcp, label)
        except BaseException:
            listener.close()
            raise
        self.doorway = Doorway(ctx, [listener], label, self.newcomer, self.welcome,
                               listener.close)
        return sockets

    def newcomer(self, rank: int) -> bool:
        """Whether a doorway connection from ``rank`` may be a worker joining: not this
        worker, and no live link to the rank (a worker that left it may still be ending
        its goodbye: waited for, bounded, then retired)."""
        return self.arrivals.make_room(self.peers, rank, HANDSHAKE_TIMEOUT, self.retire)

    def welcome(self, rank: int, sock: socket.socket) -> None:
        """A worker joins at ``rank`` (the doorway calls this): the agent admits it
        (``TransportContext.admit``), the backend makes its link (:meth:`link_newcomer`)
        and the link's receive loop starts. Senders that find the newcomer meanwhile
        wait for the link (:meth:`link`)."""
        ctx = self.ctx
        assert ctx.admit is not None, "a doorway opens only in a dynamic world"
        with self.arrivals.linking(rank):
            ctx.admit(rank)
            self.peers.add(self.link_newcomer(rank, sock))

    def link(self, dst: int) -> L:
        """The link to ``dst``; one being made right now (a worker joining) is waited
        for, at most ``admission_bound``. ``PeerLostError`` for a rank with none."""
        try:
            return self.peers.links[dst]  # (the hot path: one dict look-up)
        except KeyError:
            return self.link_missing(dst)

    def link_missing(self, dst: int) -> L:
        """:meth:`link` for a rank with no link now: wait (``admission_bound``) for one
        being made for a worker joining; ``PeerLostError`` if none is."""
        return self.arrivals.link(self.peers, dst, self.admission_bound)

    # ----------------------------------------------------------------------- send

    @staticmethod
    def post(link: L, job: Any, write_now: Callable[[Any], bool], deadline: float = 0.0,
             settled: Callable[[], bool] | None = None) -> bool:
        """Write ``job`` to ``link``'s peer now, or queue it for the peer's writer.

        Under the send lock: ``PeerLostError`` if nothing may be sent; then
        ``write_now(job)`` unless frames are queued before it (per-peer order), which
        never waits and says whether it wrote all of ``job``. What it did not goes to
        the peer's :class:`~rpcx.transport_kit.writer.Backlog`, and the sender waits for
        it, without the lock, until ``deadline`` (a call's; 0: none) or ``settled()``:
        ``False`` then (the writer still writes it; the agent fails the call on time).
        """
        with link.lock:
            link.check_open()
            backlog = link.backlog
            assert backlog is not None, "a link that may queue has a backlog"
            if not backlog and write_now(job):
                return True
            pending = backlog.put(job)
        return pending.wait(deadline, settled)

    # ---------------------------------------------------------------------- close

    def close(self, timeout: float) -> None:
        """Close the doorway (nobody is admitted any more), say goodbye to every peer
        and wait, until ``timeout`` at most, for theirs; then release each link and the
        rest (:meth:`release`). Safe after a ``start`` that failed part way."""
        deadline = time.monotonic() + timeout
        if self.doorway is not None:
            self.doorway.close(min(timeout, HANDSHAKE_TIMEOUT))
        peers = self._started
        if peers is None:
            self.release([], deadline)
            return
        peers.closing = True  # (losses from here on are expected, not reported)
        self.stop_connecting()
        for link in peers:
            if link.backlog is not None:
                link.backlog.stop()  # (it ends once what is queued is written)
        silent = peers.close(timeout, then=self.when_stuck)
        for link in [link for link in silent if self.stop_receiving(link)]:
            link.ended.wait(max(0.0, deadline + STOP_GRACE_S - time.monotonic()))
        self.release([link for link in silent if not link.ended.is_set()], deadline)
