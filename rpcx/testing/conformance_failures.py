"""Conformance: a worker dies with RRefs and a distributed autograd context in flight.

Multi-process backends only (a thread cannot crash on its own). One world per test: a
crash ends it. What must hold: calls to the dead worker fail at once naming it; the
survivors learn of it (``debug_info()["lost_peers"]``); owners drop the references the
dead worker held (``drop_rank``), so their values are freed; a backward pass through the
dead worker fails instead of hanging; shutdown skips it.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch

import rpcx
import rpcx.autograd as dist_autograd
from rpcx._core import context as _context
from rpcx._core.agent import RpcAgent
from rpcx._core.budget import BytesInFlight
from rpcx.futures import wait_done
from rpcx.testing import remote, training
from rpcx.testing.fixtures import WorldKeeper
from rpcx.testing.stopping import stopped
from rpcx.testing.world import World, world

__all__ = ["TestBackPressure", "TestHungPeer", "TestPeerDeath"]

W0, W1, W2 = "worker0", "worker1", "worker2"
BOUND = 60.0


@contextlib.contextmanager
def _own_world(backend: str, keeper: WorldKeeper, **options: Any) -> Iterator[World]:
    """A fresh 3-worker world with ``options``, for a test that ends or bends it. The
    module's shared world, if this process runs one, is closed first (the next test that
    needs it restarts it)."""
    keeper.close()
    with world(backend, size=3, rpc_timeout=BOUND, **options) as started:
        yield started


@pytest.mark.rpcx_requires(
    "multi_process", reason="a worker that is a thread of this process cannot crash alone")
class TestPeerDeath:
    """A worker process ends abruptly (``os._exit``) mid-call, mid-backward, mid-context."""

    @pytest.fixture
    def crash_world(
        self, rpcx_backend: str, rpc_world_keeper: WorldKeeper
    ) -> Iterator[World]:
        """A fresh 3-worker world: a crash ends it."""
        with _own_world(rpcx_backend, rpc_world_keeper) as started:
            yield started

    def test_dead_worker_with_rrefs_and_autograd_in_flight(self, crash_world: World) -> None:
        baseline = rpcx.rpc_sync(W2, remote.tracked_live)
        # worker1 holds the only reference to a value on worker2
        held = rpcx.remote(W2, remote.Tracked, args=("held by worker1",))
        key = uuid.uuid4().hex
        rpcx.rpc_sync(W1, remote.hold, args=(key, held))
        assert rpcx.rpc_sync(W1, remote.wait_confirmed_held, args=(key,)) is True
        del held
        rpcx.rpc_sync(W0, remote.rref_settle)
        assert rpcx.rpc_sync(W2, remote.tracked_live) == baseline + 1
        # worker0 holds a reference to a value on worker1
        on_dead = rpcx.remote(W1, remote.Counter, args=(1,))
        assert on_dead.to_here().count == 1

        x = torch.tensor([1.0, 2.0], requires_grad=True)
        gate = uuid.uuid4().hex
        with dist_autograd.context() as context_id:
            # The graph crosses worker1 (worker0 -> worker1 -> worker2).
            y = rpcx.rpc_sync(W1, training.square_then_call, args=(x, [W2]))
            blocked = rpcx.rpc_async(W1, remote.wait_for_release, args=(gate, BOUND))
            rpcx.rpc_async(W1, remote.crash_process)
            with pytest.raises(rpcx.PeerLostError, match=r"worker 'worker1'") as lost:
                blocked.wait()
            assert lost.value.cause is rpcx.LostCause.CONNECTION_LOST
            started = time.monotonic()
            with pytest.raises(rpcx.PeerLostError, match=r"worker 'worker1'"):
                dist_autograd.backward(context_id, [y.sum()])
            assert time.monotonic() - started < BOUND / 4, "backward waited for the dead worker"

        # Every survivor knows, and says why.
        lost_here = rpcx.debug_info()["lost_peers"]
        assert list(lost_here) == [W1] and "worker1" in lost_here[W1], lost_here
        lost_there = rpcx.rpc_sync(W2, remote.wait_until_lost, args=(W1, BOUND))
        assert list(lost_there) == [W1], lost_there
        assert rpcx.debug_info()["lost_causes"] == {W1: "connection lost"}
        assert rpcx.rpc_sync(W2, rpcx.debug_info)["lost_causes"] == {W1: "connection lost"}

        # The owner dropped the dead worker's reference: the value is freed.
        rpcx.rpc_sync(W2, remote.rref_settle)
        assert rpcx.rpc_sync(W2, remote.tracked_live) == baseline
        # An RRef owned by the dead worker fails at once, naming it.
        started = time.monotonic()
        with pytest.raises(rpcx.PeerLostError, match="worker1"):
            on_dead.to_here()
        with pytest.raises(rpcx.PeerLostError, match="worker1"):
            on_dead.rpc_sync().value()
        assert time.monotonic() - started < BOUND / 4
        # The others still work, also with autograd.
        with dist_autograd.context() as context_id:
            z = rpcx.rpc_sync(W2, training.scale, args=(x, 3.0))
            dist_autograd.backward(context_id, [z.sum()])
            assert torch.equal(dist_autograd.get_gradients(context_id)[x], torch.full((2,), 3.0))


    def test_worker_dying_inside_a_chain_fails_the_backward(self, crash_world: World) -> None:
        # worker0 -> worker1 -> worker2, whose backward ends its process. The chain of
        # passes has left worker0 (it went on one way through worker1), so worker0 hears
        # it from worker1, which handed the chain to worker2: an error naming worker2,
        # long before the timeout.
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            z = rpcx.rpc_sync(W1, rpcx.rpc_sync, args=(
                W2, training.fail_in_backward_then_call, (x, [], True)))
            started = time.monotonic()
            with pytest.raises(rpcx.PeerLostError, match="worker2"):
                dist_autograd.backward(context_id, [z.sum()])
            assert time.monotonic() - started < BOUND / 4, "backward waited for the dead worker"


    def test_context_reached_through_a_dead_worker_is_released(self, crash_world: World) -> None:
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        with dist_autograd.context():
            rpcx.rpc_sync(W1, training.square_then_call, args=(x, [W2]))  # worker2 joins it
            rpcx.rpc_async(W1, remote.crash_process)
            # Known dead here before the block ends (a local check: no call to worker2 in
            # the context, which would make worker2 a peer of this worker in it).
            assert list(remote.wait_until_lost(W1, BOUND)) == [W1]
        # The release cannot travel through worker1: it goes to every live worker, and
        # this worker's releases are complete once each peer has handled it.
        assert dist_autograd._wait_released(BOUND) >= 1
        assert list(rpcx.rpc_sync(W2, remote.wait_until_lost, args=(W1, BOUND))) == [W1]
        stats = rpcx.rpc_sync(W2, training.autograd_stats)
        assert stats["contexts"] == 0, stats


    def test_contexts_of_a_dead_creator_are_released(self, crash_world: World) -> None:
        before = rpcx.rpc_sync(W2, training.autograd_stats)["contexts"]
        with pytest.raises(rpcx.PeerLostError, match=r"worker 'worker1'"):
            rpcx.rpc_sync(W1, training.open_context_call_then_crash, args=(W2,))
        # worker2 joined a context of worker1's, which will never release it now.
        assert list(rpcx.rpc_sync(W2, remote.wait_until_lost, args=(W1, BOUND))) == [W1]
        stats = rpcx.rpc_sync(W2, training.autograd_stats)
        assert stats["contexts"] == before, stats


HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT = 0.2, 1.5
SHUTDOWN_TIMEOUT = 3.0
SHUTDOWN_SLACK = 1.0  # past its timeout: telling the store "left" (0.1 s) and scheduling
CALL_TIMEOUT = 1.0  # shorter than HEARTBEAT_TIMEOUT: the call's own timeout ends it


@pytest.mark.rpcx_requires(
    "multi_process", reason="a worker that is a thread of this process cannot be stopped alone")
class TestHungPeer:
    """A worker process is stopped (``SIGSTOP``): alive as far as its connections know,
    silent. Heartbeats find it; calls to it fail naming it; it is heard again after
    ``SIGCONT``, and calls work again."""

    @pytest.fixture
    def hang_world(
        self, rpcx_backend: str, rpc_world_keeper: WorldKeeper
    ) -> Iterator[World]:
        """A fresh 3-worker world with fast heartbeats."""
        with _own_world(rpcx_backend, rpc_world_keeper, heartbeat_interval=HEARTBEAT_INTERVAL,
                        heartbeat_timeout=HEARTBEAT_TIMEOUT) as started:
            yield started

    def test_a_stopped_worker_is_reported_and_comes_back(self, hang_world: World) -> None:
        pid = rpcx.rpc_sync(W1, remote.process_id)
        agent = _context.current_agent()
        waiting = rpcx.rpc_async(W1, remote.wait_for_event, args=(uuid.uuid4().hex, BOUND),
                                 timeout=0)  # no timeout: only the heartbeat can end it
        with stopped(pid):
            started = time.monotonic()
            with pytest.raises(rpcx.PeerLostError, match="is unresponsive: silent for") as err:
                waiting.wait()
            detected = time.monotonic() - started
            assert err.value.cause is rpcx.LostCause.UNRESPONSIVE
            assert "worker 'worker1'" in str(err.value)
            # within the limit, give or take one look and the scheduling of a loaded host
            assert detected < HEARTBEAT_TIMEOUT + 2.0, detected
            with pytest.raises(rpcx.PeerLostError, match="unresponsive"):
                rpcx.rpc_sync(W1, remote.add, args=(1, 1))  # fails at once meanwhile
            assert rpcx.rpc_sync(W2, remote.add, args=(2, 2)) == 4  # others unaffected
            assert rpcx.debug_info()["unresponsive_peers"] == [W1]
        assert agent.wait_responsive(1, BOUND)
        assert rpcx.rpc_sync(W1, remote.add, args=(3, 3), timeout=BOUND) == 6
        assert rpcx.debug_info()["lost_peers"] == {}

    def test_a_busy_worker_is_not_unresponsive(self, hang_world: World) -> None:
        # A handler that computes for longer than the heartbeat timeout: the worker still
        # answers pings (requests never stop it reading frames), so its call completes.
        spun = rpcx.rpc_sync(W1, remote.spin, args=(HEARTBEAT_TIMEOUT * 2,), timeout=BOUND)
        assert spun >= HEARTBEAT_TIMEOUT * 2
        assert not _context.current_agent().is_unresponsive(1)

    def test_small_calls_to_a_stopped_worker_fail_on_time_and_hold_up_no_one(
        self, rpcx_backend: str, rpc_world_keeper: WorldKeeper
    ) -> None:
        # Small frames (no tensors) from four threads, until the transport's buffers are
        # full: calls then wait in rpc_async for room, until their deadline at most.
        # Measured before the fix, from a single thread: shm's send blocked for good
        # after ~8 MiB (126 calls of 64 KiB, 1,726 of 4 KiB), zmq's after 4,096 messages,
        # gloo's after 64 frames of a slot or at the first frame larger than one.
        # tensorpipe never waits, so the flood ends at `most` calls. Heartbeats are on
        # (their pings to worker1 pile up too), slow enough to leave the ending to the
        # calls' own timeouts.
        threads_count, most = 4, 12 << 10  # 3x zmq's queue; 24 MiB: 3x shm's buffers
        sizes = (16, 4 << 10)  # a call's argument: half within a gloo slot, then past it
        slack = 1.0  # a loaded host's scheduling, and thousands of timeouts to fire
        with _own_world(rpcx_backend, rpc_world_keeper, heartbeat_interval=HEARTBEAT_INTERVAL,
                        heartbeat_timeout=BOUND / 4):
            agent = _context.current_agent()
            pid = rpcx.rpc_sync(W1, remote.process_id)
            numbers = itertools.count()
            calls: list[tuple[float, Any]] = []  # (when rpc_async was called, its future)
            waits: list[float] = []  # rpc_async durations over half the timeout
            full = threading.Event()  # enough calls waited for room: the buffers are full
            errors: list[BaseException] = []

            def flood() -> None:
                _context.bind_agent(agent)
                mine: list[tuple[float, Any]] = []
                try:
                    while not full.is_set() and (number := next(numbers)) < most:
                        payload = b"x" * sizes[number * len(sizes) // most]
                        started = time.monotonic()
                        future = rpcx.rpc_async(W1, len, args=(payload,), timeout=CALL_TIMEOUT)
                        took = time.monotonic() - started
                        mine.append((started, future))
                        if took > CALL_TIMEOUT / 2:
                            waits.append(took)
                            if len(waits) >= 2 * threads_count:
                                full.set()
                except BaseException as exc:
                    errors.append(exc)
                calls.extend(mine)

            with stopped(pid):
                threads = [threading.Thread(target=flood) for _ in range(threads_count)]
                for thread in threads:
                    thread.start()
                offered_by = time.monotonic() + BOUND / 4
                for thread in threads:
                    thread.join(max(0.0, offered_by - time.monotonic()))
                assert not any(t.is_alive() for t in threads), \
                    "rpc_async to a stopped worker blocked past its timeout"
                assert not errors, errors
                assert max(waits, default=0.0) < CALL_TIMEOUT + slack, waits
                # worker1 still stopped, what was offered to it still queued:
                started = time.monotonic()
                assert rpcx.rpc_sync(W2, len, args=(b"ab",), timeout=CALL_TIMEOUT) == 2
                assert time.monotonic() - started < CALL_TIMEOUT
                # Each call failed by its own deadline (in the order made, each waited
                # for only until its own deadline and the slack).
                calls.sort(key=lambda call: call[0])
                for started, future in calls:
                    left = started + CALL_TIMEOUT + slack - time.monotonic()
                    assert wait_done(future, max(0.0, left)), \
                        f"a call still open {CALL_TIMEOUT + slack:g} s after it was made"
                    with pytest.raises(rpcx.RpcTimeoutError, match="timed out"):
                        future.value()
            # The frames sent late arrive now; worker1 serves them (nobody listens for
            # the replies any more), then answers again.
            assert agent.wait_responsive(1, BOUND)
            assert rpcx.rpc_sync(W1, len, args=(b"abc",), timeout=BOUND) == 3
            assert rpcx.rpc_sync(W2, len, args=(b"ab",), timeout=BOUND) == 2

    def test_a_large_call_to_a_stopped_worker_fails_within_its_timeout(
        self, hang_world: World
    ) -> None:
        # 32 MiB: far more than the kernel's socket buffers take from a sender whose
        # peer reads nothing. The call's timeout covers sending it.
        pid = rpcx.rpc_sync(W1, remote.process_id)
        big = torch.ones(8 << 20)
        with stopped(pid):
            started = time.monotonic()
            with pytest.raises(rpcx.RpcTimeoutError, match="timed out"):
                rpcx.rpc_sync(W1, remote.tensor_sum, args=(big,), timeout=CALL_TIMEOUT)
            took = time.monotonic() - started
            assert took < CALL_TIMEOUT + 1.0, took
        agent = _context.current_agent()
        assert agent.wait_responsive(1, BOUND)
        # The frame was still sent, late; calls after it work once worker1 runs again.
        assert rpcx.rpc_sync(W1, remote.add, args=(1, 2), timeout=BOUND) == 3

    def test_shutdown_is_bounded_with_a_stopped_worker(self, hang_world: World) -> None:
        pid = rpcx.rpc_sync(W1, remote.process_id)
        with stopped(pid):
            started = time.monotonic()
            rpcx.shutdown(graceful=True, timeout=SHUTDOWN_TIMEOUT)
            took = time.monotonic() - started
            # Every step, goodbyes included, comes out of the timeout: what may pass it
            # is the moment to tell the store "left" and a loaded host's scheduling.
            assert took < SHUTDOWN_TIMEOUT + SHUTDOWN_SLACK, took

    def test_shutdown_is_bounded_while_a_stopped_worker_holds_the_store(
        self, hang_world: World
    ) -> None:
        # A worker stopped inside a file:// store operation holds the store file's lock
        # (FileStore's flock has no timeout); every other worker's store calls wait for
        # it. Holding that lock here is the same for them, and deterministic.
        if not hang_world.init_method.startswith("file://"):
            pytest.skip("the world's rendezvous store is not a file")
        path = hang_world.init_method[len("file://"):]
        with open(path, "rb") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            try:
                started = time.monotonic()
                rpcx.shutdown(graceful=True, timeout=SHUTDOWN_TIMEOUT)
                took = time.monotonic() - started
            finally:
                fcntl.flock(held, fcntl.LOCK_UN)
        assert took < SHUTDOWN_TIMEOUT + SHUTDOWN_SLACK, took


MiB = 1 << 20


class TestBackPressure:
    """``max_bytes_in_flight``: a caller cannot have more than that many bytes of calls
    unanswered at one peer; past it a call waits within its timeout, then fails."""

    LIMIT = int(4.5 * MiB)  # four calls of 1 MiB fit, a fifth does not

    @pytest.fixture
    def budget_world(
        self, rpcx_backend: str, rpc_world_keeper: WorldKeeper
    ) -> Iterator[World]:
        """A fresh 3-worker world with a small budget."""
        with _own_world(rpcx_backend, rpc_world_keeper,
                        max_bytes_in_flight=self.LIMIT) as started:
            yield started

    def test_a_call_past_the_budget_waits_then_fails_unsent(self, budget_world: World) -> None:
        key = uuid.uuid4().hex
        megabyte = torch.zeros(MiB // 4)  # float32: 1 MiB
        held = [rpcx.rpc_async(W1, remote.gated_numel, args=(key, megabyte))
                for _ in range(4)]
        started = time.monotonic()
        late = rpcx.rpc_async(W1, remote.gated_numel, args=(key, megabyte), timeout=0.5)
        waited = time.monotonic() - started  # rpc_async itself waited for room
        with pytest.raises(rpcx.RpcTimeoutError, match="max_bytes_in_flight") as err:
            late.wait()
        assert "worker 'worker1'" in str(err.value) and "4.0 MiB" in str(err.value)
        assert 0.4 < waited < 0.5 + 1.0, waited
        info = rpcx.debug_info()
        assert info["calls_held_back"] == 1
        assert MiB * 4 <= info["bytes_in_flight"][W1] <= self.LIMIT
        # Other peers have budgets of their own: worker2 opens worker1's gate.
        rpcx.rpc_sync(W2, remote.call_with, args=(rpcx.rpc_sync, W1, remote.release, (key,)))
        assert [f.wait() for f in held] == [MiB // 4] * 4
        assert rpcx.rpc_sync(W1, remote.tally_of, args=(key,)) == 4  # the fifth never left
        assert rpcx.debug_info()["bytes_in_flight"] == {}

    def test_a_flood_stays_within_the_budget(self, budget_world: World) -> None:
        # 48 calls of 1 MiB from three threads at once, to a callee that holds each until
        # released: no more than four are ever at worker1; every call completes.
        key = uuid.uuid4().hex
        megabyte = torch.ones(MiB // 4)
        agent = _context.current_agent()
        results: list[int] = []
        errors: list[BaseException] = []

        def flood() -> None:
            _context.bind_agent(agent)
            try:
                futures = [rpcx.rpc_async(W1, remote.gated_numel, args=(key, megabyte))
                           for _ in range(16)]
                results.extend(f.wait() for f in futures)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=flood) for _ in range(3)]
        for thread in threads:
            thread.start()
        # Worker1 holds four; each thread waits at worker0 until worker2 opens the gate.
        assert rpcx.rpc_sync(W2, remote.call_with, args=(
            rpcx.rpc_sync, W1, remote.wait_for_tally, (key, 4, BOUND))) == 4
        budget = cast(RpcAgent, agent)._back_pressure
        assert isinstance(budget, BytesInFlight) and budget.budget.wait_for_waiting(3, BOUND)
        rpcx.rpc_sync(W2, remote.call_with, args=(rpcx.rpc_sync, W1, remote.release, (key,)))
        for thread in threads:
            thread.join(BOUND)
        assert not errors and results == [MiB // 4] * 48
        assert rpcx.rpc_sync(W1, remote.tally_of, args=(f"{key}/peak",)) <= 4
        assert rpcx.debug_info()["calls_held_back"] >= 3
        assert rpcx.debug_info()["bytes_in_flight"] == {}
