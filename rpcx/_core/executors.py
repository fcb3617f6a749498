"""The threads a worker runs calls on: request pool, completion lane, followers, timer.

* The **request pool** (bounded by ``num_worker_threads``, elastic past a handler that
  blocks) serves requests that no receiving thread serves itself.
* The **completion lane** completes futures, so user callbacks never run on a
  transport's receiving thread or the timer thread and never queue behind handlers.
* **Followers** take over a peer's receive loop when a request served on the receiving
  thread blocks (see :mod:`rpcx._core.lanes`).
* One **timer** fails calls whose deadline passes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from rpcx._core.lanes import LaneWatch, ReceiveLane
from rpcx._util.pool import WorkerPool
from rpcx._util.timer import DeadlineTimer
from rpcx.errors import RpcShutdownError

__all__ = ["Executors"]

_COMPLETION_THREADS = 16  # plus one per thread blocked in a callback (the pool grows)
# Followers: one per lane receiving plus one per request blocked on a lane; no real bound.
_FOLLOWERS = 1 << 16


class Executors:
    """A worker's pools and its timer.

    Args:
        name: the worker's name (threads are named ``rpcx-<name>-...``).
        request_threads: the request pool's size (``num_worker_threads``).
        bind_thread: run first on every thread started here (binds it to the worker).
        expire: the timer calls ``expire(rid)`` when call ``rid``'s deadline passes.
        is_pending: whether call ``rid`` still waits (the timer skips those that do not).
    """

    def __init__(self, name: str, request_threads: int, bind_thread: Callable[[], None],
                 expire: Callable[[int], None], is_pending: Callable[[int], bool]) -> None:
        self.name = name
        self.requests = WorkerPool(request_threads, f"rpcx-{name}-pool", bind_thread)
        self.completions = WorkerPool(_COMPLETION_THREADS, f"rpcx-{name}-done", bind_thread)
        self.timer = DeadlineTimer(f"rpcx-{name}", expire, is_pending, bind_thread)
        self.followers = WorkerPool(_FOLLOWERS, f"rpcx-{name}-recv", bind_thread)
        self.lane_watch = LaneWatch(f"rpcx-{name}")

    def new_lane(self, name: str, resume: Callable[[], None], owner: object) -> ReceiveLane:
        """A receive lane for one peer's loop (``TransportContext.receive_lane``)."""
        lane = ReceiveLane(name, resume, self._start_follower, owner=owner)
        self.lane_watch.add(lane)
        return lane

    def _start_follower(self, resume: Callable[[], None]) -> None:
        try:
            self.followers.submit(resume)
        except RpcShutdownError:  # closing: the loop must still run to its goodbye
            threading.Thread(target=resume, name=f"rpcx-{self.name}-recv-late",
                             daemon=True).start()

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` soon on the completion lane (here, once it has closed)."""
        try:
            self.completions.submit(fn, *args)
        except RpcShutdownError:
            fn(*args)

    def teardown(self) -> list[tuple[str, Callable[[float], None]]]:
        """The steps that stop these threads, in order, each taking a bound in seconds."""
        return [
            ("lane watch", self.lane_watch.close),
            ("request pool", self.requests.shutdown),
            ("followers", self.followers.shutdown),
            ("completion lane", self.completions.shutdown),
            ("timer", self.timer.close),
        ]
