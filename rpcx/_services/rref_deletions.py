"""The references a worker drops, on their way to their owners.

The half of the RRef lifetime protocol (:mod:`rpcx._services.rref_protocol`) that runs
on the holder's side after an ``RRef`` object dies:

* ``RRef.__del__`` may run on any thread, inside any lock, whenever the garbage
  collector chooses, so :meth:`Deletions.schedule` only appends to a deque (atomic,
  lock-free) and, if the deleter thread is not already due, posts a wake-up on a
  ``queue.SimpleQueue`` (whose ``put`` is reentrant).
* A deletion rides as a note in the next frame the worker sends its owner
  (:meth:`Deletions.notes_for`); the deleter thread sends, one way and batched per
  owner, what no frame took within ``_LINGER``.
* A deletion of an RRef whose fork announcements the owner has not answered yet is held
  back until they are (:meth:`Deletions.announcing`): the owner always hears of the
  child before the parent goes, even on a transport that resends lost frames late.
* Deletions are not acknowledged one by one: :meth:`Deletions.flush` (shutdown's drain)
  sends each owner that got some a request whose reply, in per-pair order,
  acknowledges all of them, and waits for every bookkeeping request in flight.

Correctness never depends on when deletions travel; only how soon memory is returned
does.
"""

from __future__ import annotations

import collections
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rpcx._core.service_host import CallLabel, ServiceHost
from rpcx._services.rref_fork import ForkId, RRefId
from rpcx.errors import PeerLostError, RpcError, RpcShutdownError
from rpcx.futures import add_internal_callback, wait_done
from rpcx.messages import MessageKind

__all__ = ["Deletions"]

log = logging.getLogger("rpcx.rref")

_FLUSH_ROUNDS = 8  # a flush goes round again while deletions come in, at most this often
_LINGER = 0.01  # seconds a deletion waits for a frame to ride on before going alone

# A deletion: (the owner's rank, the RRef, the fork that is gone).
Deletion = tuple[int, RRefId, ForkId]


class Deletions:
    """One worker's deletions of references to values other workers (or it) own.

    Args:
        agent: the worker.
        remove_here: drops forks of values this worker owns (the owner table's
            ``remove_forks``): a deletion owed to itself goes there directly.
    """

    def __init__(self, agent: ServiceHost,
                 remove_here: Callable[[list[tuple[RRefId, ForkId]]], None]) -> None:
        self.agent = agent
        self._remove_here = remove_here
        self._closed = False
        # __del__ appends here (deque.append is atomic and takes no lock) and, when the
        # deleter is not already due, posts a wake-up on the SimpleQueue (whose put is
        # reentrant). Deletions then ride as notes in the next frame to their owner
        # (notes_for); the deleter sends those no frame took after _LINGER seconds.
        self._queued: collections.deque[Deletion] = collections.deque()
        self._wake: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._deleter_due = False
        self._notes_lock = threading.Lock()  # guards _by_owner, _announcing, _held
        self._by_owner: dict[int, list[tuple[RRefId, ForkId]]] = {}
        # RRefs with fork announcements not acknowledged yet, and deletions held for them.
        self._announcing: collections.Counter[RRefId] = collections.Counter()
        self._held: dict[RRefId, list[Deletion]] = {}
        self._announcement_ended = threading.Condition(self._notes_lock)
        # Owners sent deletions one way (notes, or alone) since the last flush(), which
        # asks each of them for an acknowledgement of everything before it.
        self._unacknowledged: set[int] = set()
        self.send_lock = threading.RLock()  # one sender of queued deletions at a time
        # Bookkeeping requests (deletions, fork announcements) not answered yet.
        self._lock = threading.Lock()
        self._inflight: set[torch.futures.Future[Any]] = set()
        self._inflight_forks = 0
        self._sent = 0  # bookkeeping messages sent since the last flush()
        self._deleter = threading.Thread(
            target=self._delete_loop, name=f"rpcx-{agent.name}-rref", daemon=True
        )
        self._deleter.start()

    # ------------------------------------------------------------- RRef.__del__

    def schedule(self, owner: int, rref_id: RRefId, fork: ForkId) -> None:
        """Queue the deletion of ``fork`` of ``rref_id`` for ``owner``: reentrant,
        never blocks, never raises (``RRef.__del__`` calls it, through the service,
        which checks first that the worker is open and ``owner`` still in the world)."""
        self._queued.append((owner, rref_id, fork))
        if not self._deleter_due:
            self._deleter_due = True
            self._wake.put(True)

    def wake(self) -> None:
        """Make the deleter look at the queues soon."""
        if not self._closed:
            self._deleter_due = True
            self._wake.put(True)

    # -------------------------------------------------------------------- notes

    def notes_for(self, dst: int) -> list[tuple[int, Any]]:
        """The deletions owed to ``dst``, as notes for a frame about to be sent to it.

        A deletion may ride in any later frame to its owner: the RRef died after the
        frames that forked it were sent (their announcements before them), so per-pair
        order still brings every announcement first. Saves a message and its reply per
        dropped RRef (``remote().to_here()`` in a loop: one round trip of three).
        """
        if not self._queued and not self._by_owner:
            return []
        with self._notes_lock:
            self._sort_locked()
            forks = self._by_owner.pop(dst, None)
            if not forks:
                return []
            self._unacknowledged.add(dst)
        return [(MessageKind.RREF_DELETE, forks)]

    def notes_not_sent(self, dst: int, notes: list[tuple[int, Any]]) -> None:
        """Take back deletions from :meth:`notes_for` whose frame was never sent."""
        with self._notes_lock:
            for kind, forks in notes:
                if kind == MessageKind.RREF_DELETE:
                    self._by_owner.setdefault(dst, []).extend(forks)
        self.wake()

    def forget_rank(self, rank: int) -> None:
        """The worker at ``rank`` is gone, or a new worker took its rank: deletions still
        queued for the one before are void (they would be taken for a newcomer's own
        RRefs)."""
        with self._notes_lock:
            self._sort_locked()
            self._by_owner.pop(rank, None)
            self._unacknowledged.discard(rank)
            for rref_id, held in list(self._held.items()):
                self._held[rref_id] = [d for d in held if d[0] != rank]

    def _sort_locked(self) -> None:
        while self._queued:
            deletion = owner, rref_id, fork = self._queued.popleft()
            if rref_id in self._announcing:  # the owner hears of the child first
                self._held.setdefault(rref_id, []).append(deletion)
            else:
                self._by_owner.setdefault(owner, []).append((rref_id, fork))

    def _take_all(self) -> dict[int, list[tuple[RRefId, ForkId]]]:
        with self._notes_lock:
            self._sort_locked()
            taken, self._by_owner = self._by_owner, {}
        return taken

    # ------------------------------------------------------------ announcements

    def announcing(self, rref_id: RRefId) -> None:
        """A fork of ``rref_id`` is being announced to its owner: hold back deletions of
        it until :meth:`announced`."""
        with self._notes_lock:
            self._announcing[rref_id] += 1

    def announced(self, rref_id: RRefId) -> None:
        """An announcement of ``rref_id`` ended: release deletions held for it."""
        with self._notes_lock:
            self._announcing[rref_id] -= 1
            if self._announcing[rref_id] > 0:
                return
            del self._announcing[rref_id]
            held = self._held.pop(rref_id, None)
            if held is None:
                return
            for owner, _, fork in held:
                self._by_owner.setdefault(owner, []).append((rref_id, fork))
            self._announcement_ended.notify_all()  # a flush may wait for these
        if held:
            self.wake()

    def track(self, future: torch.futures.Future[Any], announced: RRefId | None = None
              ) -> None:
        """A bookkeeping request was sent (a fork announcement of ``announced``, or
        deletions): :meth:`flush` waits for its answer."""
        with self._lock:
            if announced is not None:
                self._inflight_forks += 1
            self._sent += 1
            self._inflight.add(future)
        add_internal_callback(future, functools.partial(self._answered, announced=announced))

    def _answered(self, future: torch.futures.Future[Any], announced: RRefId | None = None
                  ) -> None:
        """A bookkeeping request was answered (or failed): off the in-flight count."""
        with self._lock:
            self._inflight.discard(future)
            if announced is not None:
                self._inflight_forks -= 1
        if announced is not None:
            self.announced(announced)
        try:
            future.value()
        except (PeerLostError, RpcShutdownError) as exc:  # the world is going away
            log.debug("%s: RRef bookkeeping message lost: %s", self.agent.name, exc)
        except Exception as exc:
            log.warning("%s: RRef bookkeeping message failed: %s", self.agent.name, exc)

    # ------------------------------------------------------------------ sending

    def _delete_loop(self) -> None:
        while self._wake.get():
            time.sleep(_LINGER)  # let frames about to leave carry them
            self._deleter_due = False  # before taking: a later deletion wakes us again
            with self.send_lock:
                for owner, forks in self._take_all().items():
                    self._send(owner, forks, acknowledged=False)

    def _send(self, owner: int, forks: list[tuple[RRefId, ForkId]], *, acknowledged: bool
              ) -> None:
        """Send ``forks`` to ``owner``: one way, or as a request whose reply acknowledges
        them and every deletion sent to ``owner`` before."""
        if owner == self.agent.rank:
            self._remove_here(forks)
            return
        dst = self.agent.workers[owner]
        # (On a lossy transport every deletion is a request: flush() must wait for the
        # ones lost and sent again, where order alone acknowledges them otherwise.)
        if not acknowledged and not self.agent.lossy:
            with self._notes_lock:
                self._unacknowledged.add(owner)
            self.agent.send_one_way(dst, MessageKind.RREF_DELETE, forks)
            with self._lock:
                self._sent += 1
            return
        try:
            future = self.agent.request(
                dst, MessageKind.RREF_DELETE, forks,
                timeout=self.agent.timeout_for(None),
                label=CallLabel("release", f"{len(forks)} RRef references", str),
            )
        except RpcShutdownError:
            return  # the world is going away; the owner releases everything
        self.track(future)

    def flush(self, deadline: float, timeout: float,
              wait_values: Callable[[float], bool]) -> int:
        """Send every queued deletion and wait for all bookkeeping, until ``deadline``
        (``time.monotonic()``; ``timeout`` is that bound in seconds, for the errors).
        ``wait_values(left)``: wait for the values freed by what was answered to be
        dropped (false if they were not within ``left`` seconds).

        Returns how many messages this had to send or wait for.
        """
        handled = rounds = 0
        while True:
            with self.send_lock:
                taken = self._take_all()
                with self._notes_lock:
                    owners = set(taken) | self._unacknowledged
                    self._unacknowledged.clear()
                    held = set(self._held)
                for owner in owners:
                    self._send(owner, taken.get(owner, []), acknowledged=True)
                with self._lock:
                    waiting = list(self._inflight)
                    sent, self._sent = self._sent, 0
            handled += sent + len(waiting)
            if waiting and not wait_done(torch.futures.collect_all(waiting),
                                         max(0.0, deadline - time.monotonic())):
                raise RpcError(f"{self.agent.name}: RRef bookkeeping still pending after "
                               f"{timeout} s")
            if not wait_values(max(0.0, deadline - time.monotonic())):
                raise RpcError(f"{self.agent.name}: freed RRef values still held "
                               f"after {timeout} s")
            # What this flush waited for may have released deletions: those held behind
            # an announcement (released when it is answered: waited for here, on our
            # own lock, as torch may finish a future before its callbacks have run), and
            # those of the RRefs inside the values just dropped (an RRef of RRefs), and
            # any RRef that died meanwhile. They are this flush's: go round again, a
            # bounded number of times, so that a flush beside a thread that keeps
            # dropping RRefs still returns.
            with self._notes_lock:
                if not self._announcement_ended.wait_for(
                        functools.partial(held.isdisjoint, self._announcing),
                        max(0.0, deadline - time.monotonic())):
                    raise RpcError(f"{self.agent.name}: RRef fork announcements still "
                                   f"pending after {timeout} s")
            rounds += 1
            if rounds >= _FLUSH_ROUNDS or time.monotonic() >= deadline:
                break
            with self.send_lock, self._notes_lock:  # (the deleter sends under it)
                if not (self._queued or self._by_owner or self._unacknowledged):
                    break
        return handled

    # ------------------------------------------------------------------- status

    def stats(self) -> tuple[int, int]:
        """``(fork announcements in flight, deletions not yet answered or sent)``."""
        with self._notes_lock:
            noted = sum(len(forks) for forks in self._by_owner.values()) + sum(
                len(held) for held in self._held.values())
        with self._lock:
            forks = self._inflight_forks
            deletes = len(self._queued) + len(self._inflight) - forks + noted
        return forks, deletes

    def stop(self) -> None:
        """Tell the deleter thread to stop, after what it has been woken for already;
        :meth:`wake` does nothing from now on."""
        self._closed = True
        self._wake.put(False)

    def join(self, left: float | None) -> None:
        """Wait for the deleter thread to stop (at most ``left`` seconds; ``None``: until
        it does), after :meth:`stop`."""
        if self._deleter is not threading.current_thread():
            self._deleter.join(left)
