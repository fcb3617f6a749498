"""rpcx._core.budget.PeerBudget: bytes in flight per peer, capped; waits bounded. And the
agent's use of it: a call refused after it took its bytes gives them back."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import rpcx
from rpcx._core import context as _context
from rpcx._core.budget import PeerBudget
from rpcx.testing import remote
from rpcx.testing.world import world

BOUND = 10.0
MiB = 1 << 20


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


def test_a_call_refused_after_taking_its_bytes_gives_them_back() -> None:
    # A call counts its bytes first, then registers, and registering refuses a call to a
    # peer that is unresponsive (or lost). The bytes must go back: kept, they stayed in
    # flight for good, and every later call to the recovered worker that they left no
    # room for failed with "would pass max_bytes_in_flight".
    megabyte = torch.ones(MiB // 4)  # float32: 1 MiB; two do not fit in 1.5 MiB
    with world("loopback", size=2, max_bytes_in_flight=3 * MiB // 2):
        agent = _context.current_agent()
        # What the heartbeat reports (it does not run on loopback: threads cannot hang apart).
        agent._health.on_silent(1, 5.0)
        refused = rpcx.rpc_async("worker1", remote.tensor_sum, args=(megabyte,), timeout=BOUND)
        with pytest.raises(rpcx.PeerLostError, match="unresponsive"):
            refused.wait()
        assert rpcx.debug_info()["bytes_in_flight"] == {}
        agent._health.on_heard_again(1, 5.0)
        assert agent.wait_responsive(1, BOUND)
        for _ in range(2):
            assert rpcx.rpc_sync("worker1", remote.tensor_sum, args=(megabyte,),
                                 timeout=BOUND) == MiB // 4
        assert rpcx.debug_info()["bytes_in_flight"] == {}
