"""The gloo backend's wire format, without gloo: two GlooTransports over a fake group.

The fake process group hands each ``send`` (a copy) to the ``recv`` posted for the same
(source, destination, tag), in order, as gloo pairs do. Tests check the bytes on the
wire against the format in rpcx/backends/gloo.py's docstring, built by hand, so that
encoder and decoder cannot drift together, and that frames of every shape round-trip.
"""

from __future__ import annotations

import queue
import struct
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rpcx.backends import gloo
from rpcx.errors import LostCause, lost_reason
from rpcx.transport import Frame

TIMEOUT = 30.0
INLINE, EXTENDED, BYE, SPLIT = 1, 2, 3, 4
SLOT_TAG, DATA_TAG = 0, 1


class _Sent:
    def wait(self, timeout: Any = None) -> bool:
        return True


class _Received:
    def __init__(self, source: queue.Queue[torch.Tensor], into: torch.Tensor,
                 done: Any = lambda: None) -> None:
        self._source = source
        self._into = into
        self._done = done

    def wait(self, timeout: Any = None) -> bool:
        try:
            data = self._source.get(timeout=TIMEOUT)
        except queue.Empty:
            raise RuntimeError("fake wire: nothing arrived") from None
        assert data.numel() <= self._into.numel(), "a message larger than its receive"
        self._into[: data.numel()].copy_(data)
        self._done()
        return True


class Wire:
    """Every message sent, in order, and one FIFO per (source, destination, tag)."""

    def __init__(self) -> None:
        self.log: list[tuple[int, int, int, bytes]] = []
        self._queues: dict[tuple[int, int, int], queue.Queue[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def fifo(self, key: tuple[int, int, int]) -> queue.Queue[torch.Tensor]:
        with self._lock:
            return self._queues.setdefault(key, queue.Queue())

    def sent(self, src: int) -> list[tuple[int, bytes]]:
        """(tag, bytes) of every message ``src`` sent."""
        return [(tag, data) for s, _, tag, data in self.log if s == src]


class FakeGroup:
    def __init__(self, wire: Wire, rank: int) -> None:
        self.wire = wire
        self.rank = rank
        self.posted_slots = 0  # slot receives posted and not yet landed
        self.most_posted_slots = 0

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Sent:
        (tensor,) = tensors
        assert tensor.dtype is torch.uint8 and tensor.dim() == 1
        copy = tensor.clone()
        with self.wire._lock:
            self.wire.log.append((self.rank, dst, tag, bytes(copy.tolist())))
        self.wire.fifo((self.rank, dst, tag)).put(copy)
        return _Sent()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Received:
        (tensor,) = tensors
        if tag != SLOT_TAG:
            return _Received(self.wire.fifo((src, self.rank, tag)), tensor)
        with self.wire._lock:
            self.posted_slots += 1
            self.most_posted_slots = max(self.most_posted_slots, self.posted_slots)
        return _Received(self.wire.fifo((src, self.rank, tag)), tensor, self._slot_landed)

    def _slot_landed(self) -> None:
        with self.wire._lock:
            self.posted_slots -= 1


class End:
    """One side: a GlooTransport on the fake group, with what it delivered and lost."""

    def __init__(self, wire: Wire, rank: int, depth: int = gloo.RECEIVE_DEPTH) -> None:
        self.delivered: queue.Queue[tuple[int, Frame]] = queue.Queue()
        self.lost: queue.Queue[tuple[int, str]] = queue.Queue()
        self.causes: list[LostCause] = []
        self.transport = gloo.GlooTransport()
        ctx = SimpleNamespace(
            rank=rank, world_size=2, names=["w0", "w1"], receive_lane=None,
            options=gloo.GlooRpcBackendOptions(),
            deliver=lambda src, frame: self.delivered.put((src, frame)),
            peer_lost=lambda peer, cause, detail: (self.causes.append(cause),
                                                   self.lost.put((peer, lost_reason(cause,
                                                                                    detail)))),
        )
        peer = 1 - rank
        self.group = FakeGroup(wire, rank)
        self.transport.begin(ctx, {  # type: ignore[arg-type]
            peer: gloo._Link(peer, f"w{peer}", self.group, peer, depth)})
        (self.receiver,) = [t for t in threading.enumerate()
                            if t.name == f"rpcx-w{rank}-recv-w{1 - rank}" and t.is_alive()]

    def next_frame(self) -> Frame:
        _, frame = self.delivered.get(timeout=TIMEOUT)
        return frame


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Wire, End, End]]:
    """Two ends over a fake wire; ``indirect`` parametrization sets their ring depth."""
    wire = Wire()
    depth = getattr(request, "param", gloo.RECEIVE_DEPTH)
    a, b = End(wire, 0, depth), End(wire, 1, depth)
    yield wire, a, b
    a.transport.close(TIMEOUT)
    for end in (a, b):
        for peer in end.transport.links.values():
            assert peer.ended.wait(TIMEOUT), "the receive loop did not end after goodbye"
        end.receiver.join(TIMEOUT)
        assert not end.receiver.is_alive()


def _bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).tolist()) if flat.numel() else b""


def _same(frame: Frame, header: bytes, buffers: list[torch.Tensor]) -> bool:
    return frame.header == header and [_bytes(b) for b in frame.buffers] == [
        _bytes(b) for b in buffers
    ]


BUFFERS = [
    torch.tensor([1, 2, 3], dtype=torch.int32),
    torch.empty(0, dtype=torch.float64),
    torch.tensor([True, False]),
]


def test_small_frame_is_one_slot_laid_out_as_documented(pair: tuple[Wire, End, End]) -> None:
    wire, a, b = pair
    header = b"header bytes"
    a.transport.send(1, Frame(header, BUFFERS))
    assert _same(b.next_frame(), header, BUFFERS)
    ((tag, slot),) = wire.sent(0)
    sizes = [12, 0, 2]
    expected = (
        struct.pack("<BxxxIQ", INLINE, 3, 8 * 3 + len(header) + sum(sizes))
        + struct.pack("<3Q", *sizes) + header
        + struct.pack("<3i", 1, 2, 3) + b"\x01\x00"
    )
    assert tag == SLOT_TAG and len(slot) == gloo.SLOT_BYTES
    assert slot[: len(expected)] == expected


def test_decoding_a_slot_built_by_hand() -> None:
    header = b"\x00\xffhdr"
    payload = [b"abcd", b"", b"xyz"]
    body = struct.pack("<3Q", 4, 0, 3) + header + b"".join(payload)
    slot = bytearray(gloo.SLOT_BYTES)
    slot[: 16 + len(body)] = struct.pack("<BxxxIQ", INLINE, 3, len(body)) + body
    mode, n, body_len = gloo._HEAD.unpack_from(slot)
    assert (mode, n, body_len) == (INLINE, 3, len(body))
    frame = gloo._unpack_inline(slot, torch.frombuffer(slot, dtype=torch.uint8), n, body_len)
    assert frame.header == header
    assert [_bytes(b) for b in frame.buffers] == payload


def test_large_frame_is_a_slot_with_the_body_then_each_non_empty_buffer(
    pair: tuple[Wire, End, End],
) -> None:
    wire, a, b = pair
    header = b"h" * 40
    big = torch.arange(2000, dtype=torch.float32)  # 8000 bytes: more than a slot
    buffers = [big, torch.empty(0), torch.tensor([7], dtype=torch.int64)]
    a.transport.send(1, Frame(header, buffers))
    assert _same(b.next_frame(), header, buffers)
    sent = wire.sent(0)
    assert [tag for tag, _ in sent] == [SLOT_TAG, DATA_TAG, DATA_TAG]
    body = struct.pack("<3Q", 8000, 0, 8) + header
    assert sent[0][1][: 16 + len(body)] == struct.pack("<BxxxIQ", SPLIT, 3, len(body)) + body
    assert sent[1][1] == _bytes(big) and sent[2][1] == struct.pack("<q", 7)


def test_a_header_too_large_for_the_slot_travels_as_its_own_message(
    pair: tuple[Wire, End, End],
) -> None:
    wire, a, b = pair
    header = b"H" * gloo.SLOT_BYTES
    buffers = [torch.tensor([5], dtype=torch.int64)]
    a.transport.send(1, Frame(header, buffers))
    assert _same(b.next_frame(), header, buffers)
    sent = wire.sent(0)
    assert [tag for tag, _ in sent] == [SLOT_TAG, DATA_TAG, DATA_TAG]
    body = struct.pack("<1Q", 8) + header
    assert sent[0][1][:16] == struct.pack("<BxxxIQ", EXTENDED, 1, len(body))
    assert sent[1][1] == body and sent[2][1] == struct.pack("<q", 5)


def test_the_slot_boundary(pair: tuple[Wire, End, End]) -> None:
    wire, a, b = pair
    header = b"x" * 8
    room = gloo.SLOT_BYTES - 16 - 8 - len(header)  # one buffer fills the slot exactly
    fits = torch.ones(room, dtype=torch.uint8)
    too_big = torch.ones(room + 1, dtype=torch.uint8)
    a.transport.send(1, Frame(header, [fits]))
    a.transport.send(1, Frame(header, [too_big]))
    assert _same(b.next_frame(), header, [fits])
    assert _same(b.next_frame(), header, [too_big])
    modes = [data[0] for tag, data in wire.sent(0) if tag == SLOT_TAG]
    assert modes == [INLINE, SPLIT]


@pytest.mark.parametrize("pair", [gloo.RECEIVE_DEPTH, gloo.ring_depth(64)], indirect=True,
                         ids=["full-ring", "ring-of-a-64-worker-world"])
def test_frames_arrive_whole_and_in_order_both_ways(pair: tuple[Wire, End, End]) -> None:
    _, a, b = pair
    depth = a.transport.links[1].depth
    frames = []
    for i in range(3 * gloo.RECEIVE_DEPTH):  # more than the receives posted at once
        size = [0, 10, 5000][i % 3]
        payload = torch.full((size,), i % 256, dtype=torch.uint8)
        frames.append(Frame(f"frame {i}".encode(), [payload]))
    senders = [threading.Thread(target=lambda: [a.transport.send(1, f) for f in frames]),
               threading.Thread(target=lambda: [b.transport.send(0, f) for f in frames])]
    for thread in senders:
        thread.start()
    for end in (b, a):
        for frame in frames:
            assert _same(end.next_frame(), frame.header, frame.buffers)
    for thread in senders:
        thread.join(TIMEOUT)
        assert not thread.is_alive()
    for end in (a, b):  # the ring never grew past its depth
        assert 0 < end.group.most_posted_slots <= depth


def test_a_large_static_world_posts_fewer_receives_per_peer() -> None:
    # 64 workers posting the full ring for 63 peers spent 8-17 s of start-up posting.
    assert [gloo.ring_depth(n) for n in (2, 9, 16, 32, 64, 1000)] == [64, 64, 34, 16, 8, 8]
    # A sender waits on its own thread only for bytes that fit in fewer slots than its
    # peer keeps posted (half the ring), so a peer that stops reading cannot hold it.
    for depth in range(8, gloo.RECEIVE_DEPTH + 1):
        limit = gloo.inline_limit(depth)
        assert 0 < limit // gloo.SLOT_BYTES < depth // 2, depth
    assert gloo.inline_limit(gloo.RECEIVE_DEPTH) == 96 << 10  # two workers: as before


def test_goodbye_ends_both_receivers_and_reports_the_peer_gone(
    pair: tuple[Wire, End, End],
) -> None:
    wire, a, b = pair
    a.transport.close(TIMEOUT)
    assert b.lost.get(timeout=TIMEOUT) == (0, "has shut down")
    assert b.causes == [LostCause.DEPARTED]
    assert a.lost.empty()  # the one that left expects the answer, it is not a loss
    last = {src: [d for tag, d in wire.sent(src) if tag == SLOT_TAG][-1] for src in (0, 1)}
    assert last[0][:16] == last[1][:16] == struct.pack("<BxxxIQ", BYE, 0, 0)
    with pytest.raises(gloo.PeerLostError):
        a.transport.send(1, Frame(b"after goodbye", []))


def _inject_slot(wire: Wire, head: bytes, rest: bytes = b"") -> None:
    """A slot from rank 0 to rank 1 that rank 0's transport never wrote."""
    slot = bytearray(gloo.SLOT_BYTES)
    slot[: len(head) + len(rest)] = head + rest
    wire.fifo((0, 1, SLOT_TAG)).put(torch.frombuffer(slot, dtype=torch.uint8))


@pytest.mark.parametrize(("head", "rest", "why"), [
    (struct.pack("<BxxxIQ", 9, 0, 0), b"", "unknown frame mode 9"),
    (struct.pack("<BxxxIQ", INLINE, 0, gloo.SLOT_BYTES), b"", "announced inside a slot"),
    (struct.pack("<BxxxIQ", INLINE, 2, 16), struct.pack("<2Q", 1 << 40, 4),
     "buffers of 1099511627780 bytes in a body of 16"),
    (struct.pack("<BxxxIQ", INLINE, 5000, 1 << 20), b"", "5000 buffers"),
    (struct.pack("<BxxxIQ", EXTENDED, 1, 1 << 62), b"", "over max_frame_bytes"),
    (struct.pack("<BxxxIQ", SPLIT, 1, 8), struct.pack("<Q", 1 << 62), "over max_frame_bytes"),
])
def test_bytes_that_are_no_frame_end_the_peer_with_a_protocol_error(
    pair: tuple[Wire, End, End], head: bytes, rest: bytes, why: str,
) -> None:
    # Before anything is allocated for them (2^62 bytes raised MemoryError in the
    # receiving thread, which died without reporting the peer: calls then timed out).
    wire, _, b = pair
    _inject_slot(wire, head, rest)
    peer, reason = b.lost.get(timeout=TIMEOUT)
    assert peer == 0 and reason.startswith("is unreachable: protocol error:"), reason
    assert why in reason, reason
    assert b.causes == [LostCause.PROTOCOL_ERROR]
    assert b.transport.links[0].ended.wait(TIMEOUT)
    with pytest.raises(gloo.PeerLostError):
        b.transport.send(0, Frame(b"to a peer that broke the protocol", []))
    # b no longer receives from a, so it cannot answer a's goodbye: say goodbye for it.
    bye = bytearray(gloo.SLOT_BYTES)
    bye[:16] = struct.pack("<BxxxIQ", BYE, 0, 0)
    wire.fifo((1, 0, SLOT_TAG)).put(torch.frombuffer(bye, dtype=torch.uint8))


def test_a_frame_over_max_frame_bytes_is_refused(pair: tuple[Wire, End, End]) -> None:
    wire, a, b = pair
    b.transport.max_frame = 1 << 20  # what start() reads from options.max_frame_bytes
    a.transport.send(1, Frame(b"small", [torch.ones(256, dtype=torch.uint8)]))
    assert b.next_frame().header == b"small"
    a.transport.send(1, Frame(b"big", [torch.ones(2 << 20, dtype=torch.uint8)]))
    peer, reason = b.lost.get(timeout=TIMEOUT)
    assert peer == 0, peer
    assert "protocol error" in reason and "over max_frame_bytes (1048576)" in reason, reason
    assert b.delivered.empty()
    bye = bytearray(gloo.SLOT_BYTES)
    bye[:16] = struct.pack("<BxxxIQ", BYE, 0, 0)
    wire.fifo((1, 0, SLOT_TAG)).put(torch.frombuffer(bye, dtype=torch.uint8))


@settings(max_examples=3000, deadline=None)
@given(
    mode=st.one_of(st.sampled_from([INLINE, EXTENDED, SPLIT]), st.integers(0, 255)),
    n=st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)),
    body_len=st.one_of(st.integers(0, gloo.SLOT_BYTES), st.integers(0, 2**64 - 1)),
    rest=st.binary(max_size=256),
)
def test_any_slot_is_a_frame_within_bounds_or_a_protocol_error(
    mode: int, n: int, body_len: int, rest: bytes
) -> None:
    # What the receiving thread does with a slot before posting any receive for it:
    # either a ProtocolError, or sizes it may act on (inline frames within the slot,
    # others within max_frame_bytes). Never MemoryError, never an allocation by a size
    # the peer merely announced.
    transport = gloo.GlooTransport()
    transport.max_frame = 1 << 30
    slot = bytearray(gloo.SLOT_BYTES)
    head = struct.pack("<BxxxIQ", mode, n, body_len) + rest
    slot[: len(head)] = head
    try:
        transport._check_slot(mode, n, body_len)
        if mode == INLINE:
            frame = gloo._unpack_inline(slot, torch.frombuffer(slot, dtype=torch.uint8),
                                        n, body_len)
            assert frame.nbytes <= gloo.SLOT_BYTES
        elif mode == SPLIT:
            sizes = struct.unpack_from(f"<{n}Q", slot, 16)
            transport._check_sizes(sizes, body_len - 8 * n)
            assert sum(sizes) <= transport.max_frame
        else:
            assert mode == EXTENDED and body_len <= transport.max_frame
    except gloo.ProtocolError:
        pass
