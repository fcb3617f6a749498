"""A few threads that connect an on-demand mesh's pairs.

The first frame to a peer an on-demand mesh has not connected yet must not wait for the
connection (``rpc_async`` returns at once), so something else connects it. A thread per
connecting pair was the first answer, and on a crowded host the wrong one: starting a
thread waits until the new thread has run (``threading.Thread.start``), and a worker
that calls every other worker of a 64-worker world on 2 cores waited 30-50 ms for each
of 63 starts (measured 2026-11-29: 2.5 s of its all-to-all). A :class:`Connector` runs
the connecting jobs of a whole transport on at most ``limit`` threads, so a sender waits
for ``limit`` thread starts at most, in a burst of first sends. Idle threads end.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

__all__ = ["Connector"]

log = logging.getLogger("rpcx.transport_kit")

IDLE_S = 5.0  # a thread with nothing to do for this long ends (the next job starts one)


class Connector:
    """Runs jobs (connect this pair, check on that one later) on at most ``limit``
    threads named ``name``; a job may be due later (:meth:`submit`'s ``at``)."""

    def __init__(self, name: str, limit: int = 4) -> None:
        self._name = name
        self._limit = max(1, limit)
        self._jobs: list[tuple[float, int, Callable[[], None]]] = []  # a heap, by due time
        self._order = itertools.count()  # (jobs due at the same time run in order)
        self._changed = threading.Condition()
        self._threads = 0  # running (or being started)
        self._idle = 0  # of those, waiting for a job
        self._closed = False

    def submit(self, job: Callable[[], None], at: float = 0.0) -> bool:
        """Run ``job`` on a connector thread, once ``time.monotonic()`` reaches ``at``
        (0: now). Starts a thread (and waits for it to run) when more jobs are due than
        threads wait for one, and fewer than ``limit`` run. ``False`` after
        :meth:`close` (the job is dropped); ``RuntimeError`` when no thread runs and
        none can be started (it is not run; jobs queued meanwhile run once a later
        ``submit`` starts one)."""
        with self._changed:
            if self._closed:
                return False
            now = time.monotonic()
            entry = (at, next(self._order), job)
            heapq.heappush(self._jobs, entry)
            self._changed.notify()
            # (Counted, not "is one idle": a woken thread leaves the idle count only
            # once it runs, and a burst of first sends must not all queue on it.)
            due = sum(1 for when, _, _ in self._jobs if when <= now)
            grow = at <= now and due > self._idle and self._threads < self._limit
            if grow:
                self._threads += 1
        if grow and not self._start_thread():
            with self._changed:
                if self._threads > 0:  # (one that runs takes the job)
                    return True
                if entry in self._jobs:
                    self._jobs.remove(entry)
                    heapq.heapify(self._jobs)
            raise RuntimeError(f"{self._name}: could not start a thread to connect with")
        return True

    def close(self) -> list[Callable[[], None]]:
        """Run no more jobs; those running finish (each is bounded), and the threads
        end. Returns the jobs not begun, in order (dropped: the caller may run them)."""
        with self._changed:
            self._closed = True
            dropped = [job for _, _, job in sorted(self._jobs)]
            self._jobs.clear()
            self._changed.notify_all()
        return dropped

    @property
    def threads(self) -> int:
        """How many threads run now (for tests)."""
        return self._threads

    def _start_thread(self) -> bool:
        try:
            threading.Thread(target=self._run, name=self._name, daemon=True).start()
        except RuntimeError as exc:  # (a crowded host: no thread to be had)
            with self._changed:
                self._threads -= 1
            log.warning("%s: could not start a thread: %s", self._name, exc)
            return False
        return True

    def _next_job(self) -> Callable[[], None] | None:
        """(Under the lock.) The next job due, waiting for it; ``None``: end the thread
        (closed, or idle too long)."""
        while not self._closed:
            now = time.monotonic()
            if self._jobs and self._jobs[0][0] <= now:
                return heapq.heappop(self._jobs)[2]
            wait = self._jobs[0][0] - now if self._jobs else IDLE_S
            self._idle += 1
            try:
                woken = self._changed.wait(wait)
            finally:
                self._idle -= 1
            if not woken and not self._jobs:
                break
        self._threads -= 1
        return None

    def _run(self) -> None:
        while True:
            with self._changed:
                job = self._next_job()
                if job is None:
                    return
            try:
                job()
            except Exception:
                log.exception("%s: a connecting job failed", self._name)
            except BaseException:  # (the thread ends: it is no longer counted)
                with self._changed:
                    self._threads -= 1
                raise
