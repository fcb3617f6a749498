"""The messages an RRef costs on the hot paths, pinned (rpcx.rref, rpcx._services.rref_*).

* A proxy call (``rref.rpc_sync().m()``) is one ``RREF_CALL`` request: no function to
  pickle, and the owner runs the method without a future when the value exists.
* ``remote().to_here()`` is a ``REMOTE_CALL`` and an ``RREF_FETCH``: the deletion of the
  reference rides in the next frame to the owner, never alone while frames flow.
* An owner drops a freed value that runs no code on going (a number, a plain tensor) on
  the thread that freed it, without a hand-off to the completion lane.
* A fork's confirmation makes no ``threading.Event`` unless a thread waits for it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import rpcx
from rpcx._core import context as _context
from rpcx._services.rref_fork import ForkState
from rpcx._services.rref_protocol import RRefService, _inert
from rpcx._wire.codec import decode_envelope
from rpcx.messages import MessageKind
from rpcx.testing.world import world
from rpcx.worker import WorkerInfo

TIMEOUT = 10.0


class Counter:
    def __init__(self, delay: float = 0.0) -> None:
        time.sleep(delay)  # a slow constructor: proxies arrive before the value exists
        self.n = 0

    def m(self, by: int = 1) -> int:
        self.n += by
        return self.n


def add(a: int, b: int) -> int:
    return a + b


@pytest.fixture(scope="module")
def pair() -> Iterator[None]:
    with world("loopback", size=2):
        yield


_SENDS: list[Any] = []  # the driver's transmit function while counting


def _count_sent() -> collections.Counter[int]:
    """Frames the driver sends from now on, by message kind (its transport's view)."""
    calls = _context.current_agent()._calls  # type: ignore[attr-defined]
    sent: collections.Counter[int] = collections.Counter()
    send = calls._transmit_frame
    _SENDS.append(send)

    def counting(dst: int, frame: Any) -> None:
        sent[decode_envelope(frame)[0]] += 1
        send(dst, frame)

    calls._transmit_frame = counting
    return sent


def _stop_counting() -> None:
    calls = _context.current_agent()._calls  # type: ignore[attr-defined]
    calls._transmit_frame = _SENDS.pop()


def test_a_proxy_call_is_one_rref_call_request(pair: None) -> None:
    rref = rpcx.remote("worker1", Counter)
    assert rref.rpc_sync().m() == 1
    sent = _count_sent()
    try:
        for i in range(20):
            assert rref.rpc_sync().m(by=2) == 1 + 2 * (i + 1)
        assert rref.rpc_async().m().wait() == 42
    finally:
        _stop_counting()
    assert sent[MessageKind.RREF_CALL] == 21
    assert sent[MessageKind.CALL] == 0
    assert sum(sent.values()) - sent[MessageKind.RREF_DELETE] == 21


def test_a_proxy_call_before_the_value_exists_waits_for_it(pair: None) -> None:
    rref = rpcx.remote("worker1", Counter, args=(0.3,))
    assert rref.rpc_sync().m() == 1  # sent while the constructor still runs
    assert rref.to_here().n == 1


def test_a_proxy_call_of_a_missing_method_fails_with_its_error(pair: None) -> None:
    rref = rpcx.remote("worker1", Counter)
    with pytest.raises(AttributeError, match="nope"):
        rref.rpc_sync().nope()
    assert rref.rpc_sync().m() == 1  # the value is unharmed


def test_remote_then_to_here_is_two_requests(pair: None) -> None:
    rpcx.remote("worker1", add, args=(1, 2)).to_here()
    sent = _count_sent()
    try:
        for i in range(30):
            assert rpcx.remote("worker1", add, args=(i, 1)).to_here() == i + 1
    finally:
        _stop_counting()
    assert sent[MessageKind.REMOTE_CALL] == 30
    assert sent[MessageKind.RREF_FETCH] == 30
    # Deletions ride in the next frame to the owner; at most the last ones go alone.
    assert sent[MessageKind.RREF_DELETE] <= 2
    assert sum(sent.values()) - sent[MessageKind.RREF_DELETE] == 60


# ------------------------------------------------------------------- owner side


class _StubAgent:
    def __init__(self) -> None:
        self.rank = 0
        self.name = "w0"
        self.workers = [WorkerInfo(f"w{i}", i) for i in range(2)]
        self.lossy = False
        self.incarnation = 0
        self.lane: list[Any] = []  # what call_soon was handed

    def call_soon(self, fn: Any, *args: Any) -> None:
        self.lane.append(fn)
        fn(*args)


class _Noisy:
    deleted = 0

    def __del__(self) -> None:
        _Noisy.deleted += 1


def _owned(svc: RRefService, value: Any) -> tuple[Any, Any]:
    rref_id, fork = svc.create_local(value)
    return rref_id, fork


def test_inert_values_are_freed_where_they_go_others_on_the_lane() -> None:
    agent = _StubAgent()
    svc = RRefService(agent)  # type: ignore[arg-type]
    try:
        inert: tuple[Any, ...] = (3, 2.5, "s", b"b", None, torch.ones(2))
        for value in inert:
            svc.remove_forks([_owned(svc, value)])
        assert agent.lane == []
        assert svc.stats()["owned"] == 0
        others: tuple[Any, ...] = (_Noisy(), torch.ones(2, requires_grad=True) * 2, [1])
        for value in others:
            svc.remove_forks([_owned(svc, value)])
        del others, value  # the lane dropped the owner's references
        assert len(agent.lane) == 3
        assert _Noisy.deleted == 1
        assert svc.stats()["owned"] == 0
    finally:
        svc.close()


def test_inert() -> None:
    def done(value: Any) -> torch.futures.Future[Any]:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(value)
        return future

    failed: torch.futures.Future[Any] = torch.futures.Future()
    failed.set_exception(ValueError("x"))
    assert _inert(done(1)) and _inert(done(torch.zeros(1)))
    assert _inert(torch.futures.Future())  # never created: nothing to drop
    assert not _inert(done(torch.nn.Parameter(torch.zeros(1))))
    assert not _inert(done(torch.zeros(1, requires_grad=True) + 1))
    assert not _inert(done({"a": 1}))
    assert not _inert(failed)


# ------------------------------------------------------------------ fork state


def _state(confirmed: bool) -> ForkState:
    return ForkState((1, 1), WorkerInfo("w1", 1), (0, 2), confirmed)


def test_a_fork_state_makes_no_event_until_a_thread_waits() -> None:
    state = _state(confirmed=False)
    state.confirm()
    assert state.wait_settled(0) and state.wait(0) and state.confirmed
    assert state._event is None
    assert _state(confirmed=True).wait(0)


def _wait_blocked(state: ForkState, waiter: threading.Thread) -> None:
    """Return once ``waiter`` blocks in ``state``'s event (bounded by TIMEOUT)."""
    deadline = time.monotonic() + TIMEOUT
    event = state._event
    assert event is not None  # (made by the first wait_settled)
    while not event._cond._waiters:  # type: ignore[attr-defined]  # (CPython's Event)
        assert waiter.is_alive() and time.monotonic() < deadline, "the waiter never waited"
        waiter.join(0.001)  # (a bounded pause on the waiter itself)


def test_a_waiter_is_woken_by_a_later_confirmation_or_give_up() -> None:
    for settle, confirmed in ((ForkState.confirm, True), (ForkState.give_up, False)):
        state = _state(confirmed=False)
        assert not state.wait_settled(0.01)  # times out, unsettled
        results: list[bool] = []
        waiter = threading.Thread(
            target=lambda s=state, out=results: out.append(s.wait(TIMEOUT))
        )
        waiter.start()
        _wait_blocked(state, waiter)
        settle(state)
        waiter.join(TIMEOUT)
        assert results == [confirmed]
        assert state.settled and state.confirmed is confirmed
