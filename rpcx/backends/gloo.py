"""The gloo backend: frames over torch.distributed ``ProcessGroupGloo`` send/recv.

The process group is private to rpcx, built on rpcx's own rendezvous store, never the
default group, so a program can run ``dist.init_process_group`` for DDP beside it.

Wire format, per frame, on one ordered gloo pair per peer:

* a fixed-size *slot* (tag 0): ``mode, buffer count, body length``, then the body. Small
  frames (most calls) fit entirely in the slot: one gloo message per frame.
* a *split* frame's slot holds the body without the tensor data (buffer sizes, then the
  header); each non-empty tensor follows as its own message (tag 1), sent straight from
  the tensor's memory; one larger than the kit's ``PIECE_BYTES`` as several, so the
  receiver sees a long transfer move (``TransportContext.progress``). The receiver
  posts every tensor's receive as soon as the slot arrives, so large tensors cost one
  notification round, not two.
* an *extended* frame (a header too large for the slot) sends the body as a message of
  its own (tag 1) after the slot, then the tensors.
* ``BYE`` is the last slot a worker sends a peer. A receiving thread ends only on a BYE or
  a broken connection: gloo offers no way to cancel a pending receive, and a process that
  exits with one pending aborts. So a worker that leaves sends BYE, and a worker that gets
  a BYE it did not expect answers with its own.

One receiving thread per peer keeps per-peer order and lets a large frame from one peer
not hold up the others; it keeps a ring of slot receives posted so gloo can land frames
while it is busy (``RECEIVE_DEPTH``; fewer per peer in a static world of more than 9
workers, see :func:`ring_depth`). Sends are posted under a per-peer lock (so the
messages of one frame stay together) and waited for outside it: a gloo send Work only
completes when waited on, and a sender whose peer has no receive posted waits for one
(back-pressure).
A frame the peer may not take now is waited for by the peer's writer thread instead,
the caller waiting only until the frame's deadline: one past what the kernel's socket
buffers and the peer's posted slot receives take at once, a call's frame with messages
after its slot (they go only once the peer has read the slot), and any frame behind
one of those. So a peer that stopped reading cannot hold a call past its timeout (gloo
cannot cancel a send, and a timed-out gloo wait aborts every pair).

The per-peer link, the receive loop on lanes, goodbyes, lost-peer reports, joining a
dynamic world, ``close`` with its "no goodbye from" warning, the writer thread and the
bounded connect are rpcx's transport kit (:class:`rpcx.transport_kit.MessageTransport`);
this module writes the format, the ring of slot receives, and what gloo's errors mean.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import socket
import struct
import threading
import time
import uuid
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore

from rpcx.hookspecs import hookimpl
from rpcx.hosts import default_address
from rpcx.options import TensorPipeRpcBackendOptions
from rpcx.transport import Capabilities, Frame, TransportContext
from rpcx.transport_kit import (
    ADMITTED,
    BYE_TIMEOUT,
    CLOSED_CONNECTION,
    HANDSHAKE_TIMEOUT,
    Backlog,
    Link,
    LostCause,
    MessageTransport,
    PeerLostError,
    Peers,
    ProtocolError,
    address_towards,
    as_bytes,
    check_frame_size,
    connect_limit,
    empty_bytes,
    keep_if_file_store,
    lost_error,
    options_as,
    pieces,
    run_bounded,
    without_cpp_locations,
)

__all__ = ["GlooRpcBackendOptions", "GlooTransport"]

log = logging.getLogger("rpcx.backends.gloo")

SLOT_BYTES = 4096  # small frames (most calls) travel whole in one slot
# A frame is waited for on the sending thread while the bytes sent to its peer since
# the peer last sent anything stay under this: the kernel's socket buffers (at least
# ~144 KiB on Linux) take them whole, and, each slot being SLOT_BYTES on the wire, they
# fill fewer slots than the peer keeps receives posted for (gloo writes a message only
# into a receive the peer posted), so the wait cannot outlast a peer that stopped
# reading. Past it, frames go to the peer's writer thread (a hand-off costs ~30 us).
_WAIT_INLINE_BYTES = 96 << 10
# Slot receives posted per peer (at least half of them at any time). A gloo send
# completes only once the peer has a receive posted, so this is also how far a sender
# may run ahead: 4 gave ~4k small rpc_async/s, 64 gives ~9k (torch: ~9k), for 256 KiB
# of buffers per peer.
RECEIVE_DEPTH = 64
assert _WAIT_INLINE_BYTES // SLOT_BYTES < RECEIVE_DEPTH // 2  # (the ring keeps half posted)
# A static world of more than 9 workers posts fewer per peer, about this many in all:
# 64 workers posting 64 each for 63 peers (4,032 receives, 16 MiB of slots per worker)
# spent 8-17 s of a 2-core host's start-up just posting them.
_RING_BUDGET = 512
_MIN_DEPTH = 8


def ring_depth(world_size: int) -> int:
    """Slot receives posted per peer in a static world of ``world_size`` workers.

    Every worker computes the same depth for every peer, so a sender knows how far it
    may run ahead of its peer's reading (see :func:`inline_limit`).
    """
    return max(_MIN_DEPTH, min(RECEIVE_DEPTH, _RING_BUDGET // max(1, world_size - 1)))


def inline_limit(depth: int) -> int:
    """Bytes a sender may have sent a peer that posts ``depth`` slot receives, since
    that peer last sent anything, and still wait for a send on its own thread: fewer
    slots than the peer keeps posted (half its ring), and what socket buffers take."""
    return min(_WAIT_INLINE_BYTES, (depth // 2 - 1) * SLOT_BYTES)
_HEAD = struct.Struct("<BxxxIQ")  # mode, number of buffers, body length
_INLINE, _EXTENDED, _BYE, _SPLIT = 1, 2, 3, 4
_TAG_SLOT, _TAG_DATA = 0, 1
_MAX_BUFFERS = SLOT_BYTES  # a frame's buffer count: its sizes must fit a body
# gloo fails (and closes the pair) when a receive outlasts this, so make it effectively
# infinite: an idle peer is not a dead peer. Dead peers surface as closed connections.
_PAIR_TIMEOUT = timedelta(days=3650)

_Messages = list[tuple[int, torch.Tensor]]  # (tag, memory) of one frame, in order


class GlooRpcBackendOptions(TensorPipeRpcBackendOptions):
    """Options of the gloo backend: torch's fields plus where to listen.

    Args:
        interface: network interface for gloo to use (like ``GLOO_SOCKET_IFNAME``).
        hostname: address or hostname for gloo to bind to. By default rpcx picks the
            local address that routes to the rendezvous host (``127.0.0.1`` when that host
            is local), which avoids the usual "wrong interface" failures on clusters.
    """

    def __init__(
        self, *, interface: str | None = None, hostname: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.interface = interface
        self.hostname = hostname


class _Link(Link):
    """A peer's link (the kit's), plus its ring of slot receives and the goodbye's sends.

    The ring: the slot receives posted for the peer (``posted``, in posting order) and
    the slots owed one (``owed``). Posting a receive costs ~15 us. The receiving thread
    does not re-post after each frame; it notes the slot as owed, and the next thread to
    finish a send to that peer (whose frame is then already on its way) posts what is
    owed. So in a call and its reply neither re-post delays the other side. The
    receiving thread re-posts itself only when fewer than half the receives remain
    posted. The first read posts the whole ring.
    """

    __slots__ = ("bye", "depth", "group", "index", "inline_limit", "owed", "posted",
                 "ring_closed", "ring_lock", "unheard")

    def __init__(self, rank: int, name: str, group: Any, index: int,
                 depth: int = RECEIVE_DEPTH) -> None:
        super().__init__(rank, name)
        # The process group the peer is reached over, and its rank in it: the world's
        # group and its world rank; in a dynamic world, a group of the pair.
        self.group = group
        self.index = index
        # Slot receives posted for the peer (the peer posts as many for us), and so how
        # far a send may run ahead of the peer's reading on the sending thread.
        self.depth = depth
        self.inline_limit = inline_limit(depth)
        self.ring_lock = threading.Lock()
        self.posted: collections.deque[tuple[bytearray, torch.Tensor, Any]] = (
            collections.deque()
        )
        self.owed: list[tuple[bytearray, torch.Tensor]] = []
        for _ in range(depth):
            slot = bytearray(SLOT_BYTES)
            self.owed.append((slot, torch.frombuffer(slot, dtype=torch.uint8)))
        self.ring_closed = False
        self.unheard = 0  # bytes sent since the peer last sent a frame (a lower bound on
        # what it may not have read; reset without the lock by the receiving thread)
        self.bye: tuple[list[Any], torch.Tensor] | None = None  # posted, not waited for


class _GlooPeers(Peers[_Link]):
    """The kit's peers, reading gloo's errors: its ``RuntimeError`` is a broken
    connection, anything else a frame made fail a protocol error."""

    def broken(self, link: _Link, exc: BaseException) -> None:
        if isinstance(exc, ProtocolError) or not isinstance(exc, Exception):
            super().broken(link, exc)
        elif isinstance(exc, RuntimeError):  # gloo's own: the connection broke
            reason = _gloo_message(exc)
            if "closed by peer" in reason.lower() or "connection reset" in reason.lower():
                reason = CLOSED_CONNECTION
            self.lost(link, LostCause.CONNECTION_LOST, reason)
        else:  # this peer cannot go on
            super().broken(link, ProtocolError(_gloo_message(exc)))


class GlooTransport(MessageTransport[_Link]):
    """Moves frames over a private gloo process group."""

    capabilities: ClassVar[Capabilities] = Capabilities(multi_process=True, multi_host=True,
                                                        dynamic=True, shows_progress=True)
    label: ClassVar[str] = "gloo"
    # (a group released while a receive is pending on it aborts the process at exit)
    when_stuck: ClassVar[str] = "their connections stay open"

    def __init__(self) -> None:
        super().__init__()
        self._pg: Any = None
        self._opts: Any = None
        self._nonce = ""  # a dynamic world: names this worker's pair groups (a rank
        # taken again gets fresh ones)

    # ------------------------------------------------------------------------ start

    def start(self, ctx: TransportContext) -> None:
        """Create the process group (connects the full mesh) and start receiving. In a
        dynamic world: a group per pair, with every member, and a doorway for later
        workers."""
        self._ctx = ctx
        opts = self._opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = _PAIR_TIMEOUT
        opts._devices = _devices(ctx)
        if ctx.admit is not None:
            self._start_dynamic(ctx)
            return
        pg = _connect_mesh(ctx, opts)
        self._pg = pg
        depth = ring_depth(ctx.world_size)
        self.begin(ctx, {rank: _Link(rank, ctx.names[rank], pg, rank, depth)
                         for rank in range(ctx.world_size) if rank != ctx.rank})

    def begin(self, ctx: TransportContext, links: dict[int, _Link]) -> None:
        """Send to and receive from every peer over its link's (connected) group."""
        self._ctx = ctx
        for link in links.values():
            link.backlog = self._backlog(link)
        super().begin(ctx, links)

    def make_peers(self, links: dict[int, _Link]) -> _GlooPeers:
        """The kit's peers, reading gloo's errors (:class:`_GlooPeers`)."""
        return _GlooPeers(self.ctx, links, self.read_one, self.write_bye,
                          ended=self.loop_ended)

    # --------------------------------------------------------------- dynamic world

    def _start_dynamic(self, ctx: TransportContext) -> None:
        """Join a dynamic world: tell each member through its doorway (a plain socket:
        a process group cannot grow), then make a group with it; open a doorway."""
        self.admission_bound = connect_limit(ctx) or HANDSHAKE_TIMEOUT  # (a pair's group)
        self._nonce = uuid.uuid4().hex
        ctx.store.set(f"gloo/nonce/{ctx.rank}", self._nonce)
        options = options_as(ctx, GlooRpcBackendOptions)
        where = options.hostname or address_towards(ctx.init_method) or default_address()
        sockets = self.join_through_doorways(ctx, where)
        links = {}
        try:
            for rank in sockets:
                links[rank] = self._pair_link(rank, self._nonce)
        except BaseException:
            assert self.doorway is not None
            self.doorway.close()
            raise
        finally:
            for sock in sockets.values():
                sock.close()
        self.begin(ctx, links)
        self.open_doorway()

    def _pair_link(self, rank: int, nonce: str) -> _Link:
        """A link to ``rank`` over a new group of the two (both ends make it, bounded;
        ``nonce`` is the newer worker's)."""
        ctx = self.ctx
        low, high = sorted((ctx.rank, rank))
        store = PrefixStore(f"gloo/pair/{low}-{high}/{nonce}/", ctx.store)
        me = 0 if ctx.rank == low else 1
        group = run_bounded(ctx, lambda: dist.ProcessGroupGloo(store, me, 2, self._opts),
                            f"the gloo group with {ctx.names[rank]!r}")
        return _Link(rank, ctx.names[rank], group, 1 - me)

    def link_newcomer(self, rank: int, sock: socket.socket) -> _Link:
        """A worker joins at ``rank``: tell it, then make the group of the two with it
        (it makes its end once told)."""
        sock.sendall(ADMITTED)
        sock.close()
        link = self._pair_link(rank, self.ctx.store.get(f"gloo/nonce/{rank}").decode())
        link.backlog = self._backlog(link)
        return link

    def _backlog(self, link: _Link) -> Backlog:
        """The peer's writer: it waits, in posting order, for frames' sends to complete."""
        return Backlog(link.lock, _write, self.thread_name("send", link.name),
                       on_error=functools.partial(self._write_failed, link),
                       after=functools.partial(self._written, link))

    # ------------------------------------------------------------------------- send

    def send(self, dst: int, frame: Frame) -> None:
        """Send ``frame`` to ``dst``; returns once gloo has written it, or at the
        frame's deadline.

        Waiting matters twice over: gloo sends straight from the tensors' memory, so the
        caller may change them as soon as this returns (arguments are copies), and a
        gloo send Work only completes when waited on, so no other thread can reap it.
        When the peer may not take the frame now, the peer's writer thread waits for it
        instead (keeping the memory alive) and the sender only until the deadline. (Not
        the kit's ``post``: a gloo send is posted whole, then waited for.)
        """
        link = self.link(dst)
        messages = _pack(frame)
        nbytes = sum(tensor.numel() for _, tensor in messages)
        # A frame's messages after its slot go only once the peer has read the slot (it
        # posts their receives then): a call's frame (one with a deadline) must not wait
        # for that on the caller's thread.
        hand_off = bool(frame.deadline) and len(messages) > 1
        with link.lock:  # posting under it keeps the messages of one frame together
            link.check_open()
            works = self._post(link, messages)
            link.unheard += nbytes
            backlog = link.backlog
            assert backlog is not None
            # Waited for here unless the peer may not take it whole now (see
            # inline_limit), or frames before it are still with the writer (waiting
            # here would wait for those too). Closing: the writers are stopping.
            pending = None if self.closing or not (
                hand_off or backlog or link.unheard > link.inline_limit
            ) else backlog.put((works, messages))
        if pending is None:
            _wait(works)
            if link.owed:  # our frame is out: now post the receives this peer is owed
                self._written(link)
            return
        if not pending.wait(frame.deadline, frame.settled):
            # The call's deadline passed with the frame not yet written (a peer that
            # reads nothing): the writer finishes it; the agent fails the call now.
            log.debug("send to rank %d still being written at its deadline", dst)

    def _post(self, link: _Link, messages: _Messages) -> list[Any]:
        """Post ``messages`` to the peer (under ``link.lock``); their gloo works."""
        try:
            return [link.group.send([tensor], link.index, tag) for tag, tensor in messages]
        except RuntimeError as exc:
            raise lost_error(exc) from None

    def _written(self, link: _Link) -> None:
        """A frame to the peer is out: post the receives it is owed."""
        if link.owed:
            try:
                self._repost(link)
            except RuntimeError as exc:  # the receive loop sees the connection broke
                log.debug("receives for rank %d not posted: %s", link.rank, exc)

    def _write_failed(self, link: _Link, exc: BaseException) -> None:
        """The writer's wait failed (under ``link.lock``): its frames failed with it;
        frames sent from here on get a writer of their own (and gloo's error)."""
        link.backlog = self._backlog(link)

    # ---------------------------------------------------------------------- receive

    def read_one(self, link: _Link) -> Frame | None:
        """The peer's next frame, ``None`` for its goodbye. Raises ``ProtocolError`` for
        a slot no sender of this format writes, gloo's ``RuntimeError`` when the
        connection broke."""
        if not link.posted:  # the first read (the ring is kept half full from then on)
            self._repost(link)
        with link.ring_lock:
            slot, slot_tensor, work = link.posted.popleft()
        work.wait()
        link.unheard = 0  # it is alive and sending, so reading too
        mode, n, body_len = _HEAD.unpack_from(slot)
        if mode == _BYE:
            return None
        self._check_slot(mode, n, body_len)
        if mode == _INLINE:
            frame = _unpack_inline(slot, slot_tensor, n, body_len)
        elif mode == _SPLIT:
            sizes = struct.unpack_from(f"<{n}Q", slot, _HEAD.size)
            start = _HEAD.size + 8 * n
            header = bytes(slot[start : _HEAD.size + body_len])
            self._check_sizes(sizes, len(header))
            frame = self._receive_buffers(link, header, sizes)
        else:
            frame = self._receive_extended(link, n, body_len)
        with link.ring_lock:
            link.owed.append((slot, slot_tensor))
            low = len(link.posted) < link.depth // 2
        if low:
            self._repost(link)
        return frame

    def _check_slot(self, mode: int, n: int, body_len: int) -> None:
        """Refuse a slot head that no sender of this format writes, before anything
        is allocated for it."""
        if mode not in (_INLINE, _SPLIT, _EXTENDED):
            raise ProtocolError(f"unknown frame mode {mode}")
        if n > _MAX_BUFFERS or body_len < 8 * n:
            raise ProtocolError(f"{n} buffers in a body of {body_len} bytes")
        if mode != _EXTENDED and _HEAD.size + body_len > SLOT_BYTES:
            raise ProtocolError(f"a body of {body_len} bytes announced inside a slot")
        check_frame_size(body_len, self.max_frame, "a body")

    def _check_sizes(self, sizes: tuple[int, ...], header_len: int) -> None:
        check_frame_size(sum(sizes) + header_len, self.max_frame)

    def _repost(self, link: _Link) -> None:
        """Post the slot receives the peer is owed, in order."""
        with link.ring_lock:
            while link.owed and not link.ring_closed:
                slot, slot_tensor = link.owed.pop()
                work = link.group.recv([slot_tensor], link.index, _TAG_SLOT)
                link.posted.append((slot, slot_tensor, work))

    def _receive_extended(self, link: _Link, n: int, body_len: int) -> Frame:
        body = bytearray(body_len)
        link.group.recv([torch.frombuffer(body, dtype=torch.uint8)], link.index,
                        _TAG_DATA).wait()
        sizes = struct.unpack_from(f"<{n}Q", body, 0)
        self._check_sizes(sizes, body_len - 8 * n)
        return self._receive_buffers(link, bytes(body[8 * n :]), sizes)

    def _receive_buffers(self, link: _Link, header: bytes, sizes: tuple[int, ...]) -> Frame:
        buffers = [empty_bytes(size) for size in sizes]
        works = [link.group.recv([piece], link.index, _TAG_DATA)
                 for b in buffers if b.numel() for piece in pieces(b)]
        ctx = self.ctx
        for work in works:
            work.wait()
            if len(works) > 2:  # (a large frame: the peer is alive, piece by piece)
                ctx.progress(link.rank)
        return Frame(header, buffers)

    def loop_ended(self, link: _Link) -> None:
        """The peer's receive loop is over (on its thread): our goodbye, if it answered
        the peer's, is waited for; receives still posted are dropped.

        Only then does the loop's thread let go of the gloo works it held: close()
        releases the process group once every loop has ended, and gloo objects outliving
        their group on another thread abort the process at exit.
        """
        self._wait_bye(link, BYE_TIMEOUT)
        with link.ring_lock:
            link.ring_closed = True
            link.posted.clear()
            link.owed.clear()

    # ------------------------------------------------------------------- goodbye

    def write_bye(self, link: _Link) -> None:
        """Post the goodbye slot (under ``link.lock``); it is waited for, bounded, when
        the peer's receive loop ends, or by ``close``."""
        slot = bytearray(SLOT_BYTES)
        _HEAD.pack_into(slot, 0, _BYE, 0, 0)
        tensor = torch.frombuffer(slot, dtype=torch.uint8)
        link.bye = (self._post(link, [(_TAG_SLOT, tensor)]), tensor)

    def _wait_bye(self, link: _Link, timeout: float) -> None:
        """Wait (bounded: a peer that stopped reading must not hold up leaving) for the
        goodbye posted to the peer, if one was and nobody waited for it yet."""
        with link.lock:
            bye, link.bye = link.bye, None
        if bye is not None:
            try:
                _wait(bye[0], max(0.001, timeout))
            except PeerLostError as exc:
                log.debug("goodbye to %s not delivered: %s", link.name, exc)

    # ------------------------------------------------------------------------ close

    def release(self, stuck: list[_Link], deadline: float) -> None:
        """After the goodbyes (the kit's ``close``): release the process group, unless
        a receive loop still runs (releasing the group now would abort the process: it
        is kept until exit)."""
        if not stuck:
            super().release(stuck, deadline)

    def release_link(self, link: _Link, deadline: float) -> None:
        """Wait (bounded) for the writer and for our goodbye, then let go of the group."""
        super().release_link(link, deadline)
        self._wait_bye(link, deadline - time.monotonic())
        link.group = None

    def released(self, timeout: float) -> None:
        """Let go of the world's process group (every link let go of its own)."""
        self._pg = None


def _write(job: tuple[list[Any], _Messages]) -> None:
    """The writer's job: wait for one frame's sends (its memory stays alive till then)."""
    _wait(job[0])


def _wait(works: list[Any], timeout: float | None = None) -> None:
    """Wait for gloo works; a broken connection raises ``PeerLostError``."""
    try:
        for work in works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise lost_error(exc) from None


def _pack(frame: Frame) -> _Messages:
    """The messages that carry ``frame``, as the module docstring lays them out."""
    sizes = [b.numel() * b.element_size() for b in frame.buffers]
    header = frame.header
    n = len(sizes)
    inline_len = 8 * n + len(header) + sum(sizes)
    slot = bytearray(SLOT_BYTES)
    slot_tensor = torch.frombuffer(slot, dtype=torch.uint8)
    if _HEAD.size + inline_len <= SLOT_BYTES:
        _HEAD.pack_into(slot, 0, _INLINE, n, inline_len)
        struct.pack_into(f"<{n}Q", slot, _HEAD.size, *sizes)
        offset = _HEAD.size + 8 * n
        slot[offset : offset + len(header)] = header
        offset += len(header)
        for buffer, size in zip(frame.buffers, sizes, strict=True):
            if size:
                slot_tensor[offset : offset + size].copy_(as_bytes(buffer))
            offset += size
        return [(_TAG_SLOT, slot_tensor)]
    body_len = 8 * n + len(header)
    messages: _Messages
    if _HEAD.size + body_len <= SLOT_BYTES:
        _HEAD.pack_into(slot, 0, _SPLIT, n, body_len)
        struct.pack_into(f"<{n}Q", slot, _HEAD.size, *sizes)
        offset = _HEAD.size + 8 * n
        slot[offset : offset + len(header)] = header
        messages = [(_TAG_SLOT, slot_tensor)]
    else:
        body = bytearray(body_len)
        struct.pack_into(f"<{n}Q", body, 0, *sizes)
        body[8 * n :] = header
        _HEAD.pack_into(slot, 0, _EXTENDED, n, body_len)
        messages = [(_TAG_SLOT, slot_tensor),
                    (_TAG_DATA, torch.frombuffer(body, dtype=torch.uint8))]
    messages += [(_TAG_DATA, piece) for b, s in zip(frame.buffers, sizes, strict=True) if s
                 for piece in pieces(as_bytes(b))]
    return messages


def _connect_mesh(ctx: TransportContext, opts: Any) -> Any:
    """Build the process group, bounded by the join timeout (``rpc_timeout``).

    gloo waits for every peer's address (and connection) with the pair timeout, which
    must be effectively infinite for idle receives; a peer that dies after joining the
    world would leave ``init_rpc`` hanging. So the group is built on a helper thread and
    abandoned (the thread stays blocked in gloo) if it is not connected in time.
    """
    # Its own store connection: a TCPStore client serialises calls, so a wait that gloo
    # leaves blocked would otherwise hold up every later store call of this worker
    # (including the teardown of the failed init).
    try:
        store = ctx.store.clone()  # type: ignore[attr-defined]
        keep_if_file_store(store)  # (destroying a FileStore may freeze)
    except RuntimeError:  # stores that cannot be cloned do not block one another
        store = ctx.store
    return run_bounded(
        ctx, lambda: dist.ProcessGroupGloo(store, ctx.rank, ctx.world_size, opts),
        f"the gloo mesh to its {ctx.world_size - 1} peers",
    )


def _unpack_inline(slot: bytearray, slot_tensor: torch.Tensor, n: int, body_len: int) -> Frame:
    sizes = struct.unpack_from(f"<{n}Q", slot, _HEAD.size)
    offset = _HEAD.size + 8 * n
    header_len = body_len - 8 * n - sum(sizes)
    if header_len < 0:
        raise ProtocolError(f"buffers of {sum(sizes)} bytes in a body of {body_len}")
    header = bytes(slot[offset : offset + header_len])
    offset += header_len
    buffers = []
    for size in sizes:
        buffers.append(slot_tensor[offset : offset + size].clone())
        offset += size
    return Frame(header, buffers)


def _gloo_message(exc: BaseException) -> str:
    """gloo's message without the C++ source location it starts with."""
    return without_cpp_locations(str(exc))


def _devices(ctx: TransportContext) -> list[Any]:
    """gloo's devices: the option's interface, else each of ``$GLOO_SOCKET_IFNAME``
    (comma-separated, as torch reads it), else the option's hostname, else the local
    address that routes to the rendezvous host.

    torch reads ``$GLOO_SOCKET_IFNAME`` only where it builds a process group's options
    itself; rpcx builds them, so it reads the variable here.
    """
    options = options_as(ctx, GlooRpcBackendOptions)
    if options.interface:
        return [dist.ProcessGroupGloo.create_device(interface=options.interface)]
    from_env = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if from_env:
        return [dist.ProcessGroupGloo.create_device(interface=name) for name in from_env]
    hostname = options.hostname or address_towards(ctx.init_method)
    if hostname:
        return [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    return [dist.ProcessGroupGloo.create_default_device()]


@hookimpl
def rpcx_register_backends(register: Any) -> None:
    """Register the gloo backend."""
    register(
        "gloo",
        GlooTransport,
        description="torch.distributed gloo send/recv on a private process group",
        options_type=GlooRpcBackendOptions,
    )
