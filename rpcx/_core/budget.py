"""Back-pressure: a cap on the bytes of requests a worker has in flight to each peer.

A request's bytes (its header and tensors) count from the moment it is sent until its
reply arrives, it times out or its peer is lost. A caller whose request would take a
peer past the cap waits, within the call's timeout, for earlier requests to that peer
to be answered. So a fast caller cannot bury a slow callee under queued requests: what
waits at the callee for a thread, per caller, is bounded by the cap.

One request larger than the cap is sent when nothing else is in flight to that peer
(it could never be sent otherwise). Waits end early if the peer is lost or the worker
shuts down (:meth:`PeerBudget.wake`): the call then fails for that reason.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from rpcx._core.pending import PendingCall
from rpcx._util.pool import blocking
from rpcx.errors import RpcTimeoutError
from rpcx.transport import Frame

__all__ = ["BackPressure", "BytesInFlight", "PeerBudget"]


class PeerBudget:
    """Bytes in flight per peer, at most ``limit`` each; thread-safe."""

    def __init__(self, world_size: int, limit: int) -> None:
        self.limit = limit
        self._in_flight = [0] * world_size
        self._cond = threading.Condition(threading.Lock())
        self.waits = 0  # requests that had to wait, for debug_info()
        self._waiting = 0  # requests waiting now

    def grow(self, size: int) -> None:
        """Budgets for ``size`` ranks (a worker joined a dynamic world)."""
        with self._cond:
            self._in_flight.extend([0] * (size - len(self._in_flight)))

    def in_flight(self, dst: int) -> int:
        """Bytes of requests to ``dst`` not answered yet."""
        return self._in_flight[dst]

    def try_take(self, dst: int, nbytes: int) -> bool:
        """Count ``nbytes`` to ``dst`` if they fit now; never waits."""
        with self._cond:
            if self._fits(dst, nbytes):
                self._in_flight[dst] += nbytes
                return True
            return False

    def take(self, dst: int, nbytes: int, timeout: float | None,
             give_up: Callable[[], bool]) -> bool:
        """Count ``nbytes`` to ``dst``, waiting at most ``timeout`` seconds (``None``:
        no bound) for room. False if there was none in time, or if ``give_up()`` says
        waiting is pointless (checked at first and after each :meth:`wake`)."""
        with self._cond:
            if self._fits(dst, nbytes):
                self._in_flight[dst] += nbytes
                return True
            self.waits += 1
            self._waiting += 1
            self._cond.notify_all()  # (for wait_for_waiting)
            try:
                deadline = None if timeout is None else time.monotonic() + timeout
                while not self._fits(dst, nbytes):
                    if give_up():
                        return False
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
                self._in_flight[dst] += nbytes
                return True
            finally:
                self._waiting -= 1

    def give(self, dst: int, nbytes: int) -> None:
        """``nbytes`` to ``dst`` are no longer in flight."""
        with self._cond:
            self._in_flight[dst] -= nbytes
            if self._waiting:
                self._cond.notify_all()

    def wait_for_waiting(self, count: int, timeout: float) -> bool:
        """Wait (at most ``timeout``) until ``count`` requests wait for room at once."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting >= count, timeout)

    def wake(self) -> None:
        """Make every waiter look again (a peer was lost, the worker shuts down)."""
        with self._cond:
            self._cond.notify_all()

    def _fits(self, dst: int, nbytes: int) -> bool:
        used = self._in_flight[dst]
        return used == 0 or used + nbytes <= self.limit


class BackPressure:
    """The call path's back-pressure policy; this default holds nothing back.

    The call path asks :meth:`admit` before it registers a request (never on a thread
    that delivers frames, never for rpcx's control messages), :meth:`give` back a
    completed request's bytes, and :meth:`wake` waiters when a peer is lost or the
    worker closes.
    """

    def admit(self, pending: PendingCall, frame: Frame,
              gone: Callable[[int], bool]) -> BaseException | None:
        """Count the bytes of request ``frame`` (``pending.nbytes``); the error to fail
        it with, if any. ``gone(rank)``: the peer is lost or this worker closed."""
        return None

    def give(self, dst: int, nbytes: int) -> None:
        """A request of ``nbytes`` to ``dst`` completed."""

    def wake(self) -> None:
        """Wake every waiter to look again (a peer was lost, or the worker closes)."""

    def grow(self, size: int) -> None:
        """The roster grew to ``size`` ranks (a worker joined a dynamic world)."""

    def report(self, names: list[str]) -> dict[str, Any]:
        """``bytes_in_flight`` (by peer name, where not zero) and ``calls_held_back``."""
        return {"bytes_in_flight": {}, "calls_held_back": 0}


class BytesInFlight(BackPressure):
    """Back-pressure on: at most ``limit`` bytes of requests in flight to each peer."""

    def __init__(self, world_size: int, limit: int) -> None:
        self.budget = PeerBudget(world_size, limit)

    def admit(self, pending: PendingCall, frame: Frame,
              gone: Callable[[int], bool]) -> BaseException | None:
        """Count the bytes, waiting within the call's timeout for room. A wait that ends
        because ``gone(rank)`` (the peer was lost, the worker closed) counts nothing and
        returns no error: registering the call then refuses it with the usual one."""
        budget, dst, nbytes, timeout = self.budget, pending.dst.id, frame.nbytes, pending.timeout
        if not budget.try_take(dst, nbytes):
            with blocking():  # (a request thread waiting here lets the pool grow)
                taken = budget.take(dst, nbytes, timeout, lambda: gone(dst))
            if not taken:
                return None if gone(dst) else RpcTimeoutError(
                    f"{pending.call} to worker {pending.dst.name!r}: not sent within its "
                    f"timeout ({timeout:g} s): {budget.in_flight(dst) / 2**20:.1f} MiB of "
                    f"calls to it are still unanswered, and this one "
                    f"({nbytes / 2**20:.1f} MiB) would pass max_bytes_in_flight "
                    f"({budget.limit / 2**20:.1f} MiB)")
        pending.nbytes = nbytes
        return None

    def give(self, dst: int, nbytes: int) -> None:
        """A request of ``nbytes`` to ``dst`` completed: room for others."""
        self.budget.give(dst, nbytes)

    def wake(self) -> None:
        """Wake every waiter to look again."""
        self.budget.wake()

    def grow(self, size: int) -> None:
        """Budgets for ``size`` ranks."""
        self.budget.grow(size)

    def report(self, names: list[str]) -> dict[str, Any]:
        """``bytes_in_flight`` (by peer name, where not zero) and ``calls_held_back``."""
        budget = self.budget
        return {"bytes_in_flight": {name: budget.in_flight(rank)
                                    for rank, name in enumerate(names) if budget.in_flight(rank)},
                "calls_held_back": budget.waits}
