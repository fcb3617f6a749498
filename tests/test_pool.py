"""Unit tests for rpcx._util.pool.WorkerPool, the elastic pool that runs incoming requests.

Every wait is an Event/join with a timeout; nothing sleeps to wait for state.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rpcx._util.pool import WorkerPool, current_pool
from rpcx.errors import RpcShutdownError

TIMEOUT = 10.0


@pytest.fixture
def make_pool() -> Iterator[Callable[..., WorkerPool]]:
    pools: list[WorkerPool] = []

    def make(size: int, on_thread_start: Callable[[], None] = lambda: None) -> WorkerPool:
        pool = WorkerPool(size, f"test-pool-{len(pools)}", on_thread_start)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.shutdown(TIMEOUT)


class Counter:
    """Counts events and lets a test wait until the count reaches a value."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.value = 0

    def incr(self) -> None:
        with self._cond:
            self.value += 1
            self._cond.notify_all()

    def wait_for(self, value: int, timeout: float = TIMEOUT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.value >= value, timeout)


def test_runs_submitted_work_with_args(make_pool: Callable[..., WorkerPool]) -> None:
    pool = make_pool(2)
    results: list[tuple[int, str]] = []
    done = threading.Event()

    def work(a: int, b: str) -> None:
        results.append((a, b))
        done.set()

    pool.submit(work, 7, "x")
    assert done.wait(TIMEOUT)
    assert results == [(7, "x")]


def test_runs_many_items(make_pool: Callable[..., WorkerPool]) -> None:
    pool = make_pool(4)
    counter = Counter()
    for _ in range(200):
        pool.submit(counter.incr)
    assert counter.wait_for(200)
    assert 1 <= pool.thread_count <= 4


def test_threads_are_named_and_bound_with_current_pool(
    make_pool: Callable[..., WorkerPool],
) -> None:
    started: list[str] = []
    pool = make_pool(1, lambda: started.append(threading.current_thread().name))
    seen: list[object] = []
    done = threading.Event()

    def work() -> None:
        seen.append(current_pool())
        seen.append(threading.current_thread().name)
        done.set()

    assert current_pool() is None
    pool.submit(work)
    assert done.wait(TIMEOUT)
    assert seen[0] is pool
    assert started == [seen[1]]
    assert isinstance(seen[1], str) and seen[1].startswith("test-pool-0-")


def test_single_thread_runs_items_in_order(make_pool: Callable[..., WorkerPool]) -> None:
    pool = make_pool(1)
    order: list[int] = []
    done = threading.Event()
    for i in range(50):
        pool.submit(order.append, i)
    pool.submit(done.set)
    assert done.wait(TIMEOUT)
    assert order == list(range(50))
    assert pool.thread_count == 1


def test_grows_only_up_to_size(make_pool: Callable[..., WorkerPool]) -> None:
    pool = make_pool(2)
    gate = threading.Event()
    running = Counter()
    finished = Counter()
    threads: set[str] = set()

    def work() -> None:
        threads.add(threading.current_thread().name)
        running.incr()
        gate.wait(TIMEOUT)
        finished.incr()

    for _ in range(5):
        pool.submit(work)
    assert running.wait_for(2)
    assert pool.thread_count == 2  # threads start synchronously in submit
    assert running.value == 2  # the other three wait in the queue
    gate.set()
    assert finished.wait_for(5)
    assert len(threads) == 2
    assert pool.thread_count == 2


def test_blocking_lets_a_nested_wait_get_a_new_thread(
    make_pool: Callable[..., WorkerPool],
) -> None:
    pool = make_pool(1)
    inner_done = threading.Event()
    outer_result: list[bool] = []
    outer_done = threading.Event()
    blocked = threading.Event()

    def outer() -> None:
        with pool.blocking():
            blocked.set()
            outer_result.append(inner_done.wait(TIMEOUT))
        outer_done.set()

    pool.submit(outer)
    assert blocked.wait(TIMEOUT)
    pool.submit(inner_done.set)  # needs a second thread: the only one is blocked
    assert outer_done.wait(TIMEOUT)
    assert outer_result == [True]


def test_blocking_spawns_for_work_queued_before_the_block(
    make_pool: Callable[..., WorkerPool],
) -> None:
    pool = make_pool(1)
    gate = threading.Event()
    inner_done = threading.Event()
    outer_result: list[bool] = []
    outer_done = threading.Event()

    def outer() -> None:
        gate.wait(TIMEOUT)
        with pool.blocking():  # the inner item is already queued: blocking must spawn
            outer_result.append(inner_done.wait(TIMEOUT))
        outer_done.set()

    pool.submit(outer)
    pool.submit(inner_done.set)  # queued: the pool is at its bound
    assert pool.thread_count == 1
    gate.set()
    assert outer_done.wait(TIMEOUT)
    assert outer_result == [True]


def test_nested_chain_longer_than_the_pool(make_pool: Callable[..., WorkerPool]) -> None:
    pool = make_pool(1)
    depth = 5
    results: list[int] = []
    finished = threading.Event()

    def level(n: int) -> None:
        if n == depth:
            results.append(n)
            return
        child_done = threading.Event()

        def child() -> None:
            level(n + 1)
            child_done.set()

        pool.submit(child)
        with pool.blocking():
            assert child_done.wait(TIMEOUT)
        results.append(n)
        if n == 0:
            finished.set()

    pool.submit(level, 0)
    assert finished.wait(TIMEOUT)
    assert results == [5, 4, 3, 2, 1, 0]


def test_compensating_thread_retires_after_the_block(
    make_pool: Callable[..., WorkerPool],
) -> None:
    pool = make_pool(1)
    release = threading.Event()
    inner_done = threading.Event()
    outer_done = threading.Event()
    blocked = threading.Event()
    workers: list[threading.Thread] = []

    def outer() -> None:
        workers.append(threading.current_thread())
        with pool.blocking():
            blocked.set()
            assert inner_done.wait(TIMEOUT)
            assert release.wait(TIMEOUT)
        outer_done.set()

    def inner() -> None:
        workers.append(threading.current_thread())
        inner_done.set()

    pool.submit(outer)
    assert blocked.wait(TIMEOUT)
    pool.submit(inner)
    assert inner_done.wait(TIMEOUT)
    assert pool.thread_count == 2  # size 1 plus one for the blocked thread
    assert workers[0] is not workers[1]
    release.set()
    assert outer_done.wait(TIMEOUT)
    # Once the block ends the pool is above its bound: whichever of the two threads
    # finishes its item first afterwards retires (bounded polling with join timeouts).
    deadline = time.monotonic() + TIMEOUT
    while all(t.is_alive() for t in workers) and time.monotonic() < deadline:
        for t in workers:
            t.join(0.02)
    assert sum(t.is_alive() for t in workers) == 1
    assert pool.thread_count == 1


def test_blocking_after_a_queued_item_still_gets_a_new_thread(
    make_pool: Callable[..., WorkerPool],
) -> None:
    pool = make_pool(1)
    gate = threading.Event()
    in_block = threading.Event()
    inner_done = threading.Event()
    result: list[bool] = []
    finished = threading.Event()

    def first() -> None:
        gate.wait(TIMEOUT)

    def second() -> None:  # ran by the same thread, after `first`, from the queue
        with pool.blocking():
            in_block.set()
            result.append(inner_done.wait(2.0))
        finished.set()

    pool.submit(first)
    pool.submit(second)  # queued behind `first`: the pool is at its bound
    gate.set()
    assert in_block.wait(TIMEOUT)
    pool.submit(inner_done.set)  # must start a thread: the only one is blocked
    assert finished.wait(TIMEOUT)
    assert result == [True]


def test_exceptions_in_items_are_logged_not_raised(
    make_pool: Callable[..., WorkerPool], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="rpcx.pool")
    pool = make_pool(1)
    done = threading.Event()

    def boom() -> None:
        raise ValueError("boom in handler")

    pool.submit(boom)  # submit itself does not raise
    pool.submit(done.set)  # the same thread survives and runs the next item
    assert done.wait(TIMEOUT)
    records = [r for r in caplog.records if r.name == "rpcx.pool"]
    assert len(records) == 1
    assert records[0].levelno == logging.ERROR
    assert "test-pool-0" in records[0].getMessage()
    assert records[0].exc_info is not None
    assert isinstance(records[0].exc_info[1], ValueError)
    assert pool.thread_count == 1


def test_shutdown_joins_threads(make_pool: Callable[..., WorkerPool]) -> None:
    pool = make_pool(3)
    gate = threading.Event()
    running = Counter()
    threads: list[threading.Thread] = []

    def work() -> None:
        threads.append(threading.current_thread())
        running.incr()
        gate.wait(TIMEOUT)

    for _ in range(3):
        pool.submit(work)
    assert running.wait_for(3)
    gate.set()
    pool.shutdown(TIMEOUT)
    assert len(threads) == 3
    assert not any(t.is_alive() for t in threads)
    assert pool.thread_count == 0


def test_shutdown_lets_running_item_finish(make_pool: Callable[..., WorkerPool]) -> None:
    pool = make_pool(1)
    started = threading.Event()
    gate = threading.Event()
    finished = threading.Event()

    def work() -> None:
        started.set()
        gate.wait(TIMEOUT)
        finished.set()

    pool.submit(work)
    assert started.wait(TIMEOUT)
    stopper = threading.Thread(target=pool.shutdown, args=(TIMEOUT,))
    stopper.start()
    gate.set()
    stopper.join(TIMEOUT)
    assert not stopper.is_alive()
    assert finished.is_set()
    assert pool.thread_count == 0


def test_shutdown_warns_about_stuck_threads(
    make_pool: Callable[..., WorkerPool], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rpcx.pool")
    pool = make_pool(1)
    started = threading.Event()
    gate = threading.Event()
    threads: list[threading.Thread] = []

    def work() -> None:
        threads.append(threading.current_thread())
        started.set()
        gate.wait(TIMEOUT)

    pool.submit(work)
    assert started.wait(TIMEOUT)
    pool.shutdown(0.05)
    assert any("still busy" in r.getMessage() for r in caplog.records)
    gate.set()
    threads[0].join(TIMEOUT)
    assert not threads[0].is_alive()


def test_shutdown_from_a_pool_thread_does_not_deadlock(
    make_pool: Callable[..., WorkerPool],
) -> None:
    pool = make_pool(1)
    done = threading.Event()

    def work() -> None:
        pool.shutdown(TIMEOUT)
        done.set()

    pool.submit(work)
    assert done.wait(TIMEOUT)


def test_submit_after_shutdown_raises(make_pool: Callable[..., WorkerPool]) -> None:
    pool = make_pool(2)
    pool.shutdown(TIMEOUT)
    with pytest.raises(RpcShutdownError, match="test-pool-0"):
        pool.submit(print, "never")
    assert pool.thread_count == 0


def test_shutdown_of_an_unused_pool(make_pool: Callable[..., WorkerPool]) -> None:
    pool = make_pool(4)
    pool.shutdown(TIMEOUT)
    assert pool.thread_count == 0
