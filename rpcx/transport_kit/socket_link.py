"""One peer over a stream socket: its buffered reader, writes that never wait, and the
:class:`SocketLink` that ties them to the peer's lock and writer.

Writes never wait on the socket (``MSG_DONTWAIT``): what a peer's socket does not take at
once goes to the peer's writer (:class:`~rpcx.transport_kit.writer.Backlog`), and a
sender waits for it until its frame's deadline at most. Descriptors (``SCM_RIGHTS``,
Unix sockets) may travel with a frame's first byte.

A large frame may be written in *pieces* (``write_locked``'s ``later``: the backend
frames each piece so that its reader can tell them from whole frames): between two
pieces, a small frame sent meanwhile (``may_pass``) is written ahead of the rest, so a
call beside a bulk transfer waits for about a piece, not for the transfer.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rpcx.transport_kit.links import Link
from rpcx.transport_kit.sentences import lost_error
from rpcx.transport_kit.writer import Backlog, Pending

__all__ = ["MAX_FDS", "MOVED_EVERY", "READ_CHUNK", "Buffer", "SocketLink", "SocketReader",
           "send_all", "send_now"]

log = logging.getLogger("rpcx.transport_kit")

READ_CHUNK = 256 << 10  # bytes asked for per read: many small frames per system call
# A large read says its peer is alive (SocketReader.moved) once per this many bytes: a
# 64 MiB tensor over loopback TCP takes hundreds of reads; 0.4 s apart at 20 Mbit/s.
MOVED_EVERY = 1 << 20
MAX_FDS = 64  # descriptors one read may carry
# Plain ints: testing a flag against the enum member costs ~3 us a read (enum.__and__).
_MSG_CTRUNC = int(socket.MSG_CTRUNC)

Buffer = bytes | bytearray | memoryview


def _nothing() -> None:
    """What a link without a ``progress`` hook runs as a large frame moves."""


# --------------------------------------------------------------------------- reading


class SocketReader:
    """One peer's incoming byte stream, buffered, and the descriptors that came with it.

    Only the thread reading the peer (holding ``link.reading``) uses it. ``fill(n)``
    reads until ``n`` unread bytes are buffered (``EOFError`` at end of file), ``take(n)``
    returns the next ``n`` of them (a view valid until the next ``fill``). Memory follows
    the bytes received, never what a peer merely announced.
    """

    __slots__ = ("before_wait", "buffer", "end", "fds", "moved", "recent", "sock", "start")

    def __init__(self, sock: socket.socket,
                 before_wait: Callable[[], None] | None = None,
                 size: int = READ_CHUNK, moved: Callable[[], None] = _nothing) -> None:
        self.sock = sock
        # ``size`` 0: the placeholder of a link connecting on demand, which never reads
        # (256 KiB zeroed costs page faults; ``fill`` grows a buffer that is full).
        self.buffer = bytearray(size)
        self.start = 0  # first unread byte
        self.end = 0  # one past the last received byte
        self.fds: collections.deque[int] = collections.deque()
        self.recent: collections.deque[Any] = collections.deque(maxlen=3)  # for errors
        self.before_wait = before_wait  # runs before each read that may block
        # Runs after each piece of a large read: the peer is alive, though the frame is
        # not whole yet (the heartbeat counts it as heard from; TransportContext.progress).
        self.moved = moved

    @property
    def buffered(self) -> int:
        """Bytes received and not yet taken."""
        return self.end - self.start

    def fill(self, needed: int, exact: bool = False) -> None:
        """Read until ``needed`` unread bytes are buffered; ``EOFError`` if the peer left.

        ``exact``: read no more than that (the head of a piece: the bytes after it go
        straight into their tensor, not through this buffer)."""
        while self.end - self.start < needed:
            if self.before_wait is not None:
                self.before_wait()
            if len(self.buffer) - self.start < max(needed, READ_CHUNK // 2) and self.start:
                unread = self.end - self.start  # move what is unread to the front
                self.buffer[:unread] = self.buffer[self.start : self.end]
                self.start, self.end = 0, unread
            if self.end == len(self.buffer):  # full: grow by what arrived so far at most
                missing = needed - (self.end - self.start)
                self.buffer.extend(bytes(min(missing, max(READ_CHUNK, len(self.buffer)))))
            stop = self.start + needed if exact else len(self.buffer)
            with memoryview(self.buffer) as whole, whole[self.end : stop] as view:
                count, ancillary, flags, _ = self.sock.recvmsg_into(
                    [view], socket.CMSG_SPACE(MAX_FDS * 4))
            if flags & _MSG_CTRUNC:
                # Descriptors were dropped (this process is out of them, most likely):
                # they pair with frames by order, so the stream cannot go on.
                raise OSError("descriptors lost in transit (MSG_CTRUNC); raise the "
                              "open-file limit (ulimit -n)")
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(data) - len(data) % 4
                    self.fds.extend(struct.unpack(f"<{usable // 4}i", data[:usable]))
            if count == 0:
                raise EOFError
            self.end += count
            if needed > MOVED_EVERY:
                self.moved()

    def take(self, count: int) -> memoryview:
        """The next ``count`` buffered bytes (valid until the next :meth:`fill`)."""
        view = memoryview(self.buffer)[self.start : self.start + count]
        self.start += count
        return view

    def read_into(self, target: memoryview) -> None:
        """Fill ``target`` with the next ``len(target)`` bytes of the stream: what is
        buffered first, the rest received straight into it (a large tensor's bytes are
        not copied through the buffer). ``EOFError`` if the peer left."""
        size = len(target)
        got = min(size, self.end - self.start)
        with memoryview(self.buffer) as whole:
            target[:got] = whole[self.start : self.start + got]
        self.start += got
        said = got  # (where moved() last ran: once per MOVED_EVERY bytes, not per read)
        while got < size:
            if self.before_wait is not None:
                self.before_wait()
            count = self.sock.recv_into(target[got:])
            if count == 0:
                raise EOFError
            got += count
            if got - said >= MOVED_EVERY:
                said = got
                self.moved()

    def close(self) -> None:
        """Close descriptors that arrived but were never used."""
        while self.fds:
            os.close(self.fds.popleft())


# --------------------------------------------------------------------------- writing


class _Unwritten:
    """The rest of a frame the socket did not take at once, for the peer's writer.

    ``data`` is what is left of the piece being written; ``later``, the pieces after it
    (a large frame written in pieces; each is whole on the wire, its own head first).
    While its sender still waits for it, a frame in pieces is ``passable``: small frames
    sent meanwhile may be written between two of its pieces (see ``Backlog.put``).

    It holds views of the sender's own buffers (tensors of 64 MiB are not copied for
    the writer: copying and faulting in the copy cost more than the write) while the
    sender waits for it to be written. A sender that stops waiting first (its deadline
    came) calls :meth:`detach`, which swaps what is still unwritten for copies, under
    ``lock``: the writer writes under it, one non-blocking write at a time, so no write
    reads a buffer after the sender has returned. Descriptors still to travel are
    duplicates (the sender closes its own).
    """

    __slots__ = ("data", "detached", "fds", "later", "lock")

    def __init__(self, views: list[memoryview], fds: Sequence[int],
                 later: collections.deque[list[memoryview]] | None = None) -> None:
        self.data = views
        self.later = later if later is not None else collections.deque()
        self.fds = [os.dup(fd) for fd in fds]
        self.lock = threading.Lock()
        self.detached = False

    @property
    def passable(self) -> bool:
        """Whether a small frame may go between two of its pieces now: pieces are left
        and its sender still waits for it (one that left has returned from ``send``,
        and a frame sent after that must not arrive first)."""
        return bool(self.later) and not self.detached

    def next_piece(self) -> bool:
        """At a boundary (``data`` written): take up the next piece; ``False`` when the
        frame is written whole."""
        if self.data or not self.later:
            return False
        self.data = self.later.popleft()
        return True

    def detach(self) -> None:
        """Copy what is still unwritten: the sender returns and may change its buffers."""
        with self.lock:
            self.detached = True
            self.data = _copied(self.data)
            self.later = collections.deque(_copied(piece) for piece in self.later)

    def release(self) -> None:
        while self.fds:
            os.close(self.fds.pop())


def _copied(views: list[memoryview]) -> list[memoryview]:
    return [v if isinstance(v.obj, bytes) else memoryview(bytes(v)) for v in views]


def _rights(fds: Sequence[int]) -> list[tuple[int, int, bytes]]:
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


def send_now(sock: socket.socket, views: list[memoryview], fds: Sequence[int]) -> Sequence[int]:
    """Write as much of ``views`` as the socket takes without waiting, the descriptors
    with the first byte; ``views`` keeps what is left. Returns the descriptors not sent."""
    while views:
        try:
            sent = sock.sendmsg(views, _rights(fds), socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        fds = ()
        _advance(views, sent)
    return fds


def send_all(sock: socket.socket, views: list[memoryview], fds: Sequence[int]) -> None:
    """Write every byte of ``views`` (and ``fds`` with the first), waiting for the peer."""
    views = list(views)
    while views:
        sent = sock.sendmsg(views, _rights(fds))
        fds = ()
        _advance(views, sent)


class SocketLink(Link):
    """A peer reached over one stream socket: its reader, corked replies, and writer.

    Replies sent on the peer's receiving thread while more of its frames are already
    buffered may be *corked* (:meth:`send`'s ``cork``): held, in order, and written with
    the next frame to the peer or before the receiving thread next waits for input. A
    burst of small calls is then answered in a few writes instead of one each.
    """

    __slots__ = ("attached", "corked", "corked_may_pass", "moved", "reader", "sock")

    def __init__(self, rank: int, name: str, sock: socket.socket | None,
                 writer_name: str, progress: Callable[[int], None] | None = None) -> None:
        super().__init__(rank, name)
        # (TransportContext.progress, for this peer: pieces of large frames moving)
        self.moved: Callable[[], None] = (
            functools.partial(progress, rank) if progress is not None else _nothing)
        # ``sock`` None: a link of an on-demand mesh being connected. Until
        # :meth:`attach` gives it its socket, what is sent queues on the held backlog
        # (a connector thread connects it), and senders do not wait.
        self.attached = threading.Event()
        self.backlog = Backlog(self.lock, self._write_all, writer_name, on_error=self._break)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # (a placeholder)
            self.backlog.hold()
        else:
            self.attached.set()
        self.sock = sock
        self.reader = SocketReader(sock, self.flush_corked,
                                   size=READ_CHUNK if self.attached.is_set() else 0,
                                   moved=self.moved)
        self.corked = bytearray()  # one byte string: a write takes at most 1,024 pieces
        self.corked_may_pass = True  # (every frame corked now was sent ``may_pass``)

    def attach(self, sock: socket.socket) -> None:
        """Give a link being connected its socket (call under ``lock``, before its
        receive loop starts); what queued meanwhile stays queued until
        :meth:`release_queued`."""
        placeholder, self.sock = self.sock, sock
        self.reader = SocketReader(sock, self.flush_corked, moved=self.moved)
        self.attached.set()
        placeholder.close()

    def release_queued(self) -> None:
        """Write what queued while the link was connecting (call under ``lock``, once
        attached): on this thread what the socket takes at once, the rest on the
        writer thread."""
        assert self.backlog is not None
        self.backlog.release(self._write_now)

    def send(self, parts: Sequence[Buffer], fds: Sequence[int] = (), deadline: float = 0.0,
             cork: int = 0, settled: Callable[[], bool] | None = None,
             may_pass: bool = False) -> None:
        """Write one frame's ``parts`` (and ``fds``) in order; returns once written, or at
        ``deadline`` (or once ``settled()``) with the rest queued. ``cork``: at most this
        many bytes may wait corked (see the class); ``may_pass``: a small frame, which
        may go between the pieces of a large one being written (see
        :meth:`write_locked`); ``PeerLostError`` if the peer is gone."""
        with self.lock:
            self.check_open()
            if cork and not fds and self.may_cork():
                size = sum(len(p) for p in parts)
                if len(self.corked) + size <= cork:
                    for part in parts:
                        self.corked += part
                    self.corked_may_pass = self.corked_may_pass and may_pass
                    return
            try:
                pending = self.write_locked(parts, fds, may_pass=may_pass)
            except OSError as exc:
                raise lost_error(exc) from None
        if pending is not None:
            self.wait(pending, deadline, settled)

    def wait(self, pending: Pending, deadline: float,
             settled: Callable[[], bool] | None = None) -> None:
        """Wait for a queued frame until ``deadline`` (0: until written or failed) or
        ``settled()`` (``Frame.settled``); not at all while the link is being connected
        (the frame is copied and queued)."""
        assert self.backlog is not None
        if self.backlog.held:
            pending.wait(-1.0)  # (a deadline already past: the job is detached now)
            return
        if not pending.wait(deadline, settled):
            # A peer that reads nothing: the agent fails the call on time; the writer
            # finishes the frame if the peer ever reads again.
            log.debug("send to %s still queued at its deadline", self.name)

    def may_cork(self) -> bool:
        """May a frame sent now by the calling thread wait for the next write? Yes when
        it holds the peer's lane and more of the peer's frames are buffered (call under
        ``lock``: the next holder of the lane flushes under it too)."""
        lane = self.lane
        return lane is not None and lane.held_here() and self.reader.buffered > 0

    def write_locked(self, parts: Sequence[Buffer], fds: Sequence[int] = (),
                     later: Sequence[Sequence[Buffer]] = (), may_pass: bool = False
                     ) -> Pending | None:
        """Write what is corked, then ``parts`` and the ``later`` pieces of the same
        frame; call under ``lock``. Never waits: the rest goes to the writer
        (everything, while frames are queued before it). Returns that queued rest
        (``None``: all written). ``OSError`` marks the peer gone and shuts the socket
        down, so both ends see the connection end.

        ``later``: the frame's further pieces, each framed by the backend so that its
        reader tells a piece from a frame. A frame sent with ``may_pass`` (small, with no
        descriptors) while one in pieces is being written for a sender still waiting
        goes at the next boundary between two pieces."""
        assert not (later and fds), "a frame in pieces carries no descriptors"
        if self.corked:
            parts = [bytes(self.corked), *parts]
            self.corked.clear()
            may_pass = may_pass and self.corked_may_pass
            self.corked_may_pass = True
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        rest = collections.deque([memoryview(p).cast("B") for p in piece if len(p)]
                                 for piece in later)
        assert self.backlog is not None
        try:
            if not self.backlog:
                fds = send_now(self.sock, views, fds)
                while not views and rest:  # (the next piece, while the socket takes it)
                    views = rest.popleft()
                    send_now(self.sock, views, ())
                if not views:
                    return None
            return self.backlog.put(_Unwritten(views, fds, rest), overtake=may_pass)
        except OSError as exc:  # (from the socket, or out of descriptors to queue with)
            self._break(exc)
            raise

    def flush_corked(self) -> None:
        """Write the corked replies (the receiving thread is about to wait for input);
        never waits for the peer to read them."""
        if self.corked:
            with self.lock:
                if not (self.gone or self.bye_sent):
                    with contextlib.suppress(OSError):
                        # (corked since a large frame began: they may pass it, if
                        # each of them may)
                        self.write_locked([], may_pass=True)

    def shutdown(self) -> None:
        """End the connection both ways: wakes a reader blocked on it (end of file) and
        a writer blocked on a peer that reads nothing (its queued frames fail)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _write_now(self, job: _Unwritten) -> bool:
        # Whether the socket took all of ``job`` at once (a backlog's release). One
        # with descriptors is the writer's: they travel once, with the first byte.
        if job.fds:
            return False
        with job.lock:
            send_now(self.sock, job.data, ())
            while job.next_piece():
                send_now(self.sock, job.data, ())
            return not job.data

    def _write_all(self, job: _Unwritten) -> bool:
        # Non-blocking writes under the job's lock, waiting for room without it (see
        # _Unwritten); shutdown() wakes the wait, and the next write then fails.
        # ``False`` at a boundary between two pieces where small frames wait to pass.
        fds: Sequence[int] = job.fds  # (a frame in pieces has none: called once per job)
        poller: select.poll | None = None
        backlog = self.backlog
        assert backlog is not None
        while True:
            with job.lock:
                fds = send_now(self.sock, job.data, fds)
                if not job.data:
                    if not job.next_piece():
                        return True
                    if backlog.overtaking:
                        return False
                    continue
            if poller is None:
                poller = select.poll()
                poller.register(self.sock, select.POLLOUT)
            poller.poll()

    def _break(self, exc: BaseException) -> None:
        """A write failed (under ``lock``): mark the peer gone, end the connection."""
        self.gone = True
        self.shutdown()
