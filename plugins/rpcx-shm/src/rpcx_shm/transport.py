"""The shm transport: frames over Unix domain sockets, large tensors through shared memory.

One host only. Every pair of workers shares one Unix stream socket. A frame is written
with one ``sendmsg``: a fixed head, the buffer sizes, the opaque header and the small
buffers inline. A buffer of ``shm_min_bytes`` or more does not travel through the
socket: the sender copies it into a shared-memory segment from its pool for that peer
(:mod:`rpcx_shm.segments`), and the receiver hands a view of its own mapping of the
segment to rpcx as the tensor's memory. So a large tensor is copied once per hop, by the
sender, into memory already paged in. A segment's descriptor travels beside the first
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

``FREE`` (kind 3): the head with ``count`` segment ids (u32) after it: segments the
sender may fill again. ``RETIRE`` (kind 4), the same shape: segments the sender dropped
from its pool, which the receiver unmaps (tensors still over them keep their memory).

Replies sent on a peer's receiving thread while more of that peer's frames are already
buffered are corked: held, in order, and written with the next frame to that peer or
before the receiving thread next waits for input (``_Peer.may_cork``). A burst of small
calls is answered in a few writes instead of one each.

Writes never wait on the socket (``MSG_DONTWAIT``). What a peer's socket does not take
at once goes, copied, to that peer's writer thread, and later frames to the peer queue
behind it (``_Peer.backlog``), in order. A sender waits for its queued frame until the
frame's deadline at most (a call's timeout: the agent fails the call then, and the
frame still goes if the peer reads again); frames without one (replies, control) wait
until written, without the peer's lock. So a stopped peer holds no call past its
timeout and no other peer's frames at all, and ``close()``, which shuts the sockets
down after its bounded wait, ends the writers.

``BYE`` (kind 2) is the last frame a worker sends a peer; a worker that receives one it
did not expect answers with its own, and each side's receive loop ends on the other's
``BYE`` or on end of file. End of file or a reset without ``BYE`` means the peer's
process is gone: the peer is reported lost at once.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import json
import logging
import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from rpcx import auth
from rpcx.errors import (
    AuthenticationError,
    LostCause,
    PeerLostError,
    ProtocolError,
    RpcTimeoutError,
)
from rpcx.hosts import host_identity
from rpcx.options import DEFAULT_MAX_FRAME_BYTES
from rpcx.transport import Capabilities, Frame, TransportContext
from rpcx_shm.options import ShmRpcBackendOptions
from rpcx_shm.segments import ONE_OFF, ReceivedSegments, Segment, SendPool, one_off_copy

__all__ = ["ShmTransport", "host_identity"]

log = logging.getLogger("rpcx.backends.shm")

_HEAD = struct.Struct("<BxxxII")  # kind, number of buffers, header length
_HELLO = struct.Struct("<8sI")  # magic, rank of the connecting worker
_NONCE, _PROOF = auth.NONCE_BYTES, auth.TAG_BYTES  # a challenge, an answer to one
_HANDSHAKE_TIMEOUT = 10.0  # seconds a new connection may take to introduce itself
_MAGIC = b"rpcx-shm"
_FRAME, _BYE, _FREE, _RETIRE = 1, 2, 3, 4
_PACK_PARTS = 64  # more inline buffers than this are packed into one (the iovec limit)
_INLINE, _NEW_SEGMENT, _MAPPED_SEGMENT = 0, 1, 2
_MAX_FDS = 64  # descriptors one frame may carry; more large buffers travel inline
_MAX_BUFFERS = 1 << 20  # buffers in one frame, at most (their sizes are read up front)
_READ_CHUNK = 256 << 10  # bytes asked for per read: many small frames per system call
_SOCKET_BUFFER = 4 << 20  # SO_SNDBUF/SO_RCVBUF: room for a burst of small frames
_BYE_TIMEOUT_S = 10.0  # answering a peer's goodbye: how long the send lock may take
_FLUSH_CHECK_S = 0.5  # the flusher's bound on a wait, so it sees close() promptly
_CORK_BYTES = 64 << 10  # replies held back while more requests wait to be read, at most


def _ids_message(kind: int, ids: list[int]) -> bytes:
    """A FREE or RETIRE message carrying ``ids``."""
    return _HEAD.pack(kind, len(ids), 0) + struct.pack(f"<{len(ids)}I", *ids)


def _drain(queue: collections.deque[int]) -> list[int]:
    """Everything in ``queue``, removed (appends from other threads are safe)."""
    items = []
    while queue:
        items.append(queue.popleft())
    return items


class _Reader:
    """One peer's incoming byte stream and the descriptors that came with it.

    Only the thread holding the peer's receive lane reads, so none of this is locked; the
    state lives here, not in the loop, because the lane may move to another thread
    between two frames.
    """

    __slots__ = ("before_wait", "buffer", "end", "fds", "recent", "start")

    def __init__(self, before_wait: Callable[[], None]) -> None:
        self.buffer = bytearray(_READ_CHUNK)
        self.start = 0  # first unread byte
        self.end = 0  # one past the last received byte
        self.fds: collections.deque[int] = collections.deque()
        self.recent: collections.deque[Any] = collections.deque(maxlen=3)  # for errors
        self.before_wait = before_wait  # runs before each read that may block

    @property
    def buffered(self) -> int:
        """Bytes received and not yet taken."""
        return self.end - self.start

    def fill(self, sock: socket.socket, needed: int) -> None:
        """Read until ``needed`` unread bytes are buffered; ``EOFError`` if the peer left."""
        while self.end - self.start < needed:
            self.before_wait()
            if len(self.buffer) - self.start < max(needed, _READ_CHUNK // 2) and self.start:
                # Move what is unread (usually nothing or a few bytes) to the front.
                unread = self.end - self.start
                self.buffer[:unread] = self.buffer[self.start : self.end]
                self.start, self.end = 0, unread
            if self.end == len(self.buffer):  # full, and a frame larger than it: grow,
                # by what has arrived so far at most (doubling), never by what the peer
                # merely announced: memory follows the bytes actually received.
                missing = needed - (self.end - self.start)
                self.buffer.extend(bytes(min(missing, max(_READ_CHUNK, len(self.buffer)))))
            with memoryview(self.buffer) as whole, whole[self.end :] as view:
                count, ancillary, flags, _ = sock.recvmsg_into(
                    [view], socket.CMSG_SPACE(_MAX_FDS * 4)
                )
            if flags & socket.MSG_CTRUNC:
                # Descriptors were dropped (this process is out of them, most likely):
                # they pair with frames by order, so the stream cannot go on.
                raise OSError("shared-memory descriptors lost in transit (MSG_CTRUNC); "
                              "raise the open-file limit (ulimit -n)")
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(data) - len(data) % 4
                    self.fds.extend(struct.unpack(f"<{usable // 4}i", data[:usable]))
            if count == 0:
                raise EOFError
            self.end += count

    def take(self, count: int) -> memoryview:
        """The next ``count`` buffered bytes (valid until the next :meth:`fill`)."""
        view = memoryview(self.buffer)[self.start : self.start + count]
        self.start += count
        return view

    def close(self) -> None:
        """Close descriptors that arrived but were never used."""
        while self.fds:
            os.close(self.fds.popleft())


class _Unwritten:
    """The rest of a frame the socket did not take at once, queued for the peer's writer.

    Holds nothing that can change under it (byte strings, views of byte strings, copies
    of tensor memory) and its own duplicates of the descriptors still to travel: the
    sender may return at its deadline, before the writer gets to it."""

    __slots__ = ("data", "done", "error", "fds")

    def __init__(self, views: list[memoryview], fds: list[int]) -> None:
        self.data = [v if isinstance(v.obj, bytes) else bytes(v) for v in views]
        self.fds = [os.dup(fd) for fd in fds]
        self.done = threading.Event()
        self.error: OSError | None = None

    def finish(self, error: OSError | None = None) -> None:
        """Written (or never to be: ``error``); close this job's descriptors."""
        self.error = error
        while self.fds:
            os.close(self.fds.pop())
        self.done.set()


class _Peer:
    """Per-peer state: the socket, the send lock, goodbye flags, the reader and lane,
    the segments this worker fills for the peer and those the peer fills for it, and
    the frames queued for the peer's writer thread."""

    __slots__ = ("backlog", "bye_sent", "corked", "ended", "freed", "gone", "lane",
                 "lock", "pool", "reader", "received", "sock", "stopping", "wakeup",
                 "writer", "writer_name")

    def __init__(self, sock: socket.socket, pool: SendPool, received: ReceivedSegments,
                 writer_name: str = "rpcx-shm-send") -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.reader = _Reader(self.flush_corked)
        # Replies held back, back to back, to go out with the next write (see may_cork).
        # One byte string, not a list: a write takes at most 1,024 pieces.
        self.corked = bytearray()
        self.pool = pool
        self.received = received
        self.freed: collections.deque[int] = collections.deque()  # ids to send in FREE
        self.bye_sent = False
        self.gone = False
        self.lane: Any = None  # rpcx._lanes.ReceiveLane when the agent offers lanes
        self.ended = threading.Event()  # the receive loop is over: nothing more arrives
        # Frames the socket did not take at once, oldest first; while there are any,
        # later frames queue behind them (per-peer order). The writer thread, started
        # the first time one is queued, writes them; it waits on ``wakeup`` for more.
        self.backlog: collections.deque[_Unwritten] = collections.deque()
        self.wakeup = threading.Condition(self.lock)
        self.writer: threading.Thread | None = None
        self.writer_name = writer_name
        self.stopping = False  # close(): the writer ends once nothing is queued

    def may_cork(self) -> bool:
        """May a frame the calling thread sends now wait for the next write?

        Yes when the thread receives this peer's frames (holds its lane) and more of them
        are already buffered: it is serving a burst of requests, and their replies go out
        together, one system call instead of one each, before it next waits for input
        (:meth:`flush_corked`) or with any other frame to this peer. Call under ``lock``:
        the next holder of the lane flushes under it too, so nothing is left behind.
        """
        lane = self.lane
        return lane is not None and lane.held_here() and self.reader.buffered > 0

    def write_locked(self, parts: list[Any], fds: list[int]) -> _Unwritten | None:
        """Send what is corked, then ``parts`` (and ``fds``); call under ``lock``.

        Never waits: what the socket does not take at once, and everything while frames
        are queued before it, goes to the peer's writer thread. Returns that queued rest
        (``None``: all written); the caller waits for it, if at all, without the lock.

        ``OSError`` marks the peer gone and shuts the socket down, so that both ends'
        receive loops see the connection end and report each other lost: a frame that
        could not be written must never vanish silently."""
        if self.corked:
            parts = [bytes(self.corked), *parts]
            self.corked.clear()
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        try:
            if not self.backlog:
                fds = _send_now(self.sock, views, fds)
                if not views:
                    return None
            return self._queue(views, fds)
        except OSError:  # (from the socket, or out of descriptors to queue with)
            self._break()
            raise

    def flush_corked(self) -> None:
        """Send the corked replies: the receiving thread is about to wait for input.

        Never waits for the peer to read them (a full socket queues them to the writer):
        the receiving thread goes on reading, so two workers that both stopped reading
        while writing to each other cannot wedge."""
        if self.corked:
            with self.lock:
                if not (self.gone or self.bye_sent):
                    self.write_locked([], [])

    def stop_writer(self) -> None:
        """Let the writer thread end once nothing is queued (close())."""
        with self.lock:
            self.stopping = True
            self.wakeup.notify_all()

    def _queue(self, views: list[memoryview], fds: list[int]) -> _Unwritten:
        unwritten = _Unwritten(views, fds)
        self.backlog.append(unwritten)
        if self.writer is None:
            self.writer = threading.Thread(target=self._write_backlog, name=self.writer_name,
                                           daemon=True)
            self.writer.start()
        self.wakeup.notify()
        return unwritten

    def _write_backlog(self) -> None:
        """The writer thread: write the queued frames in order, as the peer reads them.

        Writes without the lock (senders queue behind meanwhile); a frame stays first in
        ``backlog`` until written, so no sender writes past it. A failed write fails
        every queued frame and breaks the connection, as a failed write in a sender does.
        """
        while True:
            with self.lock:
                while not self.backlog and not self.stopping:
                    self.wakeup.wait()
                if not self.backlog:
                    return
                unwritten = self.backlog[0]
            try:
                _send_all(self.sock, unwritten.data, unwritten.fds)
            except OSError as exc:
                with self.lock:
                    self._break()
                    failed = list(self.backlog)
                    self.backlog.clear()
                for each in failed:
                    each.finish(exc)
                return
            with self.lock:
                self.backlog.popleft()
            unwritten.finish()

    def _break(self) -> None:
        """A write failed: mark the peer gone and end the connection (call under lock)."""
        self.gone = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


class ShmTransport:
    """Moves frames between workers of one host: Unix sockets and shared memory."""

    capabilities: ClassVar[Capabilities] = Capabilities(multi_process=True, multi_host=False)

    def __init__(self) -> None:
        self._ctx: TransportContext | None = None
        self._peers: dict[int, _Peer] = {}
        self._shm_min = ShmRpcBackendOptions.DEFAULT_SHM_MIN_BYTES
        self._max_frame = DEFAULT_MAX_FRAME_BYTES
        self._closing = False
        self._flush_wanted = threading.Event()
        self._flusher_thread: threading.Thread | None = None

    # ------------------------------------------------------------------------ start

    def start(self, ctx: TransportContext) -> None:
        """Check every worker is on this host, connect to each, start receiving."""
        self._ctx = ctx
        self._shm_min = int(getattr(ctx.options, "shm_min_bytes", self._shm_min))
        self._max_frame = int(getattr(ctx.options, "max_frame_bytes", self._max_frame))
        pool_bytes = int(getattr(ctx.options, "shm_pool_bytes",
                                 ShmRpcBackendOptions.DEFAULT_SHM_POOL_BYTES))
        for rank, sock in _connect_mesh(ctx, host_identity()).items():
            freed = functools.partial(self._segment_freed, rank)
            self._peers[rank] = _Peer(sock, SendPool(pool_bytes), ReceivedSegments(freed),
                                      f"rpcx-{ctx.names[ctx.rank]}-send-{ctx.names[rank]}")
        self._flusher_thread = threading.Thread(
            target=self._flusher, name=f"rpcx-{ctx.names[ctx.rank]}-shm-free", daemon=True
        )
        self._flusher_thread.start()
        for rank, peer in self._peers.items():
            name = f"rpcx-{ctx.names[ctx.rank]}-recv-{ctx.names[rank]}"
            if ctx.receive_lane is not None:
                peer.lane = ctx.receive_lane(name, functools.partial(self._receive_loop, rank))
            threading.Thread(
                target=self._receive_loop, args=(rank,), name=name, daemon=True
            ).start()

    # ------------------------------------------------------------------------- send

    def send(self, dst: int, frame: Frame) -> None:
        """Write ``frame`` to ``dst``'s socket; large buffers go through shared memory.

        Returns once the frame is written, or at ``frame.deadline`` with the rest queued
        for the peer's writer thread (a peer that stopped reading cannot hold a call past
        its timeout, nor a sender the peer's lock)."""
        peer = self._peers[dst]
        if not frame.buffers:  # most calls and replies: the head and header, one write
            data = _HEAD.pack(_FRAME, 0, len(frame.header)) + frame.header
            with peer.lock:
                if peer.bye_sent or peer.gone:
                    raise PeerLostError("has shut down")
                if peer.may_cork() and len(peer.corked) + len(data) <= _CORK_BYTES:
                    peer.corked += data
                    return
                try:
                    unwritten = peer.write_locked([data], [])
                except OSError as exc:
                    raise PeerLostError(f"is unreachable: {exc.strerror or exc}") from None
            if unwritten is not None:
                _wait_written(dst, unwritten, frame.deadline)
            return
        buffers = [_as_bytes(b) for b in frame.buffers]
        sizes = [b.numel() for b in buffers]
        count = len(sizes)
        where, ids = bytearray(count), [0] * count
        one_offs: dict[int, int] = {}  # buffer index -> one-off segment's descriptor
        parts: list[Any] = []
        used: dict[int, Segment] = {}  # buffer index -> pooled segment this frame filled
        sent = False
        unwritten = None
        try:
            # Filling segments needs no lock: a segment is this frame's alone until the
            # peer frees it, which it cannot before receiving the frame.
            for index, (buffer, size) in enumerate(zip(buffers, sizes, strict=True)):
                if size < self._shm_min or len(used) + len(one_offs) >= _MAX_FDS:
                    if size:
                        parts.append(_memory(buffer))
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
            with peer.lock:
                if peer.bye_sent or peer.gone:
                    raise PeerLostError("has shut down")
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
                head = (_HEAD.pack(_FRAME, count, len(frame.header))
                        + struct.pack(f"<{count}Q", *sizes) + bytes(where)
                        + struct.pack(f"<{count}I", *ids))
                retired = peer.pool.take_retired() if used or one_offs else None
                if retired:  # ahead of the frame: the peer unmaps before it maps anew
                    head = _ids_message(_RETIRE, retired) + head
                try:
                    unwritten = peer.write_locked([head, frame.header, *parts], fds)
                except OSError as exc:
                    raise PeerLostError(f"is unreachable: {exc.strerror or exc}") from None
                # Sent, or queued with copies of the descriptors: in order either way.
                for segment in used.values():
                    segment.descriptor_sent()
                sent = True
        finally:
            del parts  # views over the tensors' memory: release before the tensors go
            for fd in one_offs.values():  # the receiver holds its own copy of each now
                os.close(fd)
            if not sent:
                peer.pool.release([s.id for s in used.values()])
        if unwritten is not None:
            _wait_written(dst, unwritten, frame.deadline)

    def _segment_freed(self, src: int, segment_id: int) -> None:
        """Tensors over a segment ``src`` filled are gone: let ``src`` fill it again.

        Runs from a finalizer, on whichever thread dropped the last such tensor (often a
        receive loop, or one holding a send lock): so it only queues the id, and the
        transport's flusher thread sends it.
        """
        peer = self._peers.get(src)
        if peer is None or self._closing:
            return
        peer.freed.append(segment_id)
        self._flush_wanted.set()

    def _flusher(self) -> None:
        """Send queued FREE ids, off the threads whose finalizers produced them."""
        while not self._closing:
            self._flush_wanted.wait(_FLUSH_CHECK_S)
            self._flush_wanted.clear()
            for peer in self._peers.values():
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
                peer.write_locked([message], [])

    # ---------------------------------------------------------------------- receive

    def _receive_loop(self, src: int) -> None:
        """Receive and deliver ``src``'s frames, in order, until its goodbye.

        Runs on whichever thread holds the peer's lane: it returns early, leaving the loop
        to that thread, when a request it served moved the role elsewhere.
        """
        ctx = self._ctx
        assert ctx is not None
        peer = self._peers[src]
        lane = peer.lane
        if lane is not None:
            lane.enter()
        try:
            while True:
                frame = self._read_frame(peer)
                if frame is None:
                    self._on_bye(src)
                    break
                if not isinstance(frame, Frame):  # FREE or RETIRE: segment bookkeeping
                    kind, ids = frame
                    if kind == _FREE:
                        peer.pool.release(ids)
                    else:
                        peer.received.retire(ids)
                    continue
                try:
                    ctx.deliver(src, frame)
                except ProtocolError:  # refused above the transport: end the connection
                    raise
                except Exception:
                    log.exception("%s: delivering a frame from rank %d failed",
                                  ctx.names[ctx.rank], src)
                del frame
                if lane is not None and not lane.still_held():
                    return  # a follower receives from here on
        except (EOFError, OSError) as exc:
            self._on_broken(src, exc)
        except Exception as exc:  # a malformed frame: this connection cannot go on
            log.exception("%s: protocol error on the connection from rank %d",
                          ctx.names[ctx.rank], src)
            self._on_broken(src, exc)
        peer.reader.close()
        if lane is not None:
            lane.leave()
        peer.ended.set()

    def _read_frame(self, peer: _Peer) -> Frame | tuple[int, list[int]] | None:
        """The next frame from ``peer``: a frame, (kind, ids) of a FREE or RETIRE, or None
        for BYE."""
        reader, sock = peer.reader, peer.sock
        reader.fill(sock, _HEAD.size)
        kind, count, header_len = _HEAD.unpack(reader.take(_HEAD.size))
        if kind == _BYE:
            return None
        # Checked before anything is read or allocated for it (max_frame_bytes).
        if count > _MAX_BUFFERS:
            raise ProtocolError(f"a frame announcing {count} buffers (at most {_MAX_BUFFERS})")
        if 13 * count + header_len > self._max_frame:
            raise ProtocolError(f"a frame announcing {count} buffers and a header of "
                             f"{header_len} bytes, over max_frame_bytes ({self._max_frame})")
        if kind in (_FREE, _RETIRE):
            reader.fill(sock, 4 * count)
            return kind, list(struct.unpack(f"<{count}I", reader.take(4 * count)))
        if kind == _FRAME and not count:  # no buffers: the header is all there is
            reader.fill(sock, header_len)
            reader.recent.append((0, header_len))
            return Frame(bytes(reader.take(header_len)), [])
        if kind != _FRAME:
            raise ProtocolError(f"unknown frame kind {kind} (count {count}, header {header_len}; "
                             f"frames before: {list(reader.recent)})")
        reader.fill(sock, 13 * count + header_len)
        sizes = struct.unpack(f"<{count}Q", reader.take(8 * count)) if count else ()
        where = bytes(reader.take(count))
        ids = struct.unpack(f"<{count}I", reader.take(4 * count)) if count else ()
        header = bytes(reader.take(header_len))
        reader.recent.append((count, header_len, sizes, where, ids))
        if any(w > _MAPPED_SEGMENT for w in where):
            raise ProtocolError(f"unknown buffer placements {sorted(set(where))}")
        if sum(sizes) + header_len > self._max_frame:
            raise ProtocolError(f"a frame of {sum(sizes) + header_len} bytes, over "
                             f"max_frame_bytes ({self._max_frame})")
        inline = sum(size for size, w in zip(sizes, where, strict=True) if w == _INLINE)
        reader.fill(sock, inline)
        buffers = []
        for size, w, segment_id in zip(sizes, where, ids, strict=True):
            if w == _NEW_SEGMENT:
                fd = reader.fds.popleft()
                try:
                    buffers.append(peer.received.tensor(segment_id, size, fd))
                finally:
                    os.close(fd)
            elif w == _MAPPED_SEGMENT:
                buffers.append(peer.received.tensor(segment_id, size, None))
            elif size:
                buffers.append(torch.frombuffer(bytearray(reader.take(size)), dtype=torch.uint8))
            else:
                buffers.append(torch.empty(0, dtype=torch.uint8))
        return Frame(header, buffers)

    def _on_bye(self, src: int) -> None:
        ctx = self._ctx
        assert ctx is not None
        peer = self._peers[src]
        with peer.lock:
            peer.gone = True
            answer = not peer.bye_sent
        if answer:  # the peer left on its own: let its receive loop for us end too
            self._send_bye(peer, _BYE_TIMEOUT_S)
        if not self._closing:
            ctx.peer_lost(src, "has shut down", LostCause.DEPARTED)

    def _on_broken(self, src: int, exc: BaseException) -> None:
        ctx = self._ctx
        assert ctx is not None
        peer = self._peers[src]
        with peer.lock:
            peer.gone = True
        if self._closing:
            return  # close() shut the socket down after waiting for a goodbye
        cause = LostCause.CONNECTION_LOST
        if isinstance(exc, EOFError | ConnectionResetError):
            reason = "closed its connection (its process probably exited or crashed)"
        elif isinstance(exc, OSError):
            reason = f"{type(exc).__name__}: {exc}"
        else:
            detail = exc if isinstance(exc, ProtocolError) else f"{type(exc).__name__}: {exc}"
            reason = f"protocol error: {detail}"
            cause = LostCause.PROTOCOL_ERROR
            # This end reads no more: let the peer see the connection end too.
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_RDWR)
        ctx.peer_lost(src, f"is unreachable: {reason}", cause)

    # ------------------------------------------------------------------------ close

    def close(self, timeout: float) -> None:
        """Send BYE to every peer, wait (bounded) for theirs, then close the sockets."""
        ctx = self._ctx
        if ctx is None:
            return
        self._closing = True
        self._flush_wanted.set()
        deadline = time.monotonic() + timeout
        for peer in self._peers.values():
            self._send_bye(peer, max(0.0, deadline - time.monotonic()))
        for peer in self._peers.values():
            peer.ended.wait(max(0.0, deadline - time.monotonic()))
        stuck = [ctx.names[r] for r, p in self._peers.items() if not p.ended.is_set()]
        if stuck:
            log.warning("%s: no goodbye from %s within %.1f s; closing anyway",
                        ctx.names[ctx.rank], ", ".join(stuck), timeout)
        for peer in self._peers.values():
            # shutdown() wakes a receive loop blocked in recvmsg (it sees end of file)
            # and a writer thread blocked on a peer that stopped reading (its queued
            # frames fail, and so do the sends still waiting for them).
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_RDWR)
            peer.stop_writer()
        for peer in self._peers.values():
            if peer.writer is not None:
                peer.writer.join(max(0.0, deadline - time.monotonic()))
            peer.sock.close()
            peer.pool.close()
            peer.received.close()
        if self._flusher_thread is not None:
            self._flusher_thread.join(max(0.0, deadline - time.monotonic()))

    def _send_bye(self, peer: _Peer, timeout: float) -> None:
        """Send BYE after every frame sent or queued before it; never waits for the
        socket, and for the send lock (held only briefly) at most ``timeout``."""
        if not peer.lock.acquire(timeout=timeout):
            log.debug("goodbye not sent: the send lock stayed taken")
            return
        try:
            if peer.bye_sent:
                return
            peer.bye_sent = True
            try:
                # A peer that reads nothing gets it queued, behind its other frames;
                # close() shuts the socket down after waiting, which ends the writer.
                peer.write_locked([_HEAD.pack(_BYE, 0, 0)], [])
            except OSError as exc:
                log.debug("goodbye not delivered: %s", exc)
        finally:
            peer.lock.release()


# ------------------------------------------------------------------------------ mesh


def _connect_mesh(ctx: TransportContext, host: str) -> dict[int, socket.socket]:
    """One connected Unix socket per peer; refuses peers on another host than ``host``.

    Every worker listens on a socket file in a private directory and publishes its path
    and host in the store; each connects to the lower ranks and accepts the higher ones.
    """
    limit = ctx.options.rpc_timeout or None
    me = ctx.names[ctx.rank]
    directory = tempfile.mkdtemp(prefix="rpcx-shm-")
    path = os.path.join(directory, "socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(max(1, ctx.world_size))
        ctx.store.set(f"shm/{ctx.rank}", json.dumps({"host": host, "path": path}))
        addresses = {
            rank: json.loads(ctx.store.get(f"shm/{rank}"))
            for rank in range(ctx.world_size) if rank != ctx.rank
        }
        elsewhere = {rank: a["host"] for rank, a in addresses.items() if a["host"] != host}
        if elsewhere:
            others = ", ".join(f"{ctx.names[r]!r} (rank {r}) on {h}" for r, h in elsewhere.items())
            raise RuntimeError(
                f"init_rpc: the shm backend connects workers of one host only: worker {me!r} "
                f"(rank {ctx.rank}) is on {host}, but {others}; use a multi-host backend "
                "such as 'gloo' across hosts"
            )
        sockets: dict[int, socket.socket] = {}
        try:
            for rank in range(ctx.rank):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sockets[rank] = sock
                sock.settimeout(limit)
                sock.connect(addresses[rank]["path"])
                _introduce(sock, ctx, rank)
            listener.settimeout(limit)
            while len(sockets) < ctx.world_size - 1:
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    missing = [ctx.names[r] for r in range(ctx.rank + 1, ctx.world_size)
                               if r not in sockets]
                    raise RpcTimeoutError(
                        f"init_rpc: worker {me!r} (rank {ctx.rank}): no shm connection from "
                        f"{', '.join(missing)} within {limit:g} s (rpc_timeout)"
                    ) from None
                admitted = _admit(conn, ctx, sockets)
                if admitted is None:
                    conn.close()
                else:
                    sockets[admitted] = conn
        except BaseException:
            for sock in sockets.values():
                sock.close()
            raise
        for sock in sockets.values():
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
        return sockets
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.rmdir(directory)


def _introduce(sock: socket.socket, ctx: TransportContext, rank: int) -> None:
    """This worker's side of a connection to ``rank``: its hello and, with a world key,
    a mutual challenge-response (``rank`` proves the key first)."""
    sock.sendall(_HELLO.pack(_MAGIC, ctx.rank))
    if ctx.auth is None:
        return
    challenge = ctx.auth.challenge()
    sock.sendall(challenge)
    answer = _receive_exactly(sock, _NONCE + _PROOF)
    theirs, proof = answer[:_NONCE], answer[_NONCE:]
    if not ctx.auth.check("shm accept", rank, ctx.rank, challenge, proof):
        raise AuthenticationError(
            f"init_rpc: worker {ctx.names[ctx.rank]!r} (rank {ctx.rank}): the shm connection "
            f"to rank {rank} failed authentication (its socket is not that worker's)")
    sock.sendall(ctx.auth.proof("shm connect", ctx.rank, rank, theirs))


def _admit(conn: socket.socket, ctx: TransportContext,
           connected: dict[int, socket.socket]) -> int | None:
    """The rank of a new connection, or ``None`` (logged) for one that is no expected
    worker's or, with a world key, fails the challenge-response."""
    me = ctx.names[ctx.rank]
    # A stray connection that sends nothing must not hold the mesh up for long.
    conn.settimeout(_HANDSHAKE_TIMEOUT)
    try:
        magic, rank = _HELLO.unpack(_receive_exactly(conn, _HELLO.size))
        rank = int(rank)
        if magic != _MAGIC or not ctx.rank < rank < ctx.world_size or rank in connected:
            log.warning("%s: refused an shm connection that is no expected worker's", me)
            return None
        if ctx.auth is not None:
            challenge = ctx.auth.challenge()
            theirs = _receive_exactly(conn, _NONCE)
            conn.sendall(challenge + ctx.auth.proof("shm accept", ctx.rank, rank, theirs))
            proof = _receive_exactly(conn, _PROOF)
            if not ctx.auth.check("shm connect", rank, ctx.rank, challenge, proof):
                log.warning("%s: refused an shm connection claiming to be rank %d: it failed "
                            "authentication", me, rank)
                return None
    except (OSError, EOFError) as exc:
        log.warning("%s: refused an shm connection: %s", me, exc)
        return None
    return rank


def _receive_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise EOFError("connection closed during the shm handshake")
        data += chunk
    return bytes(data)


# ---------------------------------------------------------------------------- memory


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous CPU tensor's memory (no copy)."""
    flat = tensor.reshape(-1)
    return flat if flat.dtype is torch.uint8 else flat.view(torch.uint8)


def _memory(tensor: torch.Tensor) -> memoryview:
    """A memoryview over a flat ``uint8`` tensor's memory, without numpy.

    Valid while the tensor lives; ``send`` holds the tensor until the bytes are written.
    """
    array = (ctypes.c_char * tensor.numel()).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


def _rights(fds: list[int]) -> list[tuple[int, int, bytes]]:
    """The ancillary data that passes ``fds`` (none for no descriptors)."""
    if not fds:
        return []
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"<{len(fds)}i", *fds))]


def _advance(views: list[memoryview], sent: int) -> None:
    """Drop the first ``sent`` bytes of ``views``."""
    while views and sent >= len(views[0]):
        sent -= len(views[0])
        views.pop(0)
    if sent:
        views[0] = views[0][sent:]


def _send_now(sock: socket.socket, views: list[memoryview], fds: list[int]) -> list[int]:
    """Write as much of ``views`` as the socket takes without waiting, the descriptors
    with the first byte; ``views`` keeps what is left. Returns the descriptors not sent
    (all of them if no byte went, else none)."""
    while views:
        try:
            sent = sock.sendmsg(views, _rights(fds), socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        fds = []
        _advance(views, sent)
    return fds


def _send_all(sock: socket.socket, parts: list[Any], fds: list[int]) -> None:
    """``sendmsg`` every part, the descriptors with the first byte; loops on short
    writes, waiting for the peer to read."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views, _rights(fds))
        fds = []
        _advance(views, sent)


def _wait_written(dst: int, unwritten: _Unwritten, deadline: float) -> None:
    """Wait for the writer thread to write a queued frame, until ``deadline`` (a
    request's; 0: no deadline, wait until written or the connection ends)."""
    left = None if not deadline else max(0.0, deadline - time.monotonic())
    if not unwritten.done.wait(left):
        # A peer that reads nothing: the agent fails the call on time, the writer
        # finishes the frame if the peer ever reads again.
        log.debug("send to rank %d still queued at its deadline", dst)
        return
    if unwritten.error is not None:
        error = unwritten.error
        raise PeerLostError(f"is unreachable: {error.strerror or error}")
