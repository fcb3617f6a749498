"""One timer thread per agent for every call deadline.

Deadlines are cancelled lazily: an expiring key is handed to ``on_expire``, which ignores
keys that already completed. The heap is compacted when dead entries dominate, so memory
stays proportional to the calls actually pending.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable

__all__ = ["DeadlineTimer", "remaining", "within"]

log = logging.getLogger("rpcx.timer")

_COMPACT_MIN = 1024


def remaining(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value), never negative;
    ``None`` for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def within(bound: float | None, left: float | None) -> float | None:
    """A step's wait: its own ``bound``, cut to the ``left`` seconds of the larger wait it
    is part of (shutdown's budget, say). ``None`` is no bound; never negative."""
    if left is None:
        return bound
    left = max(0.0, left)
    return left if bound is None else min(bound, left)


class DeadlineTimer:
    """Calls ``on_expire(key)`` at or after each scheduled monotonic deadline."""

    def __init__(
        self,
        name: str,
        on_expire: Callable[[int], None],
        is_live: Callable[[int], bool],
        on_thread_start: Callable[[], None],
    ) -> None:
        self._name = name
        self._on_expire = on_expire
        self._is_live = is_live
        self._on_thread_start = on_thread_start
        self._heap: list[tuple[float, int]] = []
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._closed = False
        self._pushes_until_compaction = _COMPACT_MIN

    def schedule(self, deadline: float, key: int) -> None:
        """Expire ``key`` at ``deadline`` (a ``time.monotonic()`` value)."""
        with self._cond:
            if self._closed:
                return
            self._pushes_until_compaction -= 1
            if self._pushes_until_compaction <= 0:
                self._compact_locked()
            entry = (deadline, key)
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"{self._name}-timer", daemon=True
                )
                self._thread.start()
            elif self._heap[0] is entry:  # new earliest deadline: wake the thread early
                self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; deadlines not yet reached never fire."""
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _compact_locked(self) -> None:
        live = [entry for entry in self._heap if self._is_live(entry[1])]
        if len(live) < len(self._heap):
            heapq.heapify(live)
            self._heap = live
        self._pushes_until_compaction = max(_COMPACT_MIN, len(self._heap))

    def _run(self) -> None:
        self._on_thread_start()
        with self._cond:
            while not self._closed:
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, key = self._heap[0]
                delay = deadline - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                heapq.heappop(self._heap)
                self._cond.release()
                try:
                    self._on_expire(key)
                except BaseException:  # the timer must outlive any callback
                    log.exception("%s: error while expiring a deadline", self._name)
                finally:
                    self._cond.acquire()
