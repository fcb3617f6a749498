"""rpcx._budget.PeerBudget: bytes in flight per peer, capped; waits bounded."""

from __future__ import annotations

import threading
import time

from rpcx._budget import PeerBudget

BOUND = 10.0


def never() -> bool:
    return False


def test_calls_fit_until_the_limit_then_wait_within_their_timeout() -> None:
    budget = PeerBudget(world_size=2, limit=100)
    assert budget.take(1, 60, None, never) and budget.take(1, 40, None, never)
    started = time.monotonic()
    assert not budget.take(1, 1, 0.2, never)  # full: waits its timeout, then gives up
    assert time.monotonic() - started >= 0.2
    assert budget.take(0, 100, 0, never)  # another peer has its own budget
    assert budget.in_flight(1) == 100 and budget.waits == 1


def test_room_made_by_an_answer_lets_a_waiting_call_go() -> None:
    budget = PeerBudget(world_size=2, limit=100)
    budget.take(1, 100, None, never)
    took: list[bool] = []
    waiter = threading.Thread(target=lambda: took.append(budget.take(1, 50, BOUND, never)))
    waiter.start()
    assert budget.wait_for_waiting(1, BOUND)
    budget.give(1, 100)
    waiter.join(BOUND)
    assert took == [True] and budget.in_flight(1) == 50


def test_a_call_larger_than_the_limit_goes_alone() -> None:
    budget = PeerBudget(world_size=2, limit=100)
    assert budget.take(1, 500, 0, never)  # nothing else in flight: it may go
    assert not budget.take(1, 1, 0, never)
    budget.give(1, 500)
    assert budget.take(1, 1, 0, never)


def test_a_waiter_gives_up_when_woken_for_a_reason() -> None:
    budget = PeerBudget(world_size=2, limit=10)
    budget.take(1, 10, None, never)
    lost = threading.Event()
    took: list[bool] = []
    waiter = threading.Thread(target=lambda: took.append(budget.take(1, 5, None, lost.is_set)))
    waiter.start()
    assert budget.wait_for_waiting(1, BOUND)
    lost.set()
    budget.wake()
    waiter.join(BOUND)
    assert took == [False] and budget.in_flight(1) == 10
