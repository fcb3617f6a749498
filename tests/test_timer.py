"""Unit tests for rpcx._util.timer.DeadlineTimer, the one-thread-per-agent deadline scheduler.

The contract tested here is the code's: every scheduled key whose deadline passes is
handed to ``on_expire``, live or not (the caller ignores keys that already completed);
``is_live`` is only consulted to compact the heap. Every wait is bounded.

These tests must hold on a loaded machine, where a thread can stall for a long while
between two lines. So an order is never set up by racing the clock: a test that needs
several keys pending at once first parks the timer thread in a gate key's ``on_expire``
(:class:`Gate`), schedules while it is parked, then lets it go. Lateness is bounded
generously (``LATE``), but bounded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rpcx._util.timer import _COMPACT_MIN, DeadlineTimer, within

TIMEOUT = 10.0
LATE = 4.0  # how late a deadline may fire on a loaded machine; a 10x slow timer fails
GATE_KEY = -1


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


class Gate:
    """Wraps an on_expire: the timer thread blocks on ``GATE_KEY`` until ``open()``."""

    def __init__(self, on_expire: Callable[[int], None]) -> None:
        self._on_expire = on_expire
        self.parked = threading.Event()
        self._open = threading.Event()

    def __call__(self, key: int) -> None:
        if key == GATE_KEY:
            self.parked.set()
            assert self._open.wait(TIMEOUT), "the test never opened the gate"
            return
        self._on_expire(key)

    def park(self, timer: DeadlineTimer) -> None:
        """Schedule the gate key now and wait until the timer thread is blocked on it."""
        timer.schedule(time.monotonic() - 1.0, GATE_KEY)
        assert self.parked.wait(TIMEOUT), "the timer never expired the gate key"

    def open(self) -> None:
        self._open.set()


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
    gate = Gate(rec)
    timer = make_timer(gate)
    gate.park(timer)  # all five are pending before any can fire
    now = time.monotonic()
    deadlines = {1: now + 0.05, 2: now + 0.01, 3: now + 0.03, 4: now + 0.02, 5: now + 0.04}
    for key, deadline in deadlines.items():
        timer.schedule(deadline, key)
    gate.open()
    assert rec.wait_for(5)
    assert rec.keys == [2, 4, 3, 5, 1]
    for key, fired_at in zip(rec.keys, rec.times, strict=True):
        assert fired_at >= deadlines[key]


def test_fires_on_time(make_timer: Callable[..., DeadlineTimer]) -> None:
    # Not early, and not late by more than LATE: a deadline half a second away.
    rec = Recorder()
    timer = make_timer(rec)
    deadline = time.monotonic() + 0.5
    timer.schedule(deadline, 1)
    assert rec.wait_for(1, timeout=0.5 + LATE + 1.0), "the deadline never fired"
    assert deadline <= rec.times[0] < deadline + LATE, rec.times[0] - deadline


def test_a_sooner_deadline_fires_on_time_behind_a_later_one(
    make_timer: Callable[..., DeadlineTimer],
) -> None:
    # The thread sleeps toward a deadline 0.5 s away; one due sooner must still fire
    # on time, and the first must not be late either.
    rec = Recorder()
    timer = make_timer(rec)
    first = time.monotonic() + 0.5
    timer.schedule(first, 1)
    second = time.monotonic() + 0.2
    timer.schedule(second, 2)
    assert rec.wait_for(2, timeout=0.5 + LATE + 1.0)
    assert rec.keys == [2, 1]
    assert second <= rec.times[0] < second + LATE
    assert first <= rec.times[1] < first + LATE


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
    gate = Gate(rec)
    live = {10_000, 10_001, 10_002}
    timer = make_timer(gate, is_live=live.__contains__)
    gate.park(timer)  # nothing fires while the 2048 pushes run, however slow they are
    now = time.monotonic()
    timer.schedule(now + 0.03, 10_000)
    timer.schedule(now + 0.01, 10_001)
    for key in range(2 * _COMPACT_MIN):  # dead keys, far away: compacted out
        timer.schedule(now + 3600.0, key)
    timer.schedule(now + 0.02, 10_002)
    assert len(timer._heap) < _COMPACT_MIN + 4
    gate.open()
    assert rec.wait_for(3)
    assert rec.keys == [10_001, 10_002, 10_000]


# ---------------------------------------------------------------------------------- close


def test_close_stops_the_thread_and_pending_deadlines(
    make_timer: Callable[..., DeadlineTimer],
) -> None:
    rec = Recorder()
    timer = make_timer(rec)
    deadline = time.monotonic() + 0.3
    timer.schedule(deadline, 1)
    thread = timer._thread
    assert thread is not None
    timer.close(TIMEOUT)
    closed_at = time.monotonic()
    assert not thread.is_alive()
    assert timer._heap == []
    if closed_at >= deadline:  # the machine stalled for the whole 0.3 s: inconclusive
        pytest.skip("closing took longer than the deadline on this (loaded) machine")
    # Wait until well after the deadline: nothing fires.
    assert not rec.wait_for(1, timeout=deadline - time.monotonic() + 0.3)
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


def test_within_cuts_a_steps_bound_to_the_time_left() -> None:
    assert within(5.0, None) == 5.0  # no larger budget: the step's own bound
    assert within(5.0, 2.0) == 2.0
    assert within(5.0, -1.0) == 0.0  # the budget is spent: never negative
    assert within(None, 3.0) == 3.0  # a step without a bound of its own
    assert within(None, None) is None
