"""The socket backends: ``auto`` (the default), ``shm`` and ``tcp``.

One transport, one wire format, one socket per pair of workers; only the socket differs
(:mod:`rpcx.backends.socket_mesh` picks it per pair). Workers of one host share a Unix
stream socket, and a buffer of ``shm_min_bytes`` or more does not travel through it: the
sender copies it into a shared-memory segment from its pool for that peer
(:mod:`rpcx.backends.segments`), and the receiver hands a view of its own mapping of the
segment to rpcx as the tensor's memory. So a large tensor is copied once per hop, by the
sender, into memory already paged in. Workers on two hosts share a TCP connection, and
every buffer travels inline (received straight into the tensor's memory). ``auto``
routes each pair by host; ``shm`` refuses a world that spans hosts; ``tcp`` uses TCP
for every pair (the network path, measurable on one host).

A frame is written with one ``sendmsg``: a fixed head, the buffer sizes, the opaque
header and the small buffers inline. A segment's descriptor travels beside the first
frame that uses it (``SCM_RIGHTS``); later frames name it by id. When the receiving
tensor is freed, the receiver sends ``FREE`` with the segment's id and the sender may
fill it again.

Wire format, little-endian::

    head      kind:u8, pad:3, count:u32, header length:u32
    sizes     count x u64
    where     count x u8      0: inline, 1: segment with its descriptor attached (in
                              order), 2: segment the peer has mapped
    segments  count x u32     segment id (0 for inline, and for a one-off segment)
    header    header length bytes
    inline    the inline buffers, back to back

A frame with ``_PIECED_MIN`` inline bytes or more and no segments is written in pieces,
so that small frames sent meanwhile can pass it (a call beside a bulk transfer waits
for a piece, not the transfer): ``PIECED`` (kind 5) is the frame's head, sizes, where,
segments (all inline) and header as above, and its inline bytes follow in ``PIECE``
records (kind 6: the head with ``count`` the piece's length, then that many bytes).
Other frames may come between two pieces; the frame is delivered once its last piece
is in.

``FREE`` (kind 3): the head with ``count`` segment ids (u32) after it: segments the
sender may fill again. ``RETIRE`` (kind 4), the same shape: segments the sender dropped
from its pool, which the receiver unmaps (tensors still over them keep their memory).
``BYE`` (kind 2) is the last frame a worker sends a peer.

Everything else is rpcx's transport kit (:class:`rpcx.transport_kit.StreamTransport`):
the mesh and its handshake (with a world key, a challenge-response both ways), receive
loops on lanes, goodbyes and lost peers, corked replies, and writes that never wait on
the socket: what a peer's socket does not take at once goes, copied (descriptors
duplicated), to that peer's writer thread, and a sender waits for it until its frame's
deadline at most. So a stopped peer holds no call past its timeout and no other peer's
frames at all.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from rpcx.backends.segments import ONE_OFF, ReceivedSegments, Segment, SendPool, one_off_copy
from rpcx.backends.socket_mesh import (
    Policy,
    Route,
    connect_mesh,
    join_mesh,
    listen_mesh,
    route_to_newcomer,
    tune,
)
from rpcx.backends.socket_options import SocketRpcBackendOptions
from rpcx.hookspecs import hookimpl
from rpcx.transport import Capabilities, Frame, TransportContext
from rpcx.transport_kit import (
    Doorway,
    ProtocolError,
    SocketLink,
    StreamTransport,
    as_bytes,
    check_count,
    check_frame_size,
    empty_bytes,
    lost_error,
    memory_of,
    options_as,
)
from rpcx.transport_kit.socket_link import MOVED_EVERY, SocketReader

__all__ = ["AutoTransport", "ShmTransport", "SocketTransport", "TcpTransport"]

_HEAD = struct.Struct("<BxxxII")  # kind, number of buffers, header length
_FRAME, _BYE, _FREE, _RETIRE, _PIECED, _PIECE = 1, 2, 3, 4, 5, 6
_PACK_PARTS = 64  # more inline buffers than this are packed into one (the iovec limit)
_INLINE, _NEW_SEGMENT, _MAPPED_SEGMENT = 0, 1, 2
_MAX_FDS = 64  # descriptors one frame may carry; more large buffers travel inline
_MAX_BUFFERS = 1 << 20  # buffers in one frame, at most (their sizes are read up front)
_DIRECT_READ = 64 << 10  # an inline buffer this large is received straight into its tensor
# A frame with this many inline bytes travels in pieces of _PIECE_BYTES, and one of
# _PASS_MAX bytes at most may go between two of them. A piece takes 2 ms at 1 Gbit/s:
# about what a small call beside a bulk transfer waits.
_PIECED_MIN = 1 << 20
_PIECE_BYTES = 256 << 10
_PASS_MAX = 64 << 10
_FLUSH_CHECK_S = 0.5  # the flusher's bound on a wait, so it sees close() promptly
# How long freed segment ids wait for a frame to the peer to carry them before the
# flusher sends them on their own: in a call-and-reply exchange the next frame comes
# sooner, so the ids cost neither a write of their own nor a thread wake-up.
_FREE_DELAY_S = 0.005


def _ids_message(kind: int, ids: list[int]) -> bytes:
    """A FREE or RETIRE message carrying ``ids``."""
    return _HEAD.pack(kind, len(ids), 0) + struct.pack(f"<{len(ids)}I", *ids)


def _in_pieces(parts: list[Any]) -> list[list[Any]]:
    """A large frame's inline bytes as its ``PIECE`` records: a head, then views."""
    records: list[list[Any]] = []
    current: list[Any] = []
    size = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while len(view):
            take = min(len(view), _PIECE_BYTES - size)
            current.append(view[:take])
            view = view[take:]
            size += take
            if size == _PIECE_BYTES:
                records.append([_HEAD.pack(_PIECE, size, 0), *current])
                current, size = [], 0
    if current:
        records.append([_HEAD.pack(_PIECE, size, 0), *current])
    return records


class _Assembly:
    """A frame arriving in pieces: its header, its buffers, what is left to fill."""

    __slots__ = ("buffers", "header", "left", "targets", "unsaid")

    def __init__(self, header: bytes, buffers: list[torch.Tensor]) -> None:
        self.header = header
        self.buffers = buffers
        self.targets = collections.deque(memory_of(b) for b in buffers if b.numel())
        self.left = sum(b.numel() for b in buffers)
        self.unsaid = 0  # bytes in since the peer was last said to be alive

    def read_piece(self, reader: SocketReader, count: int) -> Frame | None:
        """Receive a piece of ``count`` bytes into the buffers; the frame once whole."""
        if not 0 < count <= self.left:
            raise ProtocolError(f"a piece of {count} bytes, with {self.left} left to come")
        self.left -= count
        count_read = count
        while count:
            target = self.targets[0]
            take = min(len(target), count)
            reader.read_into(target[:take])
            if take == len(target):
                self.targets.popleft()
            else:
                self.targets[0] = target[take:]
            count -= take
        if not self.left:  # (buffers allocated for this frame alone: the receiver's)
            return Frame(self.header, self.buffers,
                         owned=frozenset(range(len(self.buffers))))
        self.unsaid += count_read
        if self.unsaid >= MOVED_EVERY:  # (a piece is smaller: say so across pieces)
            self.unsaid = 0
            reader.moved()
        return None


_MORE = object()  # (a piece was read; its frame is not whole yet)


def _drain(queue: collections.deque[int]) -> list[int]:
    """Everything in ``queue``, removed (appends from other threads are safe)."""
    items = []
    while queue:
        items.append(queue.popleft())
    return items


class _Peer(SocketLink):
    """A peer's link, its route, and the segments this worker fills for it and those it
    fills (a peer on another host has none: ``shm_min`` is then past any buffer)."""

    __slots__ = ("assembly", "freed", "pool", "received", "route", "shm_min")

    def __init__(self, rank: int, name: str, sock: socket.socket | None, writer_name: str,
                 route: Route, shm_min: int, pool: SendPool,
                 freed: Callable[[_Peer, int], None],
                 progress: Callable[[int], None] | None = None) -> None:
        super().__init__(rank, name, sock, writer_name, progress)
        self.route = route
        self.shm_min = shm_min if route.local else sys.maxsize
        self.pool = pool
        # ``freed(self, segment_id)`` when tensors over a segment it filled are gone.
        self.received = ReceivedSegments(functools.partial(freed, self))
        self.freed: collections.deque[int] = collections.deque()  # ids to send in FREE
        self.assembly: _Assembly | None = None  # a frame arriving in pieces


class SocketTransport(StreamTransport[_Peer]):
    """Moves frames over one stream socket per pair of workers: Unix and shared memory
    within a host, TCP across hosts, as ``policy`` says."""

    capabilities: ClassVar[Capabilities] = Capabilities(multi_process=True, multi_host=True,
                                                        dynamic=True, shows_progress=True,
                                                        interleaves=True)
    policy: ClassVar[Policy] = Policy.AUTO
    label: ClassVar[str] = "auto"
    bye: ClassVar[bytes] = _HEAD.pack(_BYE, 0, 0)

    def __init__(self) -> None:
        super().__init__()
        self._options = SocketRpcBackendOptions()
        self._routes: dict[int, Route] = {}
        self._flush_wanted = threading.Event()
        self._closed = threading.Event()  # set at close: the flusher stops waiting
        self._flusher_thread: threading.Thread | None = None

    def routes(self) -> Mapping[int, str]:
        """How this worker reaches each peer, by rank, e.g. ``"shm (same host)"``."""
        return {rank: route.describe() for rank, route in self._routes.items()}

    # ------------------------------------------------------------------------ start

    def start(self, ctx: TransportContext) -> None:
        """Learn every worker's host, connect to each by its route, start receiving."""
        self._options = options_as(ctx, SocketRpcBackendOptions)
        super().start(ctx)
        self._flusher_thread = threading.Thread(
            target=self._flusher, name=f"rpcx-{ctx.names[ctx.rank]}-shm-free", daemon=True
        )
        self._flusher_thread.start()

    def connect(self, ctx: TransportContext) -> dict[int, socket.socket]:
        """One connected socket per peer: Unix on this host, TCP to other hosts. In a
        dynamic world, one per member, and a doorway for the workers that join later."""
        if ctx.admit is None and self._options.connect_on_demand:
            self._routes, listeners, self.dial_peer = listen_mesh(
                ctx, self.label, self.policy, self._options)
            self.doorway = Doorway(ctx, listeners.sockets, self.label, self.may_pair,
                                   self.pair, listeners.close)
            return {}
        if ctx.admit is None:
            sockets, self._routes = connect_mesh(ctx, self.label, self.policy,
                                                 self._options)
            return sockets
        sockets, self._routes, listeners = join_mesh(ctx, self.label, self.policy,
                                                     self._options)
        self.doorway = Doorway(ctx, listeners.sockets, self.label, self.newcomer,
                               self.welcome, listeners.close)
        return sockets

    def link_newcomer(self, rank: int, sock: socket.socket) -> _Peer:
        """A worker joined at ``rank``: its route, then the kit's link."""
        route = route_to_newcomer(self.ctx, self.label, self.policy, rank)
        self._routes = {**self._routes, rank: route}
        return super().link_newcomer(rank, tune(sock, route))

    def tune_socket(self, rank: int, sock: socket.socket) -> socket.socket:
        """Socket options for ``rank``'s route (a connection made on demand)."""
        return tune(sock, self._routes[rank])

    def make_link(self, rank: int, sock: socket.socket | None) -> _Peer:
        ctx = self.ctx
        return _Peer(rank, ctx.names[rank], sock, self.thread_name("send", ctx.names[rank]),
                     self._routes[rank], self._options.shm_min_bytes,
                     SendPool(self._options.shm_pool_bytes), self._segment_freed,
                     ctx.progress)

    # ------------------------------------------------------------------------- send

    def pack(self, frame: Frame) -> list[Any]:
        """A frame without buffers: the head and header (others go through ``send``)."""
        return [_HEAD.pack(_FRAME, 0, len(frame.header)), frame.header]

    def send(self, dst: int, frame: Frame) -> None:
        """Write ``frame`` to ``dst``'s socket; large buffers go through shared memory.

        Returns once the frame is written, or at ``frame.deadline`` with the rest queued
        for the peer's writer thread."""
        peer = self.link(dst)
        freed = _drain(peer.freed) if peer.freed else None
        if not frame.buffers:  # most calls and replies: the head and header, one write
            head = _HEAD.pack(_FRAME, 0, len(frame.header)) + frame.header
            peer.send([_ids_message(_FREE, freed) + head if freed else head],
                      deadline=frame.deadline, cork=self.cork_bytes, settled=frame.settled,
                      may_pass=frame.may_pass and len(head) <= _PASS_MAX)
            return
        shm_min = peer.shm_min
        buffers = [as_bytes(b) for b in frame.buffers]
        sizes = [b.numel() for b in buffers]
        count = len(sizes)
        where, ids = bytearray(count), [0] * count
        one_offs: dict[int, int] = {}  # buffer index -> one-off segment's descriptor
        parts: list[Any] = []
        later: list[list[Any]] = []  # (the PIECE records of a frame in pieces)
        used: dict[int, Segment] = {}  # buffer index -> pooled segment this frame filled
        sent = False
        pending = None
        try:
            # Filling segments needs no lock: a segment is this frame's alone until the
            # peer frees it, which it cannot before receiving the frame.
            for index, (buffer, size) in enumerate(zip(buffers, sizes, strict=True)):
                if size < shm_min or len(used) + len(one_offs) >= _MAX_FDS:
                    if size:
                        parts.append(memory_of(buffer))
                    continue
                segment = peer.pool.acquire(size)
                if segment is None:  # the pool is full of segments the peer still holds
                    one_offs[index] = one_off_copy(buffer)
                    where[index], ids[index] = _NEW_SEGMENT, ONE_OFF
                    continue
                used[index] = segment
                segment.memory[:size].copy_(buffer)
                ids[index] = segment.id
            if len(parts) > _PACK_PARTS:  # one iovec each would pass the kernel's limit
                parts = [b"".join(parts)]
            inline = sum(len(p) for p in parts)
            kind = _FRAME
            if inline >= _PIECED_MIN and not (used or one_offs):
                kind, later, parts = _PIECED, _in_pieces(parts), []
            with peer.lock:
                peer.check_open()
                # Whether a segment's descriptor still has to travel is decided, and
                # settled, under the lock: every frame to this peer goes out in order.
                fds = []  # in buffer order: the receiver pairs them with buffers so
                for index in sorted(used.keys() | one_offs.keys()):
                    segment = used.get(index)
                    if segment is None:
                        fds.append(one_offs[index])
                    elif segment.fd is None:
                        where[index] = _MAPPED_SEGMENT
                    else:
                        where[index] = _NEW_SEGMENT
                        fds.append(segment.fd)
                head = (_HEAD.pack(kind, count, len(frame.header))
                        + struct.pack(f"<{count}Q", *sizes) + bytes(where)
                        + struct.pack(f"<{count}I", *ids))
                retired = peer.pool.take_retired() if used or one_offs else None
                if retired:  # ahead of the frame: the peer unmaps before it maps anew
                    head = _ids_message(_RETIRE, retired) + head
                if freed:
                    head = _ids_message(_FREE, freed) + head
                try:
                    pending = peer.write_locked(
                        [head, frame.header, *parts], fds, later,
                        may_pass=frame.may_pass and not (fds or used)
                        and inline + len(head) + len(frame.header) <= _PASS_MAX)
                except OSError as exc:
                    raise lost_error(exc) from None
                # Sent, or queued with copies of the descriptors: in order either way.
                for segment in used.values():
                    segment.descriptor_sent()
                sent = True
        finally:
            del parts, later  # views of the tensors' memory: released before they go
            for fd in one_offs.values():  # the receiver holds its own copy of each now
                os.close(fd)
            if not sent:
                peer.pool.release([s.id for s in used.values()])
        if pending is not None:
            peer.wait(pending, frame.deadline, frame.settled)

    def _segment_freed(self, peer: _Peer, segment_id: int) -> None:
        """Tensors over a segment ``peer`` filled are gone: let it fill it again.

        Runs from a finalizer, on whichever thread dropped the last such tensor (often a
        receive loop, or one holding a send lock): so it only queues the id, and the
        transport's flusher thread sends it. Only to that very peer: in a dynamic world
        a new worker may hold its rank by now, with segments of its own under the same
        ids.
        """
        if self.closing or self.links.get(peer.rank) is not peer:
            return
        peer.freed.append(segment_id)
        if not self._flush_wanted.is_set():
            self._flush_wanted.set()

    def _flusher(self) -> None:
        """Send queued FREE ids, off the threads whose finalizers produced them."""
        while not self.closing:
            if not self._flush_wanted.wait(_FLUSH_CHECK_S):
                continue
            # Give frames to the peers a moment to carry the ids (see _FREE_DELAY_S).
            self._closed.wait(_FREE_DELAY_S)
            self._flush_wanted.clear()
            for peer in self.links.values():
                ids = _drain(peer.freed)
                if ids:
                    self._send_ids(peer, _FREE, ids)

    def _send_ids(self, peer: _Peer, kind: int, ids: list[int]) -> None:
        """Send a FREE or RETIRE; never waits (queued behind a peer that reads nothing,
        it would otherwise hold up the FREEs to every other peer)."""
        message = _ids_message(kind, ids)
        with peer.lock:
            if peer.bye_sent or peer.gone:
                return
            with contextlib.suppress(OSError):  # a lost peer is seen by its receiver
                # (a FREE is small and ordered with no frame: it may pass one being
                # written; a RETIRE must precede the frames that map anew)
                peer.write_locked([message], [], may_pass=kind == _FREE)

    # ---------------------------------------------------------------------- receive

    def read_one(self, link: _Peer) -> Frame | None:
        """The next frame from the peer (None for its goodbye); FREE and RETIRE are
        handled on the way."""
        while True:
            frame = self._read_frame(link)
            if frame is _MORE:
                continue
            if not isinstance(frame, tuple):
                return frame  # type: ignore[return-value]
            kind, ids = frame
            if kind == _FREE:
                link.pool.release(ids)
            else:
                link.received.retire(ids)

    def _read_frame(self, peer: _Peer) -> Frame | tuple[int, list[int]] | object | None:
        """The next message from ``peer``: a frame, (kind, ids) of a FREE or RETIRE,
        ``_MORE`` for a piece of a frame not yet whole, or None for BYE."""
        reader = peer.reader
        assembly = peer.assembly
        # (While a frame comes in pieces, a piece's head is read alone: its bytes go
        # straight into their tensor.)
        reader.fill(_HEAD.size, exact=assembly is not None)
        kind, count, header_len = _HEAD.unpack(reader.take(_HEAD.size))
        if kind == _PIECE:
            if assembly is None:
                raise ProtocolError(f"a piece of {count} bytes, with no frame in pieces "
                                    f"begun (frames before: {list(reader.recent)})")
            frame = assembly.read_piece(reader, count)
            if frame is None:
                return _MORE
            peer.assembly = None
            return frame
        if kind == _PIECED and assembly is not None:
            raise ProtocolError("a frame in pieces begun before the last one was whole "
                                f"({assembly.left} bytes of it still to come)")
        if kind == _BYE:
            return None
        # Checked before anything is read or allocated for it (max_frame_bytes).
        check_count(count, _MAX_BUFFERS)
        if 13 * count + header_len > self.max_frame:
            raise ProtocolError(f"a frame announcing {count} buffers and a header of "
                                f"{header_len} bytes, over max_frame_bytes ({self.max_frame})")
        if kind in (_FREE, _RETIRE):
            reader.fill(4 * count)
            return kind, list(struct.unpack(f"<{count}I", reader.take(4 * count)))
        if kind == _FRAME and not count:  # no buffers: the header is all there is
            reader.fill(header_len)
            reader.recent.append((0, header_len))
            return Frame(bytes(reader.take(header_len)), [])
        if kind not in (_FRAME, _PIECED):
            raise ProtocolError(f"unknown frame kind {kind} (count {count}, header "
                                f"{header_len}; frames before: {list(reader.recent)})")
        reader.fill(13 * count + header_len)
        sizes = struct.unpack(f"<{count}Q", reader.take(8 * count)) if count else ()
        where = bytes(reader.take(count))
        ids = struct.unpack(f"<{count}I", reader.take(4 * count)) if count else ()
        header = bytes(reader.take(header_len))
        reader.recent.append((count, header_len, sizes, where, ids))
        if any(w > _MAPPED_SEGMENT for w in where):
            raise ProtocolError(f"unknown buffer placements {sorted(set(where))}")
        check_frame_size(sum(sizes) + header_len, self.max_frame)
        if kind == _PIECED:
            return self._begin_pieces(peer, header, sizes, where)
        small = sum(size for size, w in zip(sizes, where, strict=True)
                    if w == _INLINE and size < _DIRECT_READ)
        if small == sum(size for size, w in zip(sizes, where, strict=True) if w == _INLINE):
            reader.fill(small)  # every inline byte, in as few reads as they take
        buffers = []
        for size, w, segment_id in zip(sizes, where, ids, strict=True):
            # (Only a buffer in a shared segment is not the receiver's own to change.)
            if w == _NEW_SEGMENT:
                fd = reader.fds.popleft()
                try:
                    buffers.append(peer.received.tensor(segment_id, size, fd))
                finally:
                    os.close(fd)
            elif w == _MAPPED_SEGMENT:
                buffers.append(peer.received.tensor(segment_id, size, None))
            elif size >= _DIRECT_READ:
                # Pages of a fresh large allocation are not touched until bytes land in
                # them, so memory still follows what was received (within max_frame).
                try:
                    tensor = empty_bytes(size)  # (huge pages when large: fewer faults)
                except RuntimeError as exc:
                    raise ProtocolError(f"a buffer of {size} bytes: {exc}") from None
                reader.read_into(memory_of(tensor))
                buffers.append(tensor)
            elif size:
                reader.fill(size)
                buffers.append(torch.frombuffer(bytearray(reader.take(size)), dtype=torch.uint8))
            else:
                buffers.append(torch.empty(0, dtype=torch.uint8))
        return Frame(header, buffers, owned=frozenset(
            index for index, w in enumerate(where) if w == _INLINE))

    @staticmethod
    def _begin_pieces(peer: _Peer, header: bytes, sizes: tuple[int, ...], where: bytes
                      ) -> object:
        """A frame that comes in pieces: its buffers, to be filled as they arrive."""
        if any(where):
            raise ProtocolError("a frame in pieces with buffers in shared memory")
        if sum(sizes) < _PIECED_MIN:  # (no sender pieces it: it could never be whole)
            raise ProtocolError(f"a frame of {sum(sizes)} bytes announced in pieces")
        buffers = []
        for size in sizes:
            try:  # (pages are touched as bytes land: memory follows what was received)
                buffers.append(empty_bytes(size) if size >= _DIRECT_READ
                               else torch.empty(size, dtype=torch.uint8))
            except RuntimeError as exc:
                raise ProtocolError(f"a buffer of {size} bytes: {exc}") from None
        peer.assembly = _Assembly(header, buffers)
        return _MORE

    # ------------------------------------------------------------------------ close

    def close(self, timeout: float) -> None:
        """Goodbye to every peer, a bounded wait for theirs, then close the sockets and
        release the segments."""
        self._closed.set()
        self._flush_wanted.set()
        super().close(timeout)

    def retire(self, link: _Peer) -> None:
        """Release a peer that left before a new worker takes its rank: its segments
        too."""
        super().retire(link)
        link.pool.close()
        link.received.close()

    def released(self, timeout: float) -> None:
        for peer in self.links.values():
            peer.pool.close()
            peer.received.close()
        self._flush_wanted.set()
        if self._flusher_thread is not None:
            self._flusher_thread.join(timeout)


# ------------------------------------------------------------------------- backends


class AutoTransport(SocketTransport):
    """The default: shared memory within a host, TCP across hosts, chosen per pair."""

    policy = Policy.AUTO
    label = "auto"


class ShmTransport(SocketTransport):
    """Workers of one host only: Unix sockets and shared memory."""

    capabilities = Capabilities(multi_process=True, multi_host=False, dynamic=True,
                                shows_progress=True, interleaves=True)
    policy = Policy.SHM
    label = "shm"


class TcpTransport(SocketTransport):
    """TCP for every pair of workers, even on one host."""

    policy = Policy.TCP
    label = "tcp"


@hookimpl
def rpcx_register_backends(register: Any) -> None:
    """Register ``auto``, ``shm`` and ``tcp``."""
    options = {"options_type": SocketRpcBackendOptions}
    register("auto", AutoTransport, **options,
             description="the default: shared memory within a host, TCP across hosts, per pair")
    register("shm", ShmTransport, **options,
             description="one host: Unix sockets, large tensors through shared memory")
    register("tcp", TcpTransport, **options,
             description="TCP for every pair of workers (the network path, even on one host)")
