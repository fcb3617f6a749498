"""rpcx.transport_kit, the public kit every backend shares: its writer (what lets
``send`` honour a call's deadline), the lost-peer wording, the size checks, options and
frame copies. The backends built on it run the conformance kit; these pin the pieces."""

from __future__ import annotations

import socket
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rpcx.errors import LostCause, PeerLostError, ProtocolError, RpcTimeoutError, lost_reason
from rpcx.options import TensorPipeRpcBackendOptions
from rpcx.transport import Frame
from rpcx.transport_kit import (
    CLOSED_CONNECTION,
    Backlog,
    check_frame_size,
    classify,
    empty_bytes,
    lost_error,
    options_as,
    wait_connected,
)
from rpcx.transport_kit.connector import Connector
from rpcx.transport_kit.links import Link, Peers
from rpcx.transport_kit.socket_link import SocketLink

BOUND = 10.0  # seconds: every wait here ends long before; a hang fails, it never stalls


class Wire:
    """A connection whose writes block until the test lets them through."""

    def __init__(self) -> None:
        self.written: list[Any] = []
        self.gate = threading.Event()
        self.fail: BaseException | None = None
        self.entered = threading.Event()

    def write(self, job: Any) -> None:
        self.entered.set()
        if not self.gate.wait(BOUND):
            raise AssertionError("the test never opened the gate")
        if self.fail is not None:
            raise self.fail
        self.written.append(job)


def _backlog(wire: Wire, **kwargs: Any) -> Backlog:
    return Backlog(threading.Lock(), wire.write, "rpcx-test-writer", **kwargs)


def test_a_sender_waits_until_its_deadline_and_the_frame_is_still_written() -> None:
    wire = Wire()
    backlog = _backlog(wire)
    with backlog.lock:
        first = backlog.put("a")
        second = backlog.put("b")
    started = time.monotonic()
    assert second.wait(time.monotonic() + 0.05) is False  # the peer reads nothing
    assert time.monotonic() - started < BOUND
    wire.gate.set()  # it reads again: both go, in order
    assert first.wait(time.monotonic() + BOUND) and second.wait(time.monotonic() + BOUND)
    assert wire.written == ["a", "b"]
    backlog.stop()
    backlog.join(BOUND)


def test_a_failed_write_fails_every_queued_frame_and_every_later_one() -> None:
    wire = Wire()
    ended: list[BaseException] = []
    backlog = _backlog(wire, on_error=ended.append)
    with backlog.lock:
        queued = [backlog.put(n) for n in range(3)]
    assert wire.entered.wait(BOUND)
    wire.fail = ConnectionResetError(104, "Connection reset by peer")
    wire.gate.set()
    for pending in queued:
        with pytest.raises(PeerLostError, match="is unreachable: Connection reset by peer"):
            pending.wait(time.monotonic() + BOUND)
    assert len(ended) == 1 and not backlog
    # The connection is over: a frame queued now fails at once instead of waiting for
    # a writer that will never come.
    with backlog.lock:
        late = backlog.put("late")
    with pytest.raises(PeerLostError):
        late.wait()


def test_a_writer_stopped_at_close_starts_again_for_a_later_frame() -> None:
    wire = Wire()
    wire.gate.set()
    backlog = _backlog(wire)
    with backlog.lock:
        first = backlog.put("a")
    assert first.wait(time.monotonic() + BOUND)
    backlog.stop()
    backlog.join(BOUND)
    with backlog.lock:
        again = backlog.put("b")
    assert again.wait(time.monotonic() + BOUND)
    assert wire.written == ["a", "b"]


def test_released_jobs_are_released_once_written_or_failed() -> None:
    released: list[str] = []

    class Job:
        def __init__(self, name: str) -> None:
            self.name = name

        def release(self) -> None:
            released.append(self.name)

    wire = Wire()
    wire.gate.set()
    backlog = _backlog(wire)
    with backlog.lock:
        pending = backlog.put(Job("x"))
    assert pending.wait(time.monotonic() + BOUND)
    assert released == ["x"]


def test_a_held_backlog_queues_until_released_then_writes_in_order() -> None:
    wire = Wire()
    wire.gate.set()
    backlog = _backlog(wire)
    backlog.hold()  # (a link being connected)
    assert backlog  # later frames must queue, though none is queued yet
    with backlog.lock:
        queued = [backlog.put(n) for n in range(4)]
    assert backlog.writer is None and wire.written == []  # held: no writer, nothing written
    inline: list[int] = []

    def takes_two(job: int) -> bool:  # the socket takes the first two at once
        if len(inline) < 2:
            inline.append(job)
            return True
        return False

    with backlog.lock:
        backlog.release(takes_two)
    for pending in queued:
        assert pending.wait(time.monotonic() + BOUND)
    assert inline == [0, 1] and wire.written == [2, 3]  # the writer thread took the rest
    with backlog.lock:
        later = backlog.put(4)
    assert later.wait(time.monotonic() + BOUND) and wire.written == [2, 3, 4]
    backlog.stop()
    backlog.join(BOUND)


def test_a_backlog_released_after_it_failed_writes_nothing() -> None:
    wire = Wire()
    backlog = _backlog(wire)
    backlog.hold()
    with backlog.lock:
        queued = backlog.put("a")
        backlog.fail(ConnectionError("could not connect"))
        backlog.release(lambda job: pytest.fail("released a failed backlog"))
    with pytest.raises(PeerLostError):
        queued.wait(time.monotonic() + BOUND)
    assert backlog.writer is None and wire.written == []


def test_a_held_backlog_whose_connection_never_comes_fails_its_frames() -> None:
    backlog = _backlog(Wire())
    backlog.hold()
    with backlog.lock:
        queued = backlog.put("a")
        backlog.fail(ConnectionError("could not connect: Connection refused"))
        late = backlog.put("b")
    for pending in (queued, late):
        with pytest.raises(PeerLostError, match="could not connect: Connection refused"):
            pending.wait(time.monotonic() + BOUND)
    assert backlog.writer is None and not backlog


def test_the_connector_runs_jobs_on_a_few_threads_and_later_ones_when_due() -> None:
    connector = Connector("rpcx-test-connect", limit=2)
    gate = threading.Event()
    done: list[str] = []
    running, finished = threading.Semaphore(0), threading.Semaphore(0)

    def blocked(name: str) -> None:
        running.release()
        if not gate.wait(BOUND):
            raise AssertionError("the test never opened the gate")
        done.append(name)
        finished.release()

    for n in range(5):  # more jobs than threads: at most two run at once
        connector.submit(lambda n=n: blocked(f"job{n}"))
    assert running.acquire(timeout=BOUND) and running.acquire(timeout=BOUND)
    assert connector.threads == 2 and not running.acquire(timeout=0.05)
    later = threading.Event()
    due = time.monotonic() + 0.2
    connector.submit(lambda: later.set() if time.monotonic() >= due else None, at=due)
    gate.set()
    assert later.wait(BOUND)  # ran, and not before it was due
    for _ in range(3):
        assert running.acquire(timeout=BOUND)
    for _ in range(5):
        assert finished.acquire(timeout=BOUND)
    connector.close()
    assert sorted(done) == [f"job{n}" for n in range(5)]


def test_the_connector_hands_back_what_is_left_at_close() -> None:
    connector = Connector("rpcx-test-connect", limit=1)
    gate, busy, ran = threading.Event(), threading.Event(), threading.Event()

    def hold_the_thread() -> None:
        busy.set()
        gate.wait(BOUND)

    connector.submit(hold_the_thread)
    assert busy.wait(BOUND)
    connector.submit(ran.set)  # due now, but the only thread is busy
    assert connector.close() == [ran.set]  # not begun: handed back, in order
    gate.set()  # the thread is free again, and must not run it
    assert connector.submit(ran.set) is False  # (after close: dropped)
    assert not ran.wait(0.2)


def test_a_burst_of_jobs_gets_more_threads_though_one_was_idle() -> None:
    # One thread idle (it ran a job a moment ago), then a burst of slow jobs: they
    # must spread over threads up to the limit, not queue on the idle one.
    connector = Connector("rpcx-test-connect", limit=3)
    first = threading.Event()
    connector.submit(first.set)
    assert first.wait(BOUND)
    gate = threading.Event()
    running = threading.Semaphore(0)

    def slow() -> None:
        running.release()
        gate.wait(BOUND)

    for _ in range(3):
        connector.submit(slow)
    for _ in range(3):  # all three at once: three threads
        assert running.acquire(timeout=BOUND)
    gate.set()
    connector.close()


@pytest.mark.parametrize(("exc", "cause", "sentence"), [
    (EOFError(), LostCause.CONNECTION_LOST, f"is unreachable: {CLOSED_CONNECTION}"),
    (ConnectionResetError(104, "reset"), LostCause.CONNECTION_LOST,
     f"is unreachable: {CLOSED_CONNECTION}"),
    (BrokenPipeError(32, "Broken pipe"), LostCause.CONNECTION_LOST,
     "is unreachable: BrokenPipeError: [Errno 32] Broken pipe"),
    (ProtocolError("a frame of 9 bytes, over max_frame_bytes (8)"), LostCause.PROTOCOL_ERROR,
     "is unreachable: protocol error: a frame of 9 bytes, over max_frame_bytes (8)"),
    (ValueError("bad kind"), LostCause.PROTOCOL_ERROR,
     "is unreachable: protocol error: ValueError: bad kind"),
])
def test_what_ended_a_receive_loop_is_worded_by_rpcx(
    exc: BaseException, cause: LostCause, sentence: str
) -> None:
    found, detail = classify(exc)
    assert found is cause
    assert lost_reason(found, detail) == sentence


def test_a_goodbye_reads_as_shut_down() -> None:
    assert lost_reason(LostCause.DEPARTED) == "has shut down"


def _peers_of_one(link: Link, connection_errors: tuple[type[BaseException], ...] = ()
                  ) -> tuple[Peers[Link], list[tuple[int, LostCause, str]]]:
    reported: list[tuple[int, LostCause, str]] = []
    ctx: Any = SimpleNamespace(rank=0, names=["me", "peer"],
                               peer_lost=lambda *args: reported.append(args))
    return Peers(ctx, {1: link}, read_one=lambda link: None, write_bye=lambda link: None,
                 connection_errors=connection_errors), reported


class LibraryError(Exception):
    """What a transport's library raises when its connection is gone (zmq.ZMQError)."""


def test_a_library_error_declared_a_connection_error_reports_the_peer_lost() -> None:
    declared = Link(1, "peer")
    peers, reported = _peers_of_one(declared, connection_errors=(LibraryError,))
    peers.broken(declared, LibraryError("Context was terminated"))
    assert reported == [(1, LostCause.CONNECTION_LOST, "Context was terminated")]
    # Undeclared, the same exception reads as what the peer sent: a protocol error.
    undeclared = Link(1, "peer")
    peers, reported = _peers_of_one(undeclared)
    peers.broken(undeclared, LibraryError("Context was terminated"))
    assert reported == [(1, LostCause.PROTOCOL_ERROR, "LibraryError: Context was terminated")]


def test_wait_connected_returns_once_every_connection_is_up_and_names_those_that_are_not(
) -> None:
    def context(rpc_timeout: float) -> Any:
        return SimpleNamespace(rank=0, names=["me", "a", "b"],
                               options=SimpleNamespace(rpc_timeout=rpc_timeout))

    up, late, never = threading.Event(), threading.Event(), threading.Event()
    up.set()
    timer = threading.Timer(0.05, late.set)
    timer.start()
    try:
        wait_connected(context(BOUND), {"'a'": up, "'b'": late})  # (returns once both are)
        assert late.is_set()
    finally:
        timer.join(BOUND)
    started = time.monotonic()
    with pytest.raises(RpcTimeoutError) as timed_out:
        wait_connected(context(0.2), {"'a' at tcp://x:1": up, "'b' at tcp://y:2": never},
                       hint="check the address")
    assert time.monotonic() - started < BOUND
    assert str(timed_out.value) == (
        "init_rpc: worker 'me' (rank 0) could not connect to 'b' at tcp://y:2 within "
        "0.2 s (rpc_timeout); check the address")


def test_a_send_to_a_peer_reported_lost_fails_with_why_it_was_lost() -> None:
    # A peer dialed on demand may be given up (its dial refused) before the first send
    # reaches its link: that send must say what the queued ones say, not "has shut down".
    link = Link(1, "peer")
    peers, reported = _peers_of_one(link)
    peers.lost(link, LostCause.CONNECTION_LOST, "could not connect: Connection refused")
    peers.lost(link, LostCause.DEPARTED)  # (reported once: the first words stay)
    assert reported == [(1, LostCause.CONNECTION_LOST, "could not connect: Connection refused")]
    with link.lock, pytest.raises(PeerLostError) as lost:
        link.check_open()
    assert str(lost.value) == "is unreachable: could not connect: Connection refused"
    assert lost.value.cause is LostCause.CONNECTION_LOST


def test_a_send_after_a_goodbye_or_our_own_reads_as_shut_down() -> None:
    theirs, ours = Link(1, "peer"), Link(1, "peer")
    peers, _ = _peers_of_one(theirs)
    peers.lost(theirs, LostCause.DEPARTED)
    ours.bye_sent = True
    for link in (theirs, ours):
        with link.lock, pytest.raises(PeerLostError, match=r"^has shut down$"):
            link.check_open()


def test_send_errors_drop_cpp_locations() -> None:
    error = lost_error(RuntimeError(
        "Connection closed by peer [10.0.0.1]:1234 (this error originated at "
        "/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:598)\nmore"))
    assert str(error) == "is unreachable: Connection closed by peer [10.0.0.1]:1234"
    assert error.cause is LostCause.CONNECTION_LOST


def test_announced_sizes_over_the_limit_are_refused_before_reading() -> None:
    check_frame_size(8, 8)
    with pytest.raises(ProtocolError, match=r"a frame of 9 bytes, over max_frame_bytes \(8\)"):
        check_frame_size(9, 8)


class PluginOptions(TensorPipeRpcBackendOptions):
    def __init__(self, *, depth: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.depth = depth


def test_options_become_the_transports_own_type() -> None:
    own = PluginOptions(depth=7)
    assert options_as(SimpleNamespace(options=own), PluginOptions) is own  # type: ignore[arg-type]
    given = TensorPipeRpcBackendOptions(rpc_timeout=5, device_maps={"w1": {0: 1}})
    converted = options_as(SimpleNamespace(options=given), PluginOptions)  # type: ignore[arg-type]
    assert isinstance(converted, PluginOptions)
    assert converted.rpc_timeout == 5 and converted.depth == 4
    assert converted.device_maps == given.device_maps
    assert converted.device_maps is not given.device_maps  # not shared with the user's


def test_a_private_copy_keeps_owned_buffers_and_copies_the_rest() -> None:
    mine, theirs = torch.arange(4), torch.arange(3)
    frame = Frame(b"h", [mine, theirs], owned=frozenset({0}))
    copy = frame.private_copy()
    assert copy.buffers[0] is mine
    assert copy.buffers[1] is not theirs and torch.equal(copy.buffers[1], theirs)
    theirs.add_(10)  # the caller changes its tensor after send returned
    assert copy.buffers[1].tolist() == [0, 1, 2]
    twin = frame.shallow_copy()
    assert twin is not frame and twin.buffers == frame.buffers
    assert twin.buffers is not frame.buffers


def test_a_socket_sender_that_leaves_at_its_deadline_leaves_its_buffer_behind() -> None:
    # The writer writes from the sender's own buffer while the sender waits; one that
    # stops waiting first gets the unwritten rest copied, so changing its buffer then
    # cannot change what the peer reads.
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    link = SocketLink(1, "peer", ours, "rpcx-test-writer")
    buffer = bytearray(b"\x01" * (8 << 20))  # far more than the socket takes at once
    try:
        started = time.monotonic()
        link.send([b"head", buffer], deadline=time.monotonic() + 0.05)  # nobody reads
        assert time.monotonic() - started < BOUND
        buffer[:] = b"\x02" * len(buffer)  # the sender reuses its buffer
        received = bytearray()
        theirs.settimeout(BOUND)
        while len(received) < 4 + len(buffer):
            chunk = theirs.recv(1 << 20)
            assert chunk, "the connection ended early"
            received += chunk
        assert received[:4] == b"head"
        assert received[4:].count(1) == len(buffer)  # every byte as it was at send time
    finally:
        link.shutdown()
        link.backlog.stop()
        link.backlog.join(BOUND)
        ours.close()
        theirs.close()


@pytest.mark.parametrize("nbytes", [0, 1000, 5 << 20, (40 << 20) + 3])
def test_empty_bytes_is_a_flat_writable_buffer_of_its_size(nbytes: int) -> None:
    buffer = empty_bytes(nbytes)
    assert buffer.dtype == torch.uint8 and buffer.shape == (nbytes,)
    assert buffer.is_contiguous()
    buffer.fill_(7)
    assert int(buffer.sum()) == 7 * nbytes
    if nbytes >= 32 << 20 and sys.platform.startswith("linux"):
        # (glibc maps these afresh each time: starting on a huge page lets all of it be)
        assert buffer.data_ptr() % (2 << 20) == 0
