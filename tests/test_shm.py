"""The shm backend's own behaviour, beyond the conformance kit (test_kit.py)."""

from __future__ import annotations

import dataclasses
import errno
import socket
import struct
import threading
import time
import tracemalloc
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import rpcx
from rpcx.backends import sockets as transport_module
from rpcx.backends.segments import SendPool
from rpcx.backends.socket_mesh import Policy, Route, connect_mesh
from rpcx.backends.socket_options import SocketRpcBackendOptions
from rpcx.backends.sockets import ShmTransport
from rpcx.errors import LostCause, ProtocolError, lost_reason
from rpcx.registry import available_backends
from rpcx.testing.transports import ReceiveLane, current_agent, receive_lane
from rpcx.testing.world import world
from rpcx.transport import Frame, TransportContext
from rpcx.transport_kit import socket_link as kit_sockets

TIMEOUT = 30.0


def shared_mappings() -> int:
    """How many shared-memory segments of this backend this process has mapped now."""
    with open("/proc/self/maps") as maps:
        return sum("memfd:rpcx-shm" in line for line in maps)


def mappings_while_holding(value: torch.Tensor) -> tuple[int, float]:
    """Called remotely: the mappings while the argument is alive, and its sum."""
    return shared_mappings(), float(value.sum())


_kept: list[torch.Tensor] = []


def keep(value: torch.Tensor) -> int:
    """Called remotely: hold on to the argument (its segment stays busy)."""
    _kept.append(value)
    return shared_mappings()


def drop_kept() -> None:
    _kept.clear()


def test_registered_as_a_built_in() -> None:
    spec = available_backends()["shm"]
    assert spec.factory is ShmTransport
    assert spec.options_type is SocketRpcBackendOptions
    assert spec.capabilities.multi_process and not spec.capabilities.multi_host
    assert spec.plugin == "rpcx.backends.sockets"


def test_large_tensor_arrives_in_shared_memory_and_small_one_inline() -> None:
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    small = torch.arange(16, dtype=torch.float32)
    with world("shm", size=2, rpc_timeout=TIMEOUT):
        base = rpcx.rpc_sync("worker1", shared_mappings)
        mapped, total = rpcx.rpc_sync("worker1", mappings_while_holding, args=(big,))
        assert (mapped, total) == (base + 1, float(big.sum()))
        assert rpcx.rpc_sync("worker1", mappings_while_holding, args=(small,)) == (
            base + 1, float(small.sum()))
        # The echo comes back whole, through shared memory both ways.
        echoed = rpcx.rpc_sync("worker1", torch.clone, args=(big,))
        assert torch.equal(echoed, big) and shared_mappings() >= 1


def _mapped_during(calls: int, big: torch.Tensor, held: int) -> list[int]:
    """The callee's mapped segments during each of ``calls`` calls with ``big``.

    After each call, waits until the callee's FREE for it arrived (it holds ``held``
    segments again): otherwise the next call may find its segment still busy and take
    another, depending on how fast the callee's flusher thread ran.
    """
    pool = current_agent()._transport.links[1].pool
    seen = []
    for step in range(calls):
        mapped, total = rpcx.rpc_sync("worker1", mappings_while_holding, args=(big + step,))
        assert total == float((big + step).sum())
        seen.append(mapped)
        assert pool.wait_busy_at_most(held, TIMEOUT), "the callee never freed the segment"
    return seen


def test_freed_segments_are_filled_again_and_held_ones_are_not() -> None:
    big = torch.arange(1 << 20, dtype=torch.float32)
    with world("shm", size=2, rpc_timeout=TIMEOUT):
        base = rpcx.rpc_sync("worker1", shared_mappings)
        # Each call's tensor is freed on the callee after its reply leaves: the next
        # call fills the same segment again.
        seen = _mapped_during(12, big, held=0)
        assert seen == [base + 1] * 12, seen
        # Held by the callee, a segment stays busy: the calls after it use one other.
        assert rpcx.rpc_sync("worker1", keep, args=(big,)) == base + 1
        held = _mapped_during(12, big, held=1)
        assert held == [base + 2] * 12, held
        rpcx.rpc_sync("worker1", drop_kept)
        # Free again, both are reused: no segment more than before.
        after = _mapped_during(12, big, held=0)
        assert max(after) <= base + 2, after


def test_past_the_pool_limit_tensors_go_through_one_off_segments() -> None:
    big = torch.arange(1 << 20, dtype=torch.float32)
    with world("shm", size=2, rpc_timeout=TIMEOUT, shm_pool_bytes=0):
        base = rpcx.rpc_sync("worker1", shared_mappings)
        assert rpcx.rpc_sync("worker1", mappings_while_holding, args=(big,)) == (
            base + 1, float(big.sum()))
        # A one-off segment is unmapped with its tensor.
        assert rpcx.rpc_sync("worker1", shared_mappings) == base


def test_threshold_is_an_option() -> None:
    big = torch.ones(1 << 20, dtype=torch.uint8)
    with world("shm", size=2, rpc_timeout=TIMEOUT, shm_min_bytes=2 << 20):
        base = rpcx.rpc_sync("worker1", shared_mappings)
        assert rpcx.rpc_sync("worker1", mappings_while_holding, args=(big,)) == (
            base, float(1 << 20))


def test_send_pool_reuses_best_fit_and_respects_its_limit() -> None:
    pool = SendPool(limit=4 << 20)
    a = pool.acquire(3 << 20)
    assert a is not None and a.capacity == 3 << 20
    assert pool.acquire(2 << 20) is None  # 3 MiB busy + 2 MiB > 4 MiB
    b = pool.acquire(1 << 20)
    assert b is not None and b.capacity == 1 << 20 and b.id != a.id
    pool.release([a.id, b.id])
    assert pool.acquire(100) is b  # the smallest that fits
    assert pool.acquire(2 << 20) is a
    pool.release([a.id])
    # Too big for what is free, and busy segments (b) leave no room even if the free
    # ones went: nothing is dropped, nothing is made.
    assert pool.acquire((3 << 20) + 1) is None
    assert pool.take_retired() == []
    pool.release([b.id])
    # Now dropping the free ones makes room: smallest first, both retired.
    d = pool.acquire((3 << 20) + 1)
    assert d is not None and d.capacity == 4 << 20
    assert pool.take_retired() == [b.id, a.id] and pool.take_retired() == []
    pool.close()


def test_threshold_and_pool_are_checked() -> None:
    with pytest.raises(ValueError, match="shm_min_bytes"):
        SocketRpcBackendOptions(shm_min_bytes=0).validate()
    with pytest.raises(ValueError, match="shm_pool_bytes"):
        SocketRpcBackendOptions(shm_pool_bytes=-1).validate()


def _context(rank: int, store: Any) -> TransportContext:
    return TransportContext(
        rank=rank, world_size=2, names=["alpha", "beta"], store=store,
        options=SocketRpcBackendOptions(rpc_timeout=TIMEOUT), init_method="file://unused",
        deliver=lambda src, frame: None, peer_lost=lambda rank, cause, detail="": None,
    )


def test_workers_on_different_hosts_are_refused_naming_both() -> None:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=TIMEOUT))
    errors: dict[int, BaseException] = {}

    def join(rank: int, host: str) -> None:
        try:
            sockets, _ = connect_mesh(_context(rank, store), "shm", Policy.SHM,
                                      SocketRpcBackendOptions(), host=host)
            for sock in sockets.values():
                sock.close()
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=join, args=(r, h))
               for r, h in ((0, "hostA/boot"), (1, "hostB/boot"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert set(errors) == {0, 1}
    message = str(errors[0])
    assert "one host only" in message and "'alpha' (rank 0) is on hostA/boot" in message
    assert "'beta' (rank 1) on hostB/boot" in message and "'auto'" in message


def count_of(values: list[torch.Tensor]) -> int:
    """Called remotely: how many tensors arrived, checked one by one."""
    assert all(int(v[0]) == i for i, v in enumerate(values))
    return len(values)


def test_a_frame_of_thousands_of_small_tensors() -> None:
    # One iovec per inline buffer would pass the kernel's limit (1024).
    values = [torch.full((3,), i) for i in range(3000)]
    with world("shm", size=2, rpc_timeout=TIMEOUT):
        assert rpcx.rpc_sync("worker1", count_of, args=(values,)) == 3000
        assert rpcx.rpc_sync("worker1", count_of, args=(values[:5],)) == 5  # still fine


def test_segments_the_sender_drops_are_unmapped_by_the_receiver() -> None:
    # Sizes that keep growing under a pool of 8 MiB: each tensor is too big for the
    # segment before it, which the sender drops to make room. The receiver must unmap
    # it too (RETIRE), or its mappings grow by one per step.
    with world("shm", size=2, rpc_timeout=TIMEOUT, shm_pool_bytes=8 << 20):
        seen = []
        for step in range(8):
            value = torch.ones((1 + step) << 18, dtype=torch.float32)  # 1 to 8 MiB
            mapped, total = rpcx.rpc_sync("worker1", mappings_while_holding, args=(value,))
            assert total == float(value.numel())
            seen.append(mapped)
        # The current segment, one the peer may not have freed yet, and a one-off.
        assert max(seen) <= 3, seen


def test_sends_from_many_threads_on_fresh_segments() -> None:
    # Several threads send large tensors while the callee frees them at once: segments
    # are reused under them and descriptors travel once each; every sum comes back.
    with world("shm", size=2, rpc_timeout=TIMEOUT):
        errors: list[BaseException] = []

        def hammer(seed: int) -> None:
            try:
                for step in range(25):
                    value = torch.full((1 << 18,), float(seed * 100 + step))
                    got = rpcx.rpc_sync("worker1", mappings_while_holding, args=(value,))[1]
                    assert got == float(value.sum()), (seed, step, got)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
        assert not errors, errors[0]
        assert not any(thread.is_alive() for thread in threads)


class _Pair:
    """Two started shm transports in this process: ``a`` (rank 0) calls, ``b`` (rank 1)
    serves each frame on its receive lane through ``serve(frame, lane)``, as the agent
    serves requests there."""

    def __init__(self, serve: Any) -> None:
        self.replies: list[bytes] = []
        self.got_reply = threading.Condition()
        self.lanes: list[ReceiveLane] = []
        store = dist.HashStore()
        store.set_timeout(timedelta(seconds=TIMEOUT))

        def on_reply(src: int, frame: Frame) -> None:
            with self.got_reply:
                self.replies.append(frame.header)
                self.got_reply.notify_all()

        def new_lane(name: str, resume: Any) -> ReceiveLane:
            lane = receive_lane(name, resume)
            self.lanes.append(lane)
            return lane

        self.lost = {0: threading.Event(), 1: threading.Event()}  # by the rank that saw it
        self.a, self.b = ShmTransport(), ShmTransport()
        contexts = [
            dataclasses.replace(_context(0, store), deliver=on_reply,
                                peer_lost=lambda rank, cause, detail="": self.lost[0].set()),
            dataclasses.replace(_context(1, store), receive_lane=new_lane,
                                peer_lost=lambda rank, cause, detail="": self.lost[1].set(),
                                deliver=lambda src, frame: self.lanes[0].serve(serve, frame,
                                                                      self.lanes[0])),
        ]
        starters = [threading.Thread(target=t.start, args=(c,))
                    for t, c in zip((self.a, self.b), contexts, strict=True)]
        for thread in starters:
            thread.start()
        for thread in starters:
            thread.join(TIMEOUT)

    def wait_replies(self, count: int) -> list[bytes]:
        with self.got_reply:
            assert self.got_reply.wait_for(lambda: len(self.replies) >= count, TIMEOUT), \
                self.replies
            return list(self.replies)

    def close(self) -> None:
        closers = [threading.Thread(target=t.close, args=(TIMEOUT,)) for t in (self.a, self.b)]
        for thread in closers:
            thread.start()
        for thread in closers:
            thread.join(TIMEOUT)


def _write_at_once(pair: _Pair, headers: list[bytes]) -> None:
    """Frames with these headers from a to b, in one write (so b reads them at once)."""
    wire = b"".join(transport_module._HEAD.pack(transport_module._FRAME, 0, len(h)) + h
                    for h in headers)
    with pair.a.links[1].lock:
        pair.a.links[1].sock.sendall(wire)


def test_replies_to_a_burst_of_requests_leave_in_one_write(monkeypatch: Any) -> None:
    # b reads 50 requests in one go; the replies it sends while more are buffered wait
    # for the last one: one write for 50 replies, each arriving, in order.
    writes: list[bytes] = []
    real_send_now = kit_sockets.send_now

    def counting_send_now(sock: Any, views: list[memoryview], fds: list[int]) -> list[int]:
        if sock is pair.b.links[0].sock:
            writes.append(b"".join(bytes(v) for v in views))
        return real_send_now(sock, views, fds)

    monkeypatch.setattr(kit_sockets, "send_now", counting_send_now)
    pair = _Pair(lambda frame, lane: pair.b.send(0, Frame(b"re:" + frame.header)))
    try:
        _write_at_once(pair, [str(i).encode() for i in range(50)])
        assert pair.wait_replies(50) == [f"re:{i}".encode() for i in range(50)]
        assert len(writes) == 1 and writes[0].count(b"re:") == 50, writes
        pair.a.send(1, Frame(b"alone"))  # nothing else buffered: it is answered at once
        assert pair.wait_replies(51)[-1] == b"re:alone"
        assert len(writes) == 2 and writes[1].count(b"re:") == 1, writes
    finally:
        pair.close()


def test_more_corked_replies_than_one_write_can_carry_parts() -> None:
    # 3,000 replies of ~20 bytes: 64 KiB of them is over 1,024 pieces, the kernel's
    # limit for one sendmsg. Every reply still arrives, in order.
    pair = _Pair(lambda frame, lane: pair.b.send(0, Frame(b"re:" + frame.header)))
    try:
        _write_at_once(pair, [str(i).encode() for i in range(3000)])
        assert pair.wait_replies(3000) == [f"re:{i}".encode() for i in range(3000)]
    finally:
        pair.close()


def test_a_frame_that_cannot_be_written_ends_the_connection_on_both_sides(
    monkeypatch: Any,
) -> None:
    # A write that fails (here EMSGSIZE) must not lose the frame silently and leave the
    # connection up: both workers report each other lost, so calls fail at once.
    real_send_now = kit_sockets.send_now

    def failing_send_now(sock: Any, views: list[memoryview], fds: list[int]) -> list[int]:
        if sock is pair.b.links[0].sock:
            raise OSError(errno.EMSGSIZE, "Message too long")
        return real_send_now(sock, views, fds)

    monkeypatch.setattr(kit_sockets, "send_now", failing_send_now)
    pair = _Pair(lambda frame, lane: None)
    try:
        with pytest.raises(rpcx.PeerLostError, match="Message too long"):
            pair.b.send(0, Frame(b"reply"))
        assert pair.lost[0].wait(TIMEOUT) and pair.lost[1].wait(TIMEOUT)
        with pytest.raises(rpcx.PeerLostError):
            pair.b.send(0, Frame(b"another"))
    finally:
        pair.close()


@pytest.mark.parametrize(("head", "why"), [
    (transport_module._HEAD.pack(9, 0, 0), "unknown frame kind 9"),
    (transport_module._HEAD.pack(transport_module._FRAME, 0xFFFFFFFF, 16),
     "4294967295 buffers"),
    (transport_module._HEAD.pack(transport_module._FRAME, 0, 0xFFFFFFFF),
     "over max_frame_bytes (16777216)"),
    (transport_module._HEAD.pack(transport_module._FRAME, 1, 0) + struct.pack("<Q", 1 << 62)
     + bytes(5), "over max_frame_bytes"),
    # Frames in pieces (the socket backends' large frames): a piece of no frame, a frame
    # too small to come in pieces (it could never be whole), one in shared memory, and
    # one begun while another is.
    (transport_module._HEAD.pack(transport_module._PIECE, 4, 0) + bytes(4),
     "a piece of 4 bytes, with no frame in pieces begun"),
    (transport_module._HEAD.pack(transport_module._PIECED, 0, 0), "announced in pieces"),
    (transport_module._HEAD.pack(transport_module._PIECED, 1, 0) + struct.pack("<Q", 1 << 20)
     + bytes([1]) + bytes(4), "in pieces with buffers in shared memory"),
    (2 * (transport_module._HEAD.pack(transport_module._PIECED, 1, 0)
          + struct.pack("<Q", 1 << 20) + bytes(5)), "begun before the last one was whole"),
    (transport_module._HEAD.pack(transport_module._PIECED, 1, 0) + struct.pack("<Q", 1 << 20)
     + bytes(5) + transport_module._HEAD.pack(transport_module._PIECE, (1 << 20) + 1, 0),
     "a piece of 1048577 bytes, with 1048576 left"),
])
def test_bytes_that_are_no_frame_end_the_connection_on_both_sides(
    head: bytes, why: str,
) -> None:
    # Refused before anything is allocated for them; both workers report the other lost.
    reasons: list[str] = []
    causes: list[LostCause] = []
    pair = _Pair(lambda frame, lane: None)
    pair.b.max_frame = 16 << 20  # what start() reads from options.max_frame_bytes
    assert pair.b.peers is not None
    pair.b.peers.ctx = pair.b._ctx = dataclasses.replace(  # type: ignore[arg-type]
        pair.b._ctx, peer_lost=lambda rank, cause, detail="": (
            reasons.append(lost_reason(cause, detail)), causes.append(cause),
            pair.lost[1].set()))
    try:
        with pair.a.links[1].lock:
            pair.a.links[1].sock.sendall(head)
        assert pair.lost[1].wait(TIMEOUT) and pair.lost[0].wait(TIMEOUT)
        assert reasons and "protocol error" in reasons[0] and why in reasons[0], reasons
        assert causes == [LostCause.PROTOCOL_ERROR], causes
    finally:
        pair.close()


def test_freed_segment_ids_ride_on_the_next_frame_to_the_peer(monkeypatch: Any) -> None:
    # The flusher would send them only after a minute here: the reply carries them.
    monkeypatch.setattr(transport_module, "_FREE_DELAY_S", 60.0)
    pair = _Pair(lambda frame, lane: None)  # b drops each frame (and its tensor) at once
    try:
        pair.a.send(1, Frame(b"call", [torch.zeros(1 << 20, dtype=torch.uint8)]))
        pool = pair.a.links[1].pool
        assert not pool.wait_busy_at_most(0, 0.0)  # b maps a's segment, a waits for it
        assert pair.b._flush_wanted.wait(TIMEOUT), "b never freed the tensor"
        assert list(pair.b.links[0].freed), "the id left before any frame to a"
        pair.b.send(0, Frame(b"reply", []))
        assert pair.wait_replies(1) == [b"reply"]
        assert pool.wait_busy_at_most(0, 0.0), "the reply came without the freed id"
        assert not pair.b.links[0].freed
    finally:
        pair.close()


def test_a_corked_reply_leaves_when_its_lane_moves_to_another_thread() -> None:
    # Request 1's reply is corked (request 2 is already buffered); request 2's handler
    # gives the lane away and waits for a's receipt of reply 1, which only the new
    # receiving thread can send (it flushes before it waits for input).
    def serve(frame: Frame, lane: ReceiveLane) -> None:
        if frame.header == b"2":
            lane_moved = lane.hand_off()
            assert lane_moved and not lane.held_here()
            assert pair.wait_replies(1) == [b"re:1"]
        pair.b.send(0, Frame(b"re:" + frame.header))

    pair = _Pair(serve)
    try:
        _write_at_once(pair, [b"1", b"2"])
        assert pair.wait_replies(2) == [b"re:1", b"re:2"]
    finally:
        pair.close()


DEADLINE_S = 0.2  # a short call timeout for sends to a peer that reads nothing
SLACK_S = 1.0  # a loaded host's scheduling


class _Stalled:
    """A pair whose ``b`` reads nothing after its first frame until :meth:`release`:
    that frame's handler holds b's receiving thread. Each frame is answered with
    ``re:`` and its number (the header up to ``|``)."""

    def __init__(self) -> None:
        self.released = threading.Event()

        def serve(frame: Frame, lane: ReceiveLane) -> None:
            number = frame.header.split(b"|")[0]
            if number == b"0":
                self.released.wait(TIMEOUT)
            self.pair.b.send(0, Frame(b"re:" + number))

        self.pair = _Pair(serve)
        self.sent = 0

    def send(self, deadline: float = 0.0, payload: bytes = bytes(64 << 10)) -> float:
        """Send the next numbered frame from a to b; how long ``send`` took."""
        frame = Frame(str(self.sent).encode() + b"|" + payload)
        frame.deadline = deadline
        self.sent += 1
        started = time.monotonic()
        self.pair.a.send(1, frame)
        return time.monotonic() - started

    def fill(self) -> None:
        """Send until a frame is queued for a's writer thread (b's socket is full:
        ~130 frames of 64 KiB), each returning by its deadline."""
        peer = self.pair.a.links[1]
        while not peer.backlog:
            assert self.sent < 4096, "the socket never filled"
            took = self.send(time.monotonic() + DEADLINE_S)
            assert took < DEADLINE_S + SLACK_S, took

    def release(self) -> None:
        self.released.set()


def test_sends_to_a_peer_that_reads_nothing_return_by_their_deadline_in_order() -> None:
    # Past the socket's buffer, frames queue for the writer thread: each send returns
    # by its frame's deadline, without holding the peer's lock, and every frame still
    # arrives, in order, once the peer reads again.
    stalled = _Stalled()
    try:
        stalled.fill()
        for _ in range(3):  # queued behind the first: each waits for its deadline only
            took = stalled.send(time.monotonic() + DEADLINE_S)
            assert DEADLINE_S / 2 < took < DEADLINE_S + SLACK_S, took
        assert stalled.pair.a.links[1].lock.acquire(timeout=SLACK_S)  # not held
        stalled.pair.a.links[1].lock.release()
        stalled.release()
        stalled.send()  # no deadline: returns once written, after all the others
        count = stalled.sent
        assert stalled.pair.wait_replies(count) == [b"re:%d" % i for i in range(count)]
        assert not stalled.pair.a.links[1].backlog
    finally:
        stalled.release()
        stalled.pair.close()


def test_close_is_bounded_with_frames_queued_for_a_peer_that_reads_nothing() -> None:
    # A frame without a deadline waits until written, and close() ends that wait: the
    # writer's write fails when close() shuts the socket down, and so does the send.
    stalled = _Stalled()
    failures: list[BaseException] = []

    def send_without_deadline() -> None:
        try:
            stalled.send()
        except rpcx.PeerLostError as exc:
            failures.append(exc)

    try:
        stalled.fill()
        waiting = threading.Thread(target=send_without_deadline)
        waiting.start()
        started = time.monotonic()
        stalled.pair.a.close(DEADLINE_S)
        assert time.monotonic() - started < DEADLINE_S + SLACK_S
        waiting.join(SLACK_S)
        assert not waiting.is_alive() and len(failures) == 1, failures
        backlog = stalled.pair.a.links[1].backlog
        assert backlog is not None
        writer = backlog.writer
        assert writer is not None and not writer.is_alive()
    finally:
        stalled.release()
        stalled.pair.b.close(TIMEOUT)


_FRAME_KINDS = st.sampled_from([transport_module._FRAME, transport_module._FREE,
                                transport_module._RETIRE])


@st.composite
def _wire_bytes(draw: Any) -> bytes:
    """Bytes a peer could write: frame heads with any counts, sizes and placements,
    near-valid frames among them, then anything."""
    count = draw(st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1)))
    header_len = draw(st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1)))
    kind = draw(st.one_of(_FRAME_KINDS, st.integers(0, 255)))
    head = transport_module._HEAD.pack(kind, count, header_len)
    listed = min(count, 4)
    sizes = draw(st.lists(st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1)),
                          min_size=listed, max_size=listed))
    where = draw(st.binary(min_size=listed, max_size=listed))
    ids = draw(st.lists(st.integers(0, 2**32 - 1), min_size=listed, max_size=listed))
    body = (struct.pack(f"<{listed}Q", *sizes) + where
            + struct.pack(f"<{listed}I", *ids) + draw(st.binary(max_size=128)))
    return bytes(head + body + draw(st.binary(max_size=64)))


@settings(max_examples=1500, deadline=None)
@given(wire=_wire_bytes())
def test_any_bytes_read_as_frames_or_end_the_connection_within_bounds(wire: bytes) -> None:
    # The receive loop's reader on bytes of the peer's choosing, then end of file: each
    # read gives a frame, segment bookkeeping, or raises what the loop turns into
    # "closed its connection" (EOFError, OSError) or "protocol error" (ProtocolError,
    # KeyError, IndexError). Never MemoryError, and memory follows the bytes received.
    transport = ShmTransport()
    transport.max_frame = 1 << 30
    ours, theirs = socket.socketpair()
    peer = transport_module._Peer(1, "beta", ours, "rpcx-test-send", Route(True, "test"),
                                  1 << 18, SendPool(1 << 20), lambda peer, segment_id: None)
    try:
        theirs.sendall(wire)
        theirs.shutdown(socket.SHUT_WR)
        tracemalloc.start()
        try:
            for _ in range(len(wire) + 1):
                if transport._read_frame(peer) is None:
                    break
        except (EOFError, OSError, ProtocolError, KeyError, IndexError):
            pass
        finally:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert peak < 4 * len(wire) + 2 * kit_sockets.READ_CHUNK + (1 << 20), peak
    finally:
        peer.reader.close()
        ours.close()
        theirs.close()
