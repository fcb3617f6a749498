"""The membership callbacks' rules, without a world: order, one word per loss, a failing
callback, removal, and nothing after close."""

from __future__ import annotations

import logging
import queue
import threading

import pytest

from rpcx._world.membership_events import MembershipChange, MembershipWatchers
from rpcx.worker import WorkerInfo

BOUND = 10.0
A, B = WorkerInfo("a", 1), WorkerInfo("b", 2)


def _watchers(bound: list[str]) -> MembershipWatchers:
    return MembershipWatchers("w0", lambda: bound.append(threading.current_thread().name))


def test_changes_come_in_order_once_each_on_a_bound_thread() -> None:
    bound: list[str] = []
    watchers = _watchers(bound)
    seen: queue.Queue[MembershipChange] = queue.Queue()
    watchers.add(seen.put)
    watchers.joined(A, (A,))
    assert watchers.gone(1, A, False, "is unreachable: x", ())
    assert not watchers.gone(1, A, False, "is unreachable: y", ())  # reported twice
    watchers.rank_reused(1)
    watchers.joined(A, (A,))
    assert watchers.gone(1, A, True, "has shut down", ())
    kinds = [(c.kind, c.worker.name, c.reason) for c in
             (seen.get(timeout=BOUND) for _ in range(4))]
    assert kinds == [("joined", "a", ""), ("lost", "a", "is unreachable: x"),
                     ("joined", "a", ""), ("left", "a", "has shut down")]
    assert seen.empty()
    assert bound and all(name == "rpcx-membership-w0" for name in bound)
    watchers.close()


def test_a_failing_callback_is_logged_and_the_others_still_run(
        caplog: pytest.LogCaptureFixture) -> None:
    watchers = _watchers([])
    seen: queue.Queue[MembershipChange] = queue.Queue()

    def broken(change: MembershipChange) -> None:
        raise ValueError("boom")

    watchers.add(broken)
    watchers.add(seen.put)
    with caplog.at_level(logging.ERROR, "rpcx.agent"):
        watchers.joined(B, (B,))
        assert seen.get(timeout=BOUND).worker == B
    assert "a membership callback" in caplog.text and "boom" in caplog.text
    watchers.close()


def test_a_removed_callback_and_a_closed_worker_hear_nothing() -> None:
    watchers = _watchers([])
    seen: queue.Queue[MembershipChange] = queue.Queue()
    other: queue.Queue[MembershipChange] = queue.Queue()
    remove = watchers.add(seen.put)
    watchers.add(other.put)
    remove()
    watchers.joined(A, (A,))
    assert other.get(timeout=BOUND).worker == A
    watchers.close()
    watchers.joined(B, (A, B))
    # Nothing is queued for later delivery either: the change was dropped at once.
    assert not watchers._queue
    assert seen.empty() and other.empty()
