"""A bounded, elastic thread pool for incoming requests.

Threads start on demand, up to ``size``. While a pool thread blocks on a nested call
(:meth:`WorkerPool.blocking`), the bound grows by one, so a chain of nested calls longer
than the pool cannot deadlock it (torch's RPC deadlocks there). Threads above the bound
retire once they finish their current item.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol

from rpcx.errors import RpcShutdownError

__all__ = ["Blocker", "WorkerPool", "blocker", "blocking", "current_pool"]

log = logging.getLogger("rpcx.pool")

_STOP = None


class Blocker(Protocol):
    """What a thread serves (a pool, a receive lane): told when the thread will block."""

    def blocking(self) -> AbstractContextManager[None]:
        """Entered around a wait that may block the calling thread."""


class _Local(threading.local):
    pool: WorkerPool | None = None  # the pool this thread belongs to
    blocker: Blocker | None = None  # told when this thread blocks (its pool, or a lane)


_local = _Local()


def current_pool() -> WorkerPool | None:
    """The pool the calling thread belongs to, if any."""
    return _local.pool


def blocking() -> AbstractContextManager[None]:
    """Enter around every wait in rpcx that may block: the thread's pool can then grow
    by one, or the receive lane it serves on hands receiving to another thread."""
    current = _local.blocker
    return current.blocking() if current is not None else nullcontext()


@contextmanager
def holding(lock: threading.Lock | threading.RLock) -> Iterator[None]:
    """``with lock:``, telling the thread's blocker (see :func:`blocking`) when the lock
    is taken and the thread has to wait for it."""
    if not lock.acquire(blocking=False):
        with blocking():
            lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextmanager
def blocker(what: Blocker) -> Iterator[None]:
    """Make ``what`` the calling thread's blocker inside the block."""
    outer, _local.blocker = _local.blocker, what
    try:
        yield
    finally:
        _local.blocker = outer


class WorkerPool:
    """Runs submitted callables on at most ``size`` threads plus one per blocked thread."""

    def __init__(self, size: int, name: str, on_thread_start: Callable[[], None]) -> None:
        self._size = size
        self._name = name
        self._on_thread_start = on_thread_start
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._queued = 0  # items in the queue not yet taken by a thread
        self._waiting = 0  # threads blocked in queue.get()
        self._threads: set[threading.Thread] = set()
        self._blocked = 0
        self._spawned = 0
        self._closed = False

    @property
    def thread_count(self) -> int:
        """How many threads the pool has now."""
        return len(self._threads)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a pool thread. Exceptions are logged, not raised."""
        with self._lock:
            # Checked under the lock shutdown() takes to close the pool: an item queued
            # behind the threads' stop markers would never run.
            if self._closed:
                raise RpcShutdownError(f"{self._name}: the request pool has shut down")
            self._queued += 1
            self._queue.put((fn, args))
            self._spawn_if_needed_locked()

    @contextmanager
    def blocking(self) -> Iterator[None]:
        """Mark the calling pool thread as blocked on a nested call while inside the block."""
        with self._lock:
            self._blocked += 1
            self._spawn_if_needed_locked()
        try:
            yield
        finally:
            with self._lock:
                self._blocked -= 1

    def shutdown(self, timeout: float) -> None:
        """Stop accepting work, let running items finish, and join threads for ``timeout`` s."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(_STOP)
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        for thread in threads:
            if thread is not me:
                thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive() and t is not me]
        if stuck:
            log.warning("%s: %d request threads still busy after %.1f s: %s",
                        self._name, len(stuck), timeout, ", ".join(stuck))

    def _spawn_if_needed_locked(self) -> None:
        # Every queued item needs a thread that is waiting for work; start one more if
        # there are fewer, within the bound (size, plus one per blocked thread).
        if self._queued > self._waiting and len(self._threads) < self._size + self._blocked:
            self._spawn_locked()

    def _spawn_locked(self) -> None:
        self._spawned += 1
        thread = threading.Thread(
            target=self._run, name=f"{self._name}-{self._spawned}", daemon=True
        )
        self._threads.add(thread)
        thread.start()

    def _run(self) -> None:
        _local.pool = self
        _local.blocker = self
        self._on_thread_start()
        me = threading.current_thread()
        while True:
            with self._lock:
                self._waiting += 1
            item = self._queue.get()
            with self._lock:
                self._waiting -= 1
                if item is not _STOP:
                    self._queued -= 1
            if item is _STOP:
                break
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # a handler bug must not kill the thread silently
                log.exception("%s: unhandled error in request handler", self._name)
            del item, fn, args
            with self._lock:
                if not self._closed and len(self._threads) > self._size + self._blocked:
                    self._threads.discard(me)  # a compensating thread no longer needed
                    return
        with self._lock:
            self._threads.discard(me)
