"""Unit tests for rpcx._timer.DeadlineTimer, the one-thread-per-agent deadline scheduler.

The contract tested here is the code's: every scheduled key whose deadline passes is
handed to ``on_expire``, live or not (the caller ignores keys that already completed);
``is_live`` is only consulted to compact the heap. Deadlines are tens of milliseconds and
every wait is an Event wait with a timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rpcx._timer import _COMPACT_MIN, DeadlineTimer

TIMEOUT = 10.0


class Recorder:
    """on_expire that records (key, time) and lets a test wait for a number of keys."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.keys: list[int] = []
        self.times: list[float] = []
        self.threads: list[str] = []

    def __call__(self, key: int) -> None:
        with self._cond:
            self.keys.append(key)
            self.times.append(time.monotonic())
            self.threads.append(threading.current_thread().name)
            self._cond.notify_all()

    def wait_for(self, count: int, timeout: float = TIMEOUT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.keys) >= count, timeout)


@pytest.fixture
def make_timer() -> Iterator[Callable[..., DeadlineTimer]]:
    timers: list[DeadlineTimer] = []

    def make(
        on_expire: Callable[[int], None],
        is_live: Callable[[int], bool] = lambda key: True,
        on_thread_start: Callable[[], None] = lambda: None,
    ) -> DeadlineTimer:
        timer = DeadlineTimer(f"test{len(timers)}", on_expire, is_live, on_thread_start)
        timers.append(timer)
        return timer

    yield make
    for timer in timers:
        timer.close(TIMEOUT)


def test_fires_in_deadline_order(make_timer: Callable[..., DeadlineTimer]) -> None:
    rec = Recorder()
    timer = make_timer(rec)
    now = time.monotonic()
    deadlines = {1: now + 0.06, 2: now + 0.02, 3: now + 0.04, 4: now + 0.03, 5: now + 0.05}
    for key, deadline in deadlines.items():
        timer.schedule(deadline, key)
    assert rec.wait_for(5)
    assert rec.keys == [2, 4, 3, 5, 1]
    for key, fired_at in zip(rec.keys, rec.times, strict=True):
        assert fired_at >= deadlines[key]


def test_past_deadline_fires_promptly(make_timer: Callable[..., DeadlineTimer]) -> None:
    rec = Recorder()
    timer = make_timer(rec)
    timer.schedule(time.monotonic() - 1.0, 9)
    assert rec.wait_for(1)
    assert rec.keys == [9]


def test_each_key_fires_once(make_timer: Callable[..., DeadlineTimer]) -> None:
    rec = Recorder()
    timer = make_timer(rec)
    now = time.monotonic()
    for key in range(20):
        timer.schedule(now + 0.01, key)
    timer.schedule(now + 0.03, 100)
    assert rec.wait_for(21)
    assert rec.keys[-1] == 100
    assert sorted(rec.keys) == [*range(20), 100]
    assert timer._heap == []


def test_earlier_deadline_wakes_the_thread(make_timer: Callable[..., DeadlineTimer]) -> None:
    rec = Recorder()
    timer = make_timer(rec)
    timer.schedule(time.monotonic() + 3600.0, 1)  # the thread now sleeps for an hour
    assert timer._thread is not None
    early = time.monotonic() + 0.02
    timer.schedule(early, 2)
    assert rec.wait_for(1)
    assert rec.keys == [2]
    assert rec.times[0] >= early


def test_runs_on_one_named_thread_that_calls_on_thread_start(
    make_timer: Callable[..., DeadlineTimer],
) -> None:
    rec = Recorder()
    started: list[str] = []
    timer = make_timer(rec, on_thread_start=lambda: started.append(threading.current_thread().name))
    assert timer._thread is None  # started lazily
    now = time.monotonic()
    timer.schedule(now + 0.01, 1)
    timer.schedule(now + 0.02, 2)
    assert rec.wait_for(2)
    assert started == ["test0-timer"]
    assert rec.threads == ["test0-timer", "test0-timer"]


def test_keys_no_longer_live_are_still_expired(make_timer: Callable[..., DeadlineTimer]) -> None:
    rec = Recorder()
    timer = make_timer(rec, is_live=lambda key: False)
    timer.schedule(time.monotonic() + 0.02, 5)
    assert rec.wait_for(1)
    assert rec.keys == [5]  # lazy cancel: the caller's on_expire ignores completed keys


def test_error_in_on_expire_is_logged_and_timer_continues(
    make_timer: Callable[..., DeadlineTimer], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="rpcx.timer")
    rec = Recorder()

    def on_expire(key: int) -> None:
        if key == 1:
            raise RuntimeError("expire failed")
        rec(key)

    timer = make_timer(on_expire)
    now = time.monotonic()
    timer.schedule(now + 0.01, 1)
    timer.schedule(now + 0.02, 2)
    assert rec.wait_for(1)
    assert rec.keys == [2]
    records = [r for r in caplog.records if r.name == "rpcx.timer"]
    assert len(records) == 1
    assert "test0" in records[0].getMessage()
    assert records[0].exc_info is not None


def test_on_expire_may_schedule(make_timer: Callable[..., DeadlineTimer]) -> None:
    rec = Recorder()
    holder: list[DeadlineTimer] = []

    def on_expire(key: int) -> None:
        rec(key)
        if key < 3:
            holder[0].schedule(time.monotonic() + 0.01, key + 1)

    holder.append(make_timer(on_expire))
    holder[0].schedule(time.monotonic() + 0.01, 1)
    assert rec.wait_for(3)
    assert rec.keys == [1, 2, 3]


# ----------------------------------------------------------------------------- compaction


def test_compaction_bounds_memory_when_keys_die(make_timer: Callable[..., DeadlineTimer]) -> None:
    live: set[int] = set()
    timer = make_timer(lambda key: None, is_live=live.__contains__)
    far = time.monotonic() + 3600.0
    peak = 0
    for key in range(20 * _COMPACT_MIN):
        timer.schedule(far, key)
        peak = max(peak, len(timer._heap))
    assert peak <= _COMPACT_MIN + 1
    assert len(timer._heap) <= _COMPACT_MIN + 1


def test_compaction_keeps_live_keys(make_timer: Callable[..., DeadlineTimer]) -> None:
    live = set(range(0, 6 * _COMPACT_MIN, 7))  # every 7th key stays pending
    timer = make_timer(lambda key: None, is_live=live.__contains__)
    far = time.monotonic() + 3600.0
    for key in range(6 * _COMPACT_MIN):
        timer.schedule(far, key)
    kept = {key for _, key in timer._heap}
    assert live <= kept
    assert len(timer._heap) <= len(live) + 2 * _COMPACT_MIN


def test_compaction_never_drops_live_keys(make_timer: Callable[..., DeadlineTimer]) -> None:
    timer = make_timer(lambda key: None, is_live=lambda key: True)
    far = time.monotonic() + 3600.0
    count = 3 * _COMPACT_MIN + 17
    for key in range(count):
        timer.schedule(far, key)
    assert sorted(key for _, key in timer._heap) == list(range(count))


def test_compacted_heap_still_fires_in_order(make_timer: Callable[..., DeadlineTimer]) -> None:
    rec = Recorder()
    live = {10_000, 10_001, 10_002}
    timer = make_timer(rec, is_live=live.__contains__)
    now = time.monotonic()
    # Wide gaps: the 2048 pushes in between must not outlast the first deadline.
    timer.schedule(now + 0.3, 10_000)
    timer.schedule(now + 0.1, 10_001)
    for key in range(2 * _COMPACT_MIN):  # dead keys, far away: compacted out
        timer.schedule(now + 3600.0, key)
    timer.schedule(now + 0.2, 10_002)
    assert len(timer._heap) < _COMPACT_MIN + 4
    assert rec.wait_for(3)
    assert rec.keys == [10_001, 10_002, 10_000]


# ---------------------------------------------------------------------------------- close


def test_close_stops_the_thread_and_pending_deadlines(
    make_timer: Callable[..., DeadlineTimer],
) -> None:
    rec = Recorder()
    timer = make_timer(rec)
    timer.schedule(time.monotonic() + 0.05, 1)
    thread = timer._thread
    assert thread is not None
    timer.close(TIMEOUT)
    assert not thread.is_alive()
    assert timer._heap == []
    assert not rec.wait_for(1, timeout=0.2)  # the deadline passes; nothing fires
    assert rec.keys == []


def test_schedule_after_close_is_ignored(make_timer: Callable[..., DeadlineTimer]) -> None:
    rec = Recorder()
    timer = make_timer(rec)
    timer.close(TIMEOUT)
    timer.schedule(time.monotonic() - 1.0, 1)
    assert timer._thread is None
    assert timer._heap == []
    timer.close(TIMEOUT)  # closing twice is fine


def test_close_from_on_expire_does_not_deadlock(
    make_timer: Callable[..., DeadlineTimer],
) -> None:
    rec = Recorder()
    holder: list[DeadlineTimer] = []
    closed = threading.Event()

    def on_expire(key: int) -> None:
        rec(key)
        holder[0].close(TIMEOUT)
        closed.set()

    holder.append(make_timer(on_expire))
    now = time.monotonic()
    holder[0].schedule(now + 0.01, 1)
    holder[0].schedule(now + 0.02, 2)
    assert closed.wait(TIMEOUT)
    thread = holder[0]._thread
    assert thread is not None
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    assert rec.keys == [1]


def test_close_of_an_idle_timer(make_timer: Callable[..., DeadlineTimer]) -> None:
    timer = make_timer(lambda key: None)
    timer.close(TIMEOUT)
    assert timer._thread is None
