"""The gloo backend: frames over torch.distributed ``ProcessGroupGloo`` send/recv.

The process group is private to rpcx, built on rpcx's own rendezvous store, never the
default group, so a program can run ``dist.init_process_group`` for DDP beside it.

Wire format, per frame, on one ordered gloo pair per peer:

* a fixed-size *slot* (tag 0): ``mode, buffer count, body length``, then the body. Small
  frames (most calls) fit entirely in the slot: one gloo message per frame.
* a *split* frame's slot holds the body without the tensor data (buffer sizes, then the
  header); each non-empty tensor follows as its own message (tag 1), sent straight from
  the tensor's memory. The receiver posts every tensor's receive as soon as the slot
  arrives, so large tensors cost one notification round, not two.
* an *extended* frame (a header too large for the slot) sends the body as a message of
  its own (tag 1) after the slot, then the tensors.
* ``BYE`` is the last slot a worker sends a peer. A receiving thread ends only on a BYE or
  a broken connection: gloo offers no way to cancel a pending receive, and a process that
  exits with one pending aborts. So a worker that leaves sends BYE, and a worker that gets
  a BYE it did not expect answers with its own.

One receiving thread per peer keeps per-peer order and lets a large frame from one peer
not hold up the others; it keeps ``RECEIVE_DEPTH`` slot receives posted so gloo can land
frames while it is busy. Sends are posted under a per-peer lock (so the messages of one
frame stay together) and waited for outside it: a gloo send Work only completes when
waited on, and a sender whose peer has no receive posted waits for one (back-pressure).
A frame the peer may not take now is waited for by the peer's writer thread instead,
the caller waiting only until the frame's deadline: one past what the kernel's socket
buffers and the peer's posted slot receives take at once, a call's frame with messages
after its slot (they go only once the peer has read the slot), and any frame behind
one of those. So a peer that stopped reading cannot hold a call past its timeout (gloo
cannot cancel a send, and a timed-out gloo wait aborts every pair).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from rpcx import rendezvous
from rpcx._lanes import ReceiveLane
from rpcx._memory import empty_bytes
from rpcx.errors import (
    LostCause,
    PeerLostError,
    ProtocolError,
    RpcTimeoutError,
    without_cpp_locations,
)
from rpcx.hookspecs import hookimpl
from rpcx.hosts import address_towards
from rpcx.options import DEFAULT_MAX_FRAME_BYTES, TensorPipeRpcBackendOptions
from rpcx.transport import Capabilities, Frame, TransportContext

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
_HEAD = struct.Struct("<BxxxIQ")  # mode, number of buffers, body length
_INLINE, _EXTENDED, _BYE, _SPLIT = 1, 2, 3, 4
_TAG_SLOT, _TAG_DATA = 0, 1
_MAX_BUFFERS = SLOT_BYTES  # a frame's buffer count: its sizes must fit a body
# gloo fails (and closes the pair) when a receive outlasts this, so make it effectively
# infinite: an idle peer is not a dead peer. Dead peers surface as closed connections.
_PAIR_TIMEOUT = timedelta(days=3650)
_BYE_TIMEOUT = timedelta(seconds=10)
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


class _Ring:
    """The slot receives posted for one peer, in posting order, and the slots owed one.

    Posting a receive costs ~15 us. The receiving thread does not re-post after each
    frame; it notes the slot as owed, and the next thread to finish a send to that peer
    (whose frame is then already on its way) posts what is owed. So in a call and its
    reply neither re-post delays the other side. The receiving thread re-posts itself
    only when fewer than half the receives remain posted.
    """

    __slots__ = ("closed", "lock", "owed", "posted")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.posted: collections.deque[tuple[bytearray, torch.Tensor, Any]] = (
            collections.deque()
        )
        self.owed: list[tuple[bytearray, torch.Tensor]] = []
        self.closed = False


class _Peer:
    """Per-peer state: the send lock, the goodbye flags, the receive ring and lane."""

    __slots__ = ("bye_sent", "ended", "gone", "lane", "lock", "ring", "unheard", "writer",
                 "writing")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ring = _Ring()
        self.writing = 0  # frames handed to the writer and not written yet (under lock)
        self.unheard = 0  # bytes sent since the peer last sent a frame (a lower bound on
        # what it may not have read; reset without the lock by the receiving thread)
        self.writer: _Writer | None = None
        self.bye_sent = False
        self.gone = False
        self.lane: ReceiveLane | None = None  # the receive loop's role (rpcx._lanes)
        self.ended = threading.Event()  # the receive loop is over: nothing more arrives


class _Written:
    """One frame's sends, waited for by a writer: done, or the error."""

    __slots__ = ("done", "error", "messages", "works")

    def __init__(self, works: list[Any], messages: list[tuple[int, torch.Tensor]]) -> None:
        self.works = works
        self.messages = messages  # the memory gloo sends from, alive until written
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Writer:
    """A peer's writer thread: waits, in posting order, for frames' sends to complete."""

    def __init__(self, name: str, finished: Callable[[], None]) -> None:
        self._jobs: queue.SimpleQueue[_Written | None] = queue.SimpleQueue()
        self._finished = finished  # called after each frame, on this thread
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def put(self, job: _Written) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                GlooTransport._wait(job.works)
            except BaseException as exc:
                job.error = exc
            job.works = job.messages = []
            job.done.set()
            try:
                self._finished()
            except Exception:  # the writer must outlive it
                log.exception("gloo writer: after a frame")


class GlooTransport:
    """Moves frames over a private gloo process group."""

    capabilities: ClassVar[Capabilities] = Capabilities(multi_process=True, multi_host=True)

    def __init__(self) -> None:
        self._ctx: TransportContext | None = None
        self._pg: Any = None
        self._peers: dict[int, _Peer] = {}
        self._closing = False
        self._max_frame = DEFAULT_MAX_FRAME_BYTES

    # ------------------------------------------------------------------------ start

    def start(self, ctx: TransportContext) -> None:
        """Create the process group (connects the full mesh) and start receiving."""
        self._ctx = ctx
        self._max_frame = int(getattr(ctx.options, "max_frame_bytes", self._max_frame))
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = _PAIR_TIMEOUT
        opts._devices = _devices(ctx)
        self._pg = _connect_mesh(ctx, opts)
        for rank in range(ctx.world_size):
            if rank != ctx.rank:
                self._peers[rank] = _Peer()
        for rank, peer in self._peers.items():
            # The receive loop is a lane: requests are served on the thread that
            # received them, and another thread takes over receiving if one blocks.
            name = f"rpcx-{ctx.names[ctx.rank]}-recv-{ctx.names[rank]}"
            if ctx.receive_lane is not None:
                peer.lane = ctx.receive_lane(name, functools.partial(self._receive_loop, rank))
            threading.Thread(
                target=self._first_receive, args=(rank,), name=name, daemon=True
            ).start()

    # ------------------------------------------------------------------------- send

    def send(self, dst: int, frame: Frame) -> None:
        """Send ``frame`` to ``dst``; returns once gloo has written it, or at the
        frame's deadline.

        Waiting matters twice over: gloo sends straight from the tensors' memory, so the
        caller may change them as soon as this returns (arguments are copies), and a
        gloo send Work only completes when waited on, so no other thread can reap it.
        When the peer may not take the frame now, the peer's writer thread waits for it
        instead (keeping the memory alive) and the sender only until the deadline.
        """
        peer = self._peers[dst]
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
                    slot_tensor[offset : offset + size].copy_(_as_bytes(buffer))
                offset += size
            messages: list[tuple[int, torch.Tensor]] = [(_TAG_SLOT, slot_tensor)]
        else:
            body_len = 8 * n + len(header)
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
                messages = [
                    (_TAG_SLOT, slot_tensor),
                    (_TAG_DATA, torch.frombuffer(body, dtype=torch.uint8)),
                ]
            messages += [
                (_TAG_DATA, _as_bytes(b)) for b, s in zip(frame.buffers, sizes, strict=True) if s
            ]
        # A frame's messages after its slot go only once the peer has read the slot (it
        # posts their receives then): a call's frame (one with a deadline) must not wait
        # for that on the caller's thread.
        works, job = self._post(
            dst, peer, messages, nbytes=sum(t.numel() for _, t in messages),
            hand_off=bool(frame.deadline) and len(messages) > 1,
        )
        if job is None:
            self._wait(works)
            if peer.ring.owed:  # our frame is out: now post the receives this peer is owed
                self._repost(dst, peer.ring)
            return
        left = None if not frame.deadline else frame.deadline - time.monotonic()
        if not job.done.wait(left if left is None else max(0.0, left)):
            # The call's deadline passed with the frame not yet written (a peer that
            # reads nothing): the writer finishes it; the agent fails the call now.
            log.debug("send to rank %d still being written at its deadline", dst)
            return
        if job.error is not None:
            raise job.error

    def _post(
        self, dst: int, peer: _Peer, messages: list[tuple[int, torch.Tensor]],
        bye: bool = False, nbytes: int = 0, hand_off: bool = False,
    ) -> tuple[list[Any], _Written | None]:
        """Post ``messages`` (``nbytes`` on the wire) to ``dst``; the works, and the
        writer's job if the frame went to the peer's writer: when ``hand_off`` asks, the
        peer may not take it whole now (see ``_WAIT_INLINE_BYTES``), or frames before it
        are still there (waiting inline would wait for those too)."""
        # Posting under the peer's lock keeps the messages of one frame together.
        with peer.lock:
            if peer.bye_sent or (peer.gone and not bye):
                raise PeerLostError("has shut down")
            try:
                works = [self._pg.send([tensor], dst, tag) for tag, tensor in messages]
            except RuntimeError as exc:
                raise PeerLostError(f"is unreachable: {_clean(exc)}") from None
            if bye:
                peer.bye_sent = True
            peer.unheard += nbytes
            # (Closing: the writers are stopping, so the last frames are waited for here.)
            if bye or self._closing or not (
                hand_off or peer.writing or peer.unheard > _WAIT_INLINE_BYTES
            ):
                return works, None
            if peer.writer is None:
                ctx = self._ctx
                assert ctx is not None
                peer.writer = _Writer(f"rpcx-{ctx.names[ctx.rank]}-send-{ctx.names[dst]}",
                                      functools.partial(self._written, dst, peer))
            job = _Written(works, messages)
            peer.writing += 1
            peer.writer.put(job)
            return works, job

    def _written(self, dst: int, peer: _Peer) -> None:
        """A writer finished a frame (on its thread)."""
        with peer.lock:
            peer.writing -= 1
        if peer.ring.owed:
            try:
                self._repost(dst, peer.ring)
            except RuntimeError as exc:
                log.debug("receives for rank %d not posted: %s", dst, exc)

    @staticmethod
    def _wait(works: list[Any], timeout: timedelta | None = None) -> None:
        try:
            for work in works:
                if timeout is None:
                    work.wait()
                else:
                    work.wait(timeout)
        except RuntimeError as exc:
            raise PeerLostError(f"is unreachable: {_clean(exc)}") from None

    # ---------------------------------------------------------------------- receive

    def _first_receive(self, src: int) -> None:
        ring = self._peers[src].ring
        with ring.lock:
            for _ in range(RECEIVE_DEPTH):
                slot = bytearray(SLOT_BYTES)
                ring.owed.append((slot, torch.frombuffer(slot, dtype=torch.uint8)))
        try:
            self._repost(src, ring)
        except RuntimeError as exc:
            self._on_broken(src, exc)
            self._end_receiving(src)
            return
        self._receive_loop(src)

    def _receive_loop(self, src: int) -> None:
        """Receive and deliver ``src``'s frames, in order, until its goodbye.

        Runs on whichever thread holds the peer's lane: it returns early, leaving the
        loop to that thread, when a request it served moved the role elsewhere.
        """
        if self._receive_frames(src):
            # Only now, with the loop's frame and the gloo work objects it held gone:
            # close() releases the process group once every loop has ended, and gloo
            # objects outliving their group on another thread abort the process at exit.
            self._end_receiving(src)

    def _receive_frames(self, src: int) -> bool:
        """The loop itself; True when it ended (goodbye or broken), False if handed off."""
        ctx = self._ctx
        assert ctx is not None
        peer = self._peers[src]
        ring, lane = peer.ring, peer.lane
        if lane is not None:
            lane.enter()
        try:
            while True:
                with ring.lock:
                    if not ring.posted:  # cannot happen while the ring is kept half full
                        raise AssertionError("gloo receive ring is empty")
                    slot, slot_tensor, work = ring.posted.popleft()
                work.wait()
                peer.unheard = 0  # it is alive and sending, so reading too
                mode, n, body_len = _HEAD.unpack_from(slot)
                if mode == _BYE:
                    self._on_bye(src)
                    break
                self._check_slot(mode, n, body_len)
                if mode == _INLINE:
                    frame = _unpack_inline(slot, slot_tensor, n, body_len)
                elif mode == _SPLIT:
                    sizes = struct.unpack_from(f"<{n}Q", slot, _HEAD.size)
                    start = _HEAD.size + 8 * n
                    header = bytes(slot[start : _HEAD.size + body_len])
                    self._check_sizes(sizes, len(header))
                    frame = self._receive_buffers(src, header, sizes)
                else:
                    frame = self._receive_extended(src, n, body_len)
                with ring.lock:
                    ring.owed.append((slot, slot_tensor))
                    low = len(ring.posted) < RECEIVE_DEPTH // 2
                if low:
                    self._repost(src, ring)
                try:
                    ctx.deliver(src, frame)
                except ProtocolError:  # refused above the transport: end this peer
                    raise
                except Exception:
                    log.exception("%s: delivering a frame from rank %d failed",
                                  ctx.names[ctx.rank], src)
                del frame
                if lane is not None and not lane.still_held():
                    return False  # a follower receives from here on
        except ProtocolError as exc:  # (an RpcError, so a RuntimeError: caught first)
            log.warning("%s: protocol error from %s: %s", ctx.names[ctx.rank],
                        ctx.names[src], exc)
            self._on_broken(src, exc, protocol=True)
        except RuntimeError as exc:  # gloo's own: the connection broke
            self._on_broken(src, exc)
        except Exception as exc:  # anything else a frame made fail: this peer cannot go on
            log.warning("%s: protocol error from %s: %s", ctx.names[ctx.rank],
                        ctx.names[src], exc)
            self._on_broken(src, exc, protocol=True)
        return True

    def _check_slot(self, mode: int, n: int, body_len: int) -> None:
        """Refuse a slot head that no sender of this format writes, before anything
        is allocated for it."""
        if mode not in (_INLINE, _SPLIT, _EXTENDED):
            raise ProtocolError(f"unknown frame mode {mode}")
        if n > _MAX_BUFFERS or body_len < 8 * n:
            raise ProtocolError(f"{n} buffers in a body of {body_len} bytes")
        if mode != _EXTENDED and _HEAD.size + body_len > SLOT_BYTES:
            raise ProtocolError(f"a body of {body_len} bytes announced inside a slot")
        if body_len > self._max_frame:
            raise ProtocolError(f"a body of {body_len} bytes, over max_frame_bytes "
                                f"({self._max_frame})")

    def _check_sizes(self, sizes: tuple[int, ...], header_len: int) -> None:
        total = sum(sizes) + header_len
        if total > self._max_frame:
            raise ProtocolError(f"a frame of {total} bytes, over max_frame_bytes "
                                f"({self._max_frame})")

    def _end_receiving(self, src: int) -> None:
        peer = self._peers[src]
        ring = peer.ring
        with ring.lock:  # receives still posted are dropped; nothing more will arrive
            ring.closed = True
            ring.posted.clear()
            ring.owed.clear()
        if peer.lane is not None:
            peer.lane.leave()
        peer.ended.set()

    def _repost(self, src: int, ring: _Ring) -> None:
        """Post the slot receives ``ring`` is owed, in order."""
        with ring.lock:
            while ring.owed and not ring.closed:
                slot, slot_tensor = ring.owed.pop()
                work = self._pg.recv([slot_tensor], src, _TAG_SLOT)
                ring.posted.append((slot, slot_tensor, work))

    def _receive_extended(self, src: int, n: int, body_len: int) -> Frame:
        body = bytearray(body_len)
        self._pg.recv([torch.frombuffer(body, dtype=torch.uint8)], src, _TAG_DATA).wait()
        sizes = struct.unpack_from(f"<{n}Q", body, 0)
        self._check_sizes(sizes, body_len - 8 * n)
        return self._receive_buffers(src, bytes(body[8 * n :]), sizes)

    def _receive_buffers(self, src: int, header: bytes, sizes: tuple[int, ...]) -> Frame:
        buffers = [empty_bytes(size) for size in sizes]
        works = [self._pg.recv([b], src, _TAG_DATA) for b in buffers if b.numel()]
        for work in works:
            work.wait()
        return Frame(header, buffers)

    def _on_bye(self, src: int) -> None:
        ctx = self._ctx
        assert ctx is not None
        peer = self._peers[src]
        with peer.lock:
            peer.gone = True
            answer = not peer.bye_sent
        if answer:  # the peer left on its own: let its receiving thread for us finish too
            self._send_bye(src, peer, _BYE_TIMEOUT)
        if not self._closing:
            ctx.peer_lost(src, "has shut down", LostCause.DEPARTED)

    def _on_broken(self, src: int, exc: BaseException, protocol: bool = False) -> None:
        ctx = self._ctx
        assert ctx is not None
        peer = self._peers[src]
        with peer.lock:
            peer.gone = True
        reason = _clean(exc)
        if protocol:
            reason = f"protocol error: {reason}"
        elif "closed by peer" in reason.lower() or "connection reset" in reason.lower():
            reason = "closed its connection (its process probably exited or crashed)"
        ctx.peer_lost(src, f"is unreachable: {reason}",
                      LostCause.PROTOCOL_ERROR if protocol else LostCause.CONNECTION_LOST)

    # ------------------------------------------------------------------------ close

    def close(self, timeout: float) -> None:
        """Send BYE to every peer, wait for theirs, then release the process group."""
        ctx = self._ctx
        if ctx is None:
            return
        self._closing = True
        for peer in self._peers.values():
            if peer.writer is not None:  # (a writer blocked on a silent peer stays)
                peer.writer.stop()
        deadline = time.monotonic() + timeout
        for rank, peer in self._peers.items():
            left = max(0.001, deadline - time.monotonic())
            self._send_bye(rank, peer, timedelta(seconds=left))
        for peer in self._peers.values():
            peer.ended.wait(max(0.0, deadline - time.monotonic()))
        stuck = [ctx.names[r] for r, p in self._peers.items() if not p.ended.is_set()]
        if stuck:
            # Releasing the group now would abort the process; keep it until exit.
            log.warning(
                "%s: no goodbye from %s within %.1f s; their connections stay open",
                ctx.names[ctx.rank], ", ".join(stuck), timeout,
            )
            return
        self._pg = None

    def _send_bye(self, rank: int, peer: _Peer, timeout: timedelta) -> None:
        slot = bytearray(SLOT_BYTES)
        _HEAD.pack_into(slot, 0, _BYE, 0, 0)
        tensor = torch.frombuffer(slot, dtype=torch.uint8)
        try:
            # Bounded: a peer that stopped reading must not hold up leaving.
            works, _ = self._post(rank, peer, [(_TAG_SLOT, tensor)], bye=True)
            self._wait(works, timeout)
        except PeerLostError as exc:
            log.debug("goodbye to rank %d not delivered: %s", rank, exc)


def _connect_mesh(ctx: TransportContext, opts: Any) -> Any:
    """Build the process group, bounded by the join timeout (``rpc_timeout``).

    gloo waits for every peer's address (and connection) with the pair timeout, which
    must be effectively infinite for idle receives; a peer that dies after joining the
    world would leave ``init_rpc`` hanging. So the group is built on a helper thread and
    abandoned (the thread stays blocked in gloo) if it is not connected in time.
    """
    limit = ctx.options.rpc_timeout or None
    built: list[Any] = []
    failed: list[BaseException] = []

    # Its own store connection: a TCPStore client serialises calls, so a wait that gloo
    # leaves blocked would otherwise hold up every later store call of this worker
    # (including the teardown of the failed init).
    try:
        store = ctx.store.clone()  # type: ignore[attr-defined]
        rendezvous.keep_if_file_store(store)  # (destroying a FileStore may freeze)
    except RuntimeError:  # stores that cannot be cloned do not block one another
        store = ctx.store

    def build() -> None:
        try:
            built.append(dist.ProcessGroupGloo(store, ctx.rank, ctx.world_size, opts))
        except BaseException as exc:  # surfaced on the caller's thread below
            failed.append(exc)

    name = ctx.names[ctx.rank]
    thread = threading.Thread(target=build, name=f"rpcx-{name}-gloo-connect", daemon=True)
    thread.start()
    thread.join(limit)
    if failed:
        raise failed[0]
    if not built:
        raise RpcTimeoutError(
            f"init_rpc: worker {name!r} (rank {ctx.rank}) could not connect the gloo mesh "
            f"to its {ctx.world_size - 1} peers within {limit:g} s (rpc_timeout); a peer "
            "probably died after joining the world"
        )
    return built[0]


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


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's memory (no copy)."""
    flat = tensor.reshape(-1)
    return flat if flat.dtype is torch.uint8 else flat.view(torch.uint8)


def _clean(exc: BaseException) -> str:
    """gloo's message without the C++ source location it starts with."""
    return without_cpp_locations(str(exc))


def _devices(ctx: TransportContext) -> list[Any]:
    """gloo's devices: the option's interface, else each of ``$GLOO_SOCKET_IFNAME``
    (comma-separated, as torch reads it), else the option's hostname, else the local
    address that routes to the rendezvous host.

    torch reads ``$GLOO_SOCKET_IFNAME`` only where it builds a process group's options
    itself; rpcx builds them, so it reads the variable here.
    """
    options = ctx.options
    interface = getattr(options, "interface", None)
    if interface:
        return [dist.ProcessGroupGloo.create_device(interface=interface)]
    from_env = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    if from_env:
        return [dist.ProcessGroupGloo.create_device(interface=name) for name in from_env]
    hostname = getattr(options, "hostname", None) or address_towards(ctx.init_method)
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
