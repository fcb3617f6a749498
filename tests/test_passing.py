"""Small frames passing a large one: the kit's Backlog lets a small job go between two
pieces of a large one whose sender still waits for it, and the socket backends write
large frames in pieces, so a call beside a bulk transfer does not wait for all of it.
Per-peer order as the transport contract states it holds throughout: no frame passes
one whose ``send`` had returned before it began."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rpcx.backends import sockets as socket_backend
from rpcx.backends.socket_options import SocketRpcBackendOptions
from rpcx.backends.sockets import TcpTransport
from rpcx.errors import PeerLostError
from rpcx.transport import Frame, TransportContext
from rpcx.transport_kit import Backlog

BOUND = 10.0  # seconds: every wait here ends long before; a hang fails, it never stalls


# ----------------------------------------------------------------------- the Backlog


class Pieces:
    """A large job written one piece per step; ``passable`` as its sender would say."""

    def __init__(self, name: str, count: int, passable: bool = True) -> None:
        self.name = name
        self.left = list(range(count))
        self.passable = passable


class PiecedWire:
    """A connection that lets one write step through per ``step()`` call, writing one
    piece of a :class:`Pieces` job (or a whole small job) each time."""

    def __init__(self) -> None:
        self.written: list[str] = []
        self.steps = threading.Semaphore(0)
        self.waiting = threading.Semaphore(0)  # released as each step begins
        self.fail: BaseException | None = None
        self.backlog: Backlog | None = None

    def write(self, job: Any) -> bool:
        while True:
            self.waiting.release()
            if not self.steps.acquire(timeout=BOUND):
                raise AssertionError("the test never let the write through")
            if self.fail is not None:
                raise self.fail
            if not isinstance(job, Pieces):
                self.written.append(job)
                return True
            self.written.append(f"{job.name}{job.left.pop(0)}")
            if not job.left:
                return True
            assert self.backlog is not None
            if self.backlog.overtaking:
                return False

    def step(self, count: int = 1) -> None:
        for _ in range(count):
            self.steps.release()

    def wait_for_step(self) -> None:
        assert self.waiting.acquire(timeout=BOUND), "the writer never began a step"


@pytest.fixture(name="wire")
def wire_fixture() -> Iterator[PiecedWire]:
    wire = PiecedWire()
    wire.backlog = Backlog(threading.Lock(), wire.write, "rpcx-test-writer")
    yield wire
    wire.step(100)  # (let whatever is left go, so the writer ends)
    wire.backlog.stop()
    wire.backlog.join(BOUND)


def _put(wire: PiecedWire, job: Any, overtake: bool = False) -> Any:
    assert wire.backlog is not None
    with wire.backlog.lock:
        return wire.backlog.put(job, overtake=overtake)


def _done(*pendings: Any) -> None:
    for pending in pendings:
        assert pending.wait(time.monotonic() + BOUND)


def test_a_small_job_goes_at_the_next_boundary_of_a_large_one(wire: PiecedWire) -> None:
    large = _put(wire, Pieces("J", 3))
    wire.wait_for_step()  # the writer is in the large job's first piece
    small = _put(wire, "s", overtake=True)
    wire.step(4)
    _done(large, small)
    assert wire.written == ["J0", "s", "J1", "J2"]


def test_small_jobs_pass_in_the_order_they_were_put(wire: PiecedWire) -> None:
    large = _put(wire, Pieces("J", 2))
    wire.wait_for_step()
    smalls = [_put(wire, name, overtake=True) for name in ("a", "b", "c")]
    wire.step(5)
    _done(large, *smalls)
    assert wire.written == ["J0", "a", "b", "c", "J1"]


def test_a_job_whose_sender_stopped_waiting_is_not_passed(wire: PiecedWire) -> None:
    # Its send returned: a frame sent after that must arrive after it.
    large = _put(wire, Pieces("J", 3, passable=False))
    wire.wait_for_step()
    small = _put(wire, "s", overtake=True)
    wire.step(4)
    _done(large, small)
    assert wire.written == ["J0", "J1", "J2", "s"]


def test_nothing_passes_while_another_job_waits_behind_the_large_one(
        wire: PiecedWire) -> None:
    large = _put(wire, Pieces("J", 2))
    wire.wait_for_step()
    queued = _put(wire, "k")
    small = _put(wire, "s", overtake=True)
    wire.step(4)
    _done(large, queued, small)
    assert wire.written == ["J0", "J1", "k", "s"]


def test_a_stream_of_small_jobs_does_not_hold_a_large_one_back(wire: PiecedWire) -> None:
    # At a boundary only the small jobs already waiting go: one put while they are
    # written waits for the next boundary.
    large = _put(wire, Pieces("J", 3))
    wire.wait_for_step()
    first = _put(wire, "s1", overtake=True)
    wire.step()  # J0; then s1's write begins
    wire.wait_for_step()
    second = _put(wire, "s2", overtake=True)
    wire.step(4)
    _done(large, first, second)
    assert wire.written == ["J0", "s1", "J1", "s2", "J2"]


def test_a_small_job_with_nothing_to_pass_is_written_as_any_other(wire: PiecedWire) -> None:
    small = _put(wire, "s", overtake=True)
    wire.step()
    _done(small)
    assert wire.written == ["s"]


def test_a_failed_write_fails_the_jobs_waiting_to_pass_too(wire: PiecedWire) -> None:
    large = _put(wire, Pieces("J", 3))
    wire.wait_for_step()
    small = _put(wire, "s", overtake=True)
    wire.fail = ConnectionResetError(104, "Connection reset by peer")
    wire.step(4)
    for pending in (large, small):
        with pytest.raises(PeerLostError, match="Connection reset by peer"):
            pending.wait(time.monotonic() + BOUND)
    assert wire.written == []


# ----------------------------------------------------------- the socket backends' wire


class _TcpPair:
    """Two started tcp transports in this process: ``a`` (rank 0) sends, and every
    frame ``b`` receives goes to ``arrived`` after ``hold`` (blocking there stops b
    reading, as a busy peer would)."""

    def __init__(self, hold: Callable[[Frame], object] = lambda frame: None) -> None:
        self.arrived: list[Frame] = []
        self.changed = threading.Condition()
        store = dist.HashStore()
        store.set_timeout(timedelta(seconds=BOUND))

        def deliver(src: int, frame: Frame) -> None:
            hold(frame)
            with self.changed:
                self.arrived.append(frame)
                self.changed.notify_all()

        def context(rank: int) -> TransportContext:
            return TransportContext(
                rank=rank, world_size=2, names=["alpha", "beta"], store=store,
                options=SocketRpcBackendOptions(rpc_timeout=BOUND),
                init_method="tcp://127.0.0.1:1",
                deliver=deliver if rank else (lambda src, frame: None),
                peer_lost=lambda rank, cause, detail="": None)

        self.a, self.b = TcpTransport(), TcpTransport()
        _all(lambda t, c: t.start(c), [(self.a, context(0)), (self.b, context(1))])

    def headers(self, count: int) -> list[bytes]:
        """The headers of the first ``count`` frames b received, waiting for them."""
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.arrived) >= count, BOUND), \
                [f.header for f in self.arrived]
            return [f.header for f in self.arrived]

    def close(self) -> None:
        _all(lambda t: t.close(BOUND), [(self.a,), (self.b,)])


def _all(run: Callable[..., None], calls: list[tuple[Any, ...]]) -> None:
    """``run(*args)`` for each in ``calls``, on threads of their own, all at once."""
    errors: list[BaseException] = []

    def one(*args: Any) -> None:
        try:
            run(*args)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=args) for args in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND)
    assert not errors, errors[0]
    assert not any(thread.is_alive() for thread in threads)


LARGE = 64 << 20  # more than both ends' socket buffers hold: the rest waits for b


def _large(fill: int) -> torch.Tensor:
    return torch.full((LARGE,), fill, dtype=torch.uint8)


def _backlog(pair: _TcpPair) -> Backlog:
    backlog = pair.a.link(1).backlog
    assert backlog is not None
    return backlog


def _wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, "the condition never came"
        threading.Event().wait(0.01)


@pytest.fixture(name="held_pair")
def held_pair_fixture() -> Iterator[tuple[_TcpPair, threading.Event]]:
    """A pair whose b holds its first frame (``gate``) until the test sets the event."""
    gate = threading.Event()
    pair = _TcpPair(lambda frame: frame.header != b"gate" or gate.wait(BOUND) or None)
    yield pair, gate
    gate.set()
    pair.close()


def test_a_small_frame_passes_a_large_one_whose_sender_still_waits(
        held_pair: tuple[_TcpPair, threading.Event]) -> None:
    pair, gate = held_pair
    pair.a.send(1, Frame(b"gate"))
    sender = threading.Thread(target=pair.a.send, args=(1, Frame(b"large", [_large(7)])))
    sender.start()
    # The large frame fills both ends' buffers; the rest is queued, its sender waiting.
    _wait_until(lambda: len(_backlog(pair)) == 1)
    small = threading.Thread(target=pair.a.send,
                             args=(1, Frame(b"small", [torch.arange(4)], may_pass=True)))
    small.start()
    _wait_until(lambda: _backlog(pair).overtaking == 1)
    gate.set()
    assert pair.headers(3) == [b"gate", b"small", b"large"]
    for thread in (sender, small):
        thread.join(BOUND)
        assert not thread.is_alive()
    large = pair.arrived[2].buffers[0]
    assert large.numel() == LARGE and bool((large == 7).all())
    assert torch.equal(pair.arrived[1].buffers[0].view(torch.int64), torch.arange(4))


def test_a_frame_sent_after_a_large_send_returned_arrives_after_it(
        held_pair: tuple[_TcpPair, threading.Event]) -> None:
    pair, gate = held_pair
    pair.a.send(1, Frame(b"gate"))
    # Its send returns at its deadline, the rest still queued: order binds now.
    pair.a.send(1, Frame(b"large", [_large(3)], deadline=time.monotonic() + 0.2))
    assert len(_backlog(pair)) == 1
    pair.a.send(1, Frame(b"small", deadline=time.monotonic() + 0.2, may_pass=True))
    assert _backlog(pair).overtaking == 0 and len(_backlog(pair)) == 2
    gate.set()
    assert pair.headers(3) == [b"gate", b"large", b"small"]
    assert bool((pair.arrived[1].buffers[0] == 3).all())


def test_a_frame_the_agent_did_not_mark_keeps_its_order(
        held_pair: tuple[_TcpPair, threading.Event]) -> None:
    # Bookkeeping (an acknowledgement that covers the notes sent before it, say) is not
    # marked may_pass: it waits behind the large frame even while that one's sender
    # still waits.
    pair, gate = held_pair
    pair.a.send(1, Frame(b"gate"))
    sender = threading.Thread(target=pair.a.send, args=(1, Frame(b"large", [_large(5)])))
    sender.start()
    _wait_until(lambda: len(_backlog(pair)) == 1)
    pair.a.send(1, Frame(b"bookkeeping", deadline=time.monotonic() + 0.2))
    assert _backlog(pair).overtaking == 0 and len(_backlog(pair)) == 2
    gate.set()
    assert pair.headers(3) == [b"gate", b"large", b"bookkeeping"]
    sender.join(BOUND)
    assert not sender.is_alive()


def test_only_user_calls_replies_and_liveness_may_pass() -> None:
    from rpcx.messages import PASSING_KINDS, MessageKind
    assert {MessageKind.CALL, MessageKind.RESULT, MessageKind.HEARTBEAT} <= PASSING_KINDS
    assert not {MessageKind.RREF_DELETE, MessageKind.RREF_FORKS, MessageKind.AUTOGRAD_RELEASE,
                MessageKind.AUTOGRAD_FORGET, MessageKind.LEAVING} & PASSING_KINDS


def test_frames_in_pieces_and_small_ones_from_many_threads_all_arrive_whole() -> None:
    # Several senders of large and small frames at once: each sender's frames arrive in
    # its own order, every byte where it belongs.
    pair = _TcpPair()
    try:
        sizes = [socket_backend._PIECED_MIN, 3 * socket_backend._PIECE_BYTES + 5, 12 << 20]

        def sender(index: int) -> None:
            for step, size in enumerate(sizes):
                fill = index * 10 + step
                pair.a.send(1, Frame(f"{index}:{step}:large".encode(),
                                     [torch.full((size,), fill, dtype=torch.uint8),
                                      torch.arange(3) + fill]))
                pair.a.send(1, Frame(f"{index}:{step}:small".encode(), may_pass=True))

        _all(sender, [(i,) for i in range(4)])
        pair.headers(4 * 2 * len(sizes))
        for index in range(4):
            mine = [f for f in pair.arrived if f.header.startswith(f"{index}:".encode())]
            assert [f.header for f in mine] == [
                f"{index}:{step}:{kind}".encode()
                for step in range(len(sizes)) for kind in ("large", "small")]
            for step, size in enumerate(sizes):
                large = mine[2 * step]
                fill = index * 10 + step
                assert large.buffers[0].numel() == size and bool((large.buffers[0] == fill).all())
                assert torch.equal(large.buffers[1].view(torch.int64), torch.arange(3) + fill)
    finally:
        pair.close()
