"""rpcx._core.heartbeat on its own: pings for quiet peers, one report per silence, recovery.

Real time with short intervals; every wait is on an event the callbacks set, bounded.
"""

from __future__ import annotations

import logging
import threading

import pytest

from rpcx._core.heartbeat import Heartbeat

BOUND = 10.0
INTERVAL, TIMEOUT = 0.05, 0.25


class Recorder:
    def __init__(self) -> None:
        self.pinged: list[int] = []
        self.silent: list[tuple[int, float]] = []
        self.heard: list[tuple[int, float]] = []
        self.went_silent = threading.Event()
        self.came_back = threading.Event()

    def watch(self, peers: list[int]) -> Heartbeat:
        return Heartbeat("test", peers, 3, interval=INTERVAL, timeout=TIMEOUT,
                         ping=self.pinged.append, on_silent=self._silent,
                         on_heard=self._heard)

    def _silent(self, rank: int, quiet: float) -> None:
        self.silent.append((rank, quiet))
        self.went_silent.set()

    def _heard(self, rank: int, quiet: float) -> None:
        self.heard.append((rank, quiet))
        self.came_back.set()


def test_a_quiet_peer_is_pinged_then_reported_once_then_heard_again() -> None:
    seen = Recorder()
    watch = seen.watch([1, 2])
    keep_talking = threading.Event()

    def peer_two_talks() -> None:  # rank 2 sends a frame every 10 ms
        while not keep_talking.wait(0.01):
            watch.heard[2] += 1

    talker = threading.Thread(target=peer_two_talks, daemon=True)
    talker.start()
    watch.start()
    try:
        assert seen.went_silent.wait(BOUND)
        ((rank, quiet),) = seen.silent
        assert rank == 1 and TIMEOUT <= quiet < TIMEOUT + 1.0
        assert 1 in seen.pinged and 2 not in seen.pinged
        watch.heard[1] += 1  # a frame from rank 1 at last
        assert seen.came_back.wait(BOUND)
        assert seen.heard[0][0] == 1 and seen.heard[0][1] >= TIMEOUT
        assert [r for r, _ in seen.silent] == [1]  # reported once, rank 2 never
    finally:
        keep_talking.set()
        talker.join(BOUND)
        watch.close()


def test_a_forgotten_peer_is_neither_pinged_nor_reported() -> None:
    seen = Recorder()
    watch = seen.watch([1, 2])
    watch.forget(1)
    watch.start()
    try:
        assert seen.went_silent.wait(BOUND)
        assert [r for r, _ in seen.silent] == [2] and 1 not in seen.pinged
    finally:
        watch.close()


def test_close_ends_the_thread() -> None:
    watch = Recorder().watch([1])
    watch.start()
    watch.close()
    assert not watch._thread.is_alive()


# The watch's own clock, stepped by hand: deterministic, no waiting.
TICK = min(INTERVAL, TIMEOUT / 4)


def _stepped(seen: Recorder) -> Heartbeat:
    watch = seen.watch([1])
    watch._start_at(0.0)
    return watch


def test_time_this_worker_was_starved_is_not_a_peers_silence() -> None:
    seen = Recorder()
    watch = _stepped(seen)
    watch._step(TICK)
    watch._step(TICK + 30 * TIMEOUT)  # this thread did not run for 30 timeouts
    assert seen.silent == []  # the peer could not have been heard meanwhile either
    assert watch.stalled > 29 * TIMEOUT
    # From then on its silence counts again, and is reported after a timeout of running.
    now = TICK + 30 * TIMEOUT
    while not seen.silent:
        now += TICK
        watch._step(now)
        assert now < 40 * TIMEOUT, "never reported"
    ((rank, quiet),) = seen.silent
    assert rank == 1 and TIMEOUT <= quiet < TIMEOUT + 2 * TICK


def test_a_peer_silent_while_this_worker_runs_is_reported_after_the_timeout() -> None:
    seen = Recorder()
    watch = _stepped(seen)
    now = 0.0
    while not seen.silent:
        now += TICK  # on time, every tick
        watch._step(now)
    assert seen.silent == [(1, now)] and TIMEOUT <= now < TIMEOUT + TICK + 1e-9
    assert watch.stalled == 0.0
    assert 1 in seen.pinged  # pinged once quiet for an interval


def test_a_late_tick_within_one_tick_is_ordinary_jitter() -> None:
    seen = Recorder()
    watch = _stepped(seen)
    watch._step(1.9 * TICK)  # 0.9 tick late: scheduling jitter, counted as silence
    assert watch.stalled == 0.0


def test_a_peer_whose_process_runs_is_not_reported_until_it_stops(
        caplog: pytest.LogCaptureFixture) -> None:
    # The kernel vouches for the peer (its process runs, starved): not reported, logged
    # once with the evidence; once the process is stopped it is, on the next tick.
    seen = Recorder()
    evidence: list[str | None] = ["its process 4242 on this host is running (kernel state R)"]
    watch = Heartbeat("test", [1], 3, interval=INTERVAL, timeout=TIMEOUT,
                      ping=seen.pinged.append, on_silent=seen._silent, on_heard=seen._heard,
                      vouch=lambda rank: evidence[0])
    watch._start_at(0.0)
    now = 0.0
    with caplog.at_level(logging.INFO, logger="rpcx.heartbeat"):
        while now < 10 * TIMEOUT:
            now += TICK
            watch._step(now)
    assert seen.silent == []
    vouched = [r.getMessage() for r in caplog.records if "not lost" in r.getMessage()]
    assert len(vouched) == 1 and "process 4242" in vouched[0], vouched
    evidence[0] = None  # stopped (SIGSTOP), or gone
    watch._step(now + TICK)
    assert seen.silent == [(1, now + TICK)]


def test_a_vouch_that_fails_leaves_the_decision_to_the_silence() -> None:
    seen = Recorder()

    def broken(rank: int) -> str | None:
        raise OSError("no /proc here")

    watch = Heartbeat("test", [1], 3, interval=INTERVAL, timeout=TIMEOUT,
                      ping=seen.pinged.append, on_silent=seen._silent, on_heard=seen._heard,
                      vouch=broken)
    watch._start_at(0.0)
    now = 0.0
    while not seen.silent:
        now += TICK
        watch._step(now)
        assert now < 2 * TIMEOUT, "never reported"
    assert seen.silent == [(1, now)]


def test_a_peer_the_kernel_knows_is_asked_about_not_pinged(
        caplog: pytest.LogCaptureFixture) -> None:
    # On one host a quiet peer costs no frames: the kernel says whether its process runs,
    # and one that runs counts as heard from (nothing logged: quiet is not news). Once it
    # is stopped it is reported a timeout after the kernel last saw it run; then it is
    # pinged, since only a frame from it shows that it is back.
    seen = Recorder()
    evidence: list[str | None] = ["its process 4242 on this host is sleeping (kernel state S)"]
    asked: list[int] = []

    def vouch(rank: int) -> str | None:  # (rank 2 is on another host)
        asked.append(rank)
        return evidence[0] if rank == 1 else None

    watch = Heartbeat("test", [1, 2], 3, interval=INTERVAL, timeout=TIMEOUT,
                      ping=seen.pinged.append, on_silent=seen._silent, on_heard=seen._heard,
                      vouch=vouch, knows=lambda rank: rank == 1)
    watch._start_at(0.0)
    now = 0.0
    with caplog.at_level(logging.INFO, logger="rpcx.heartbeat"):
        while now < 10 * TIMEOUT:
            now += TICK
            watch._step(now)
    assert [r for r, _ in seen.silent] == [2]  # rank 2: pinged, never answered
    assert 1 not in seen.pinged and 2 in seen.pinged
    assert asked.count(1) >= 10 * TIMEOUT / INTERVAL / 2  # about once an interval
    assert not [r for r in caplog.records if "rank 1" in r.getMessage()]
    last_seen_running = now
    evidence[0] = None  # stopped (SIGSTOP), or gone
    while 1 not in [r for r, _ in seen.silent]:
        now += TICK
        watch._step(now)
        assert now - last_seen_running <= TIMEOUT + INTERVAL + TICK, "never reported"
    assert next(q for r, q in seen.silent if r == 1) >= TIMEOUT
    assert 1 not in seen.pinged
    for _ in range(3):
        now += TICK
        watch._step(now)
    assert seen.pinged.count(1) >= 1  # reported: pinged until a frame says it is back
    watch.heard[1] += 1
    watch._step(now + TICK)
    assert [r for r, _ in seen.heard] == [1]


def test_a_silent_peer_is_looked_at_more_often_until_heard_again() -> None:
    # Calls to a silent peer are refused until it is heard: once a partition heals, it
    # must be taken back as soon as a frame from it is counted, not a tick later. Its
    # pings keep their interval (more of them queue behind a cut link).
    seen = Recorder()
    watch = Heartbeat("test", [1], 3, interval=1.0, timeout=4.0, ping=seen.pinged.append,
                      on_silent=seen._silent, on_heard=seen._heard)
    watch._start_at(0.0)
    assert watch._next_wait() == 1.0
    now = 0.0
    while not seen.silent:
        now += watch._next_wait()
        watch._step(now)
        assert now < 10.0, "never reported"
    assert watch._next_wait() == pytest.approx(0.1)
    pings = len(seen.pinged)
    for _ in range(10):  # about a second of looks while it is silent
        now += watch._next_wait()
        watch._step(now)
    assert 0 <= len(seen.pinged) - pings <= 1  # still one ping an interval
    assert watch.stalled == 0.0  # the shorter waits are not taken for lateness
    watch.heard[1] += 1
    now += watch._next_wait()
    watch._step(now)
    assert [rank for rank, _ in seen.heard] == [1]
    assert watch._next_wait() == 1.0  # back to the usual tick
