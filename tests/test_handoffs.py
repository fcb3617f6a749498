"""Check-then-act races where one thread hands work to another, each forced open.

Each test stops a thread inside the window between a check and the act that relies on
it (with a patched lock or function, never a sleep) and makes the other thread act
there. Before the fixes each of these lost work: an item queued behind a closed pool's
stop markers, a call registered after shutdown cancelled the pending ones, a user
callback run on the thread that delivers replies. (tensorpipe's inbox race is in
test_tensorpipe.py.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

import rpcx
import rpcx._core.call_path
from rpcx._core import context as _context
from rpcx._util.pool import WorkerPool
from rpcx.errors import RpcShutdownError
from rpcx.testing.world import World, start_world

TIMEOUT = 10.0


class _ShutdownOnEnter:
    """A stand-in for the pool's lock that closes the pool just before one acquisition."""

    def __init__(self, pool: WorkerPool) -> None:
        self._lock = threading.Lock()
        self._pool = pool
        self.trigger: threading.Thread | None = None

    def __enter__(self) -> None:
        if self.trigger is threading.current_thread():
            self.trigger = None
            closer = threading.Thread(target=self._pool.shutdown, args=(0.2,))
            closer.start()
            closer.join(TIMEOUT)
            assert not closer.is_alive()
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_work_submitted_while_the_pool_closes_is_refused_or_run() -> None:
    pool = WorkerPool(1, "handoff-pool", lambda: None)
    busy, release = threading.Event(), threading.Event()
    pool.submit(lambda: (busy.set(), release.wait(TIMEOUT)))
    assert busy.wait(TIMEOUT)  # the pool's one thread is busy: shutdown cannot join it
    lock = _ShutdownOnEnter(pool)
    pool._lock = lock  # type: ignore[assignment]
    ran = threading.Event()
    lock.trigger = threading.current_thread()
    try:
        pool.submit(ran.set)  # the pool closes between submit's check and its queueing
        refused = False
    except RpcShutdownError:
        refused = True
    finally:
        release.set()
    assert refused or ran.wait(TIMEOUT), "accepted after shutdown, and never run"


@pytest.fixture
def loopback_pair() -> Iterator[World]:
    world = start_world("loopback", 2, rpc_timeout=TIMEOUT)
    try:
        yield world
    finally:
        world.close()


def test_a_call_made_while_the_agent_closes_fails_instead_of_hanging(
    loopback_pair: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = _context.current_agent()
    real_encode = rpcx._core.call_path.encode

    def encode_then_close(*args: Any, **kwargs: Any) -> Any:
        frame = real_encode(*args, **kwargs)
        monkeypatch.setattr(rpcx._core.call_path, "encode", real_encode)
        # The agent closes after request() checked its state, before it registers the
        # call: the cancellation of pending calls must not miss it.
        closer = threading.Thread(target=agent.shutdown, kwargs={"graceful": False})
        closer.start()
        closer.join(TIMEOUT)
        assert not closer.is_alive()
        return frame

    monkeypatch.setattr(rpcx._core.call_path, "encode", encode_then_close)
    with pytest.raises(RpcShutdownError, match="has shut down"):
        future = rpcx.rpc_async("worker1", max, args=(1, 2), timeout=0)  # no deadline
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        assert done.wait(TIMEOUT), "the call was never completed"
        future.wait()


_gate = threading.Event()


def _held_echo(value: int) -> int:
    assert _gate.wait(TIMEOUT)
    return value


def test_a_callback_attached_while_a_reply_completes_inline_runs_on_the_lane(
    loopback_pair: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_settle_inline = rpcx._core.call_path.settle_inline
    settled_on: list[threading.Thread] = []
    ran_on: list[threading.Thread] = []
    ran = threading.Event()

    def callback(_: Any) -> None:
        ran_on.append(threading.current_thread())
        ran.set()

    def attach_then_settle(future: Any, *args: Any) -> None:
        # The agent decided to complete here (nobody had attached a callback); one is
        # attached before the completion itself.
        settled_on.append(threading.current_thread())
        future.add_done_callback(callback)
        real_settle_inline(future, *args)

    monkeypatch.setattr(rpcx._core.call_path, "settle_inline", attach_then_settle)
    _gate.clear()
    future = rpcx.rpc_async("worker1", _held_echo, args=(7,))
    future.has_waiter = True  # as if a thread already waited: the inline path
    _gate.set()
    assert future.wait() == 7
    assert ran.wait(TIMEOUT) and settled_on
    assert ran_on[0] is not settled_on[0]
    assert "-done-" in ran_on[0].name  # the agent's completion lane
