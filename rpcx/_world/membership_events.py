"""Telling user code when the world's membership changes (:func:`rpcx.on_membership_change`).

The changes are seen where they happen: a joining worker is admitted on a transport's
thread, a lost one reported on a receiving thread, neither of which may run user code
(it may block, or make calls). So each change is queued, and one thread of this worker
runs the callbacks, in the order the changes happened, one at a time, with the worker
bound (a callback may call other workers). The thread starts on demand and ends when
idle; a callback that raises is logged and the others still run.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Literal

from rpcx.worker import WorkerInfo

__all__ = ["MembershipChange", "MembershipWatchers"]

log = logging.getLogger("rpcx.agent")

_IDLE_EXIT = 5.0  # seconds the delivering thread waits for more before it ends


@dataclasses.dataclass(frozen=True)
class MembershipChange:
    """One change to the world's membership, as this worker saw it.

    Attributes:
        kind: ``"joined"`` (a worker joined a dynamic world), ``"left"`` (it shut down,
            or its program ended without ``shutdown()``: the reason says which) or
            ``"lost"`` (it died, broke its connection, or stayed silent past
            ``heartbeat_timeout``).
        worker: the worker that joined, left or was lost.
        reason: for ``"left"`` and ``"lost"``, the sentence errors use (``"is
            unreachable: closed its connection ..."``); empty for ``"joined"``.
        members: the workers of the world just after the change, by rank (a static
            world keeps a lost worker in it, as torch's does).
    """

    kind: Literal["joined", "left", "lost"]
    worker: WorkerInfo
    reason: str
    members: tuple[WorkerInfo, ...]


Callback = Callable[[MembershipChange], object]


class MembershipWatchers:
    """The callbacks registered on one worker, and the thread that runs them.

    ``bind`` runs first on the delivering thread (it binds the worker's agent to it).
    """

    def __init__(self, name: str, bind: Callable[[], None]) -> None:
        self._name = name
        self._bind = bind
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._callbacks: list[Callback] = []
        self._queue: collections.deque[MembershipChange] = collections.deque()
        self._running = False
        self._closed = False
        self._gone: set[int] = set()  # ranks whose departure or loss was told

    def add(self, callback: Callback) -> Callable[[], None]:
        """Run ``callback`` on every change from now on; the function that stops it."""
        with self._lock:
            self._callbacks.append(callback)

        def remove() -> None:
            with self._lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)

        return remove

    def joined(self, worker: WorkerInfo, members: tuple[WorkerInfo, ...]) -> None:
        """``worker`` joined; ``members``: the world now."""
        self._queue_change(MembershipChange("joined", worker, "", members))

    def gone(self, rank: int, worker: WorkerInfo, departed: bool, reason: str,
             members: tuple[WorkerInfo, ...]) -> bool:
        """Worker ``rank`` left (``departed``) or was lost, for ``reason``; whether this
        is the first word of it (transports may report one loss several times)."""
        with self._lock:
            if rank in self._gone:
                return False
            self._gone.add(rank)
        self._queue_change(MembershipChange("left" if departed else "lost", worker, reason,
                                            members))
        return True

    def rank_reused(self, rank: int) -> None:
        """A new worker took ``rank``: its own departure will be news."""
        with self._lock:
            self._gone.discard(rank)

    def _queue_change(self, change: MembershipChange) -> None:
        """Queue ``change`` for the callbacks (returns at once; any thread)."""
        with self._lock:
            if self._closed or not self._callbacks:
                return
            self._queue.append(change)
            if self._running:
                self._ready.notify()
                return
            self._running = True
        threading.Thread(target=self._deliver, name=f"rpcx-membership-{self._name}",
                         daemon=True).start()

    def close(self) -> None:
        """Deliver nothing more (the worker shuts down); a callback running finishes."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._ready.notify()

    def _deliver(self) -> None:
        self._bind()
        while True:
            with self._lock:
                if not self._queue and not self._closed:
                    self._ready.wait(_IDLE_EXIT)
                if not self._queue:
                    self._running = False
                    return
                change = self._queue.popleft()
                callbacks = list(self._callbacks)
            for callback in callbacks:
                try:
                    callback(change)
                except Exception:  # one callback's failure is not the others'
                    log.exception("%s: a membership callback (%r) raised on %s %r",
                                  self._name, callback, change.kind, change.worker.name)
