"""The RRef lifetime protocol: who holds a reference, and when an owned value is freed.

Every ``RRef`` object carries a *fork id*, registered at the owner with the rank that
holds it. The owner keeps a value while any fork of it is registered; it frees the value
once the value exists and the last fork is gone. ``RRef(value)`` and ``remote()`` create
the first fork; sending an RRef in a call or a result creates a new fork for the receiver.

Why the owner never frees early, without waiting for acknowledgements:

* A new fork is announced to the owner (``RREF_FORKS``) by the worker that sends the RRef,
  *before* the frame that carries it, while the sender's own RRef is still alive.
* The sender's own fork can only be deleted later (its RRef object dies afterwards), and
  that deletion (``RREF_DELETE``) travels on the same ordered sender-to-owner channel.
* The owner handles these messages in arrival order on the delivering thread (they are
  registered ``in_order``), so it registers the child before it drops the parent.

A fork's deletion can still overtake its own announcement (they come from different
workers): the owner remembers such a fork as *cancelled* and ignores the announcement.
Where order is not enough (a transport that loses frames resends the lost ones late, see
rpcx._core.retransmit), a worker also holds back the deletion of an RRef whose announcements
have not been acknowledged yet: the owner always hears of the child before the parent
goes. Announcements and deletions for an id the owner already freed are stale copies and
are ignored, so they cannot bring an entry back.
Entries announced or fetched before the creating ``remote()`` arrived wait, uncreated,
for it; they are not freed until created. A dead worker's forks are dropped, and so is
a fork announced later for a worker the owner knows is gone: in a dynamic world a
sender that has not yet heard that a worker died may announce a fork for it after the
owner struck it off and a newcomer took its rank, and the newcomer would never delete
that fork. An announcement names its holder (as the sender sees it) for that; a
newcomer that reuses the name of the worker it replaces is not told apart.

Deletions come from ``RRef.__del__``, at any time the garbage collector chooses; how
they reach their owners (as notes in frames already on their way, or batched one way,
and held back behind unanswered announcements) is :mod:`rpcx._services.rref_deletions`.
Reference cycles through RRefs on different workers are not collected (no distributed
cycle detection); their values are released at shutdown.
"""

from __future__ import annotations

import collections
import gc
import itertools
import logging
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rpcx._core.service_host import CallLabel, ServiceHost, first_id
from rpcx._services.rref_deletions import Deletions
from rpcx._services.rref_fork import ForkId, ForkState, RRefId
from rpcx._util.timer import within
from rpcx.errors import PeerLostError, RpcError, RpcShutdownError
from rpcx.messages import MessageKind
from rpcx.worker import WorkerInfo

__all__ = ["ForkId", "RRefId", "RRefService"]

log = logging.getLogger("rpcx.rref")

_FREED_IDS_KEPT = 65536  # recently freed ids remembered, to answer late calls
_CONFIRMED_EARLY_KEPT = 65536  # confirmations parked for RRefs not decoded yet
_GONE_HOLDERS_KEPT = 4096  # names of gone workers remembered, to refuse late forks
_FLUSH_TIMEOUT = 30.0


@dataclass
class _Entry:
    """An owned value and the references to it."""

    value: torch.futures.Future[Any] = field(default_factory=torch.futures.Future)
    forks: dict[ForkId, int] = field(default_factory=dict)  # fork -> holding rank
    cancelled: set[ForkId] = field(default_factory=set)  # deleted before announced
    created: bool = False  # the value exists, or its creating call has started
    gone: str = ""  # why it went uncreated (its creator was lost): what waiters get


def _orphaned(rank: int) -> str:
    return f"the worker creating this RRef (rank {rank}) is gone"


_INERT_TYPES = frozenset({int, float, bool, complex, str, bytes, type(None)})


def _describe_announced(target: tuple[RRefId, str]) -> str:
    """An announcement's RRef, as its call is named: not the RRef object (a label lives
    as long as the call, and would keep the RRef, so its fork, past the answer)."""
    rref_id, owner = target
    return f"RRef(id={rref_id}, owner={owner!r})"


def _inert(value: torch.futures.Future[Any]) -> bool:
    """Whether dropping the value in ``value`` can run no code but the interpreter's:
    a number, a string, bytes, ``None``, or a tensor outside any autograd graph."""
    if not value.done():
        return True  # (never created: nothing to drop)
    try:
        held = value.value()
    except BaseException:  # an error's object may hold anything
        return False
    kind = type(held)
    if kind in _INERT_TYPES:
        return True
    return kind is torch.Tensor and held.grad_fn is None


class Announced(Protocol):
    """What :meth:`RRefService.announce` reads of the RRef whose fork it announces."""

    @property
    def _id(self) -> RRefId:
        """The RRef's id."""

    @property
    def _owner(self) -> WorkerInfo:
        """The RRef's owner."""


class RRefService:
    """One worker's side of the protocol: its owner table and its references."""

    def __init__(self, agent: ServiceHost) -> None:
        self.agent = agent
        self.rank = agent.rank
        self._counter = itertools.count(first_id(agent.incarnation))
        self._lock = threading.Lock()
        self._freeing = 0  # batches of freed values handed to the completion lane
        self._all_freed = threading.Condition(self._lock)
        self._entries: dict[RRefId, _Entry] = {}
        # The fork state of every live RRef object here (each lives as long as its RRef).
        self._objects: weakref.WeakValueDictionary[ForkId, ForkState] = (
            weakref.WeakValueDictionary()
        )
        self._confirmed_early: collections.OrderedDict[ForkId, None] = collections.OrderedDict()
        self._lost_ranks: set[int] = set()
        # Names of workers gone lately (add_forks refuses forks announced for them).
        self._gone_holders: collections.OrderedDict[str, None] = collections.OrderedDict()
        # Ids gone from the table -> why ("" for a value whose references all went).
        self._freed_ids: collections.OrderedDict[RRefId, str] = collections.OrderedDict()
        self._closed = False
        # (last: its thread may drop forks here, with remove_forks, once it is woken)
        self.deletions = Deletions(agent, self.remove_forks)

    @property
    def closed(self) -> bool:
        """True once the worker has shut down."""
        return self._closed

    def new_id(self) -> tuple[int, int]:
        """A world-unique id for an RRef or a fork."""
        return (self.rank, next(self._counter))

    # ------------------------------------------------------------------ owner side

    def create_local(self, value: Any) -> tuple[RRefId, ForkId]:
        """Own ``value`` under a new id, with one fork held here."""
        rref_id, fork = self.new_id(), self.new_id()
        with self._lock:
            entry = self._entries[rref_id] = _Entry(created=True)
            entry.forks[fork] = self.rank
        entry.value.set_result(value)
        return rref_id, fork

    def slot(self, rref_id: RRefId) -> torch.futures.Future[Any]:
        """The value future of ``rref_id``; an uncreated placeholder if it is unknown.

        An id freed recently gets a failed future instead: a call that reaches the owner
        after the last reference went (a proxy call that timed out, say) must not wait.
        """
        with self._lock:
            if rref_id not in self._entries and rref_id in self._freed_ids:
                why = self._freed_ids[rref_id]
                gone: torch.futures.Future[Any] = torch.futures.Future()
                gone.set_exception(PeerLostError(why) if why else RpcError(
                    f"RRef {rref_id} no longer exists on {self.agent.name!r}: every "
                    "reference to it was released"
                ))
                return gone
            if rref_id not in self._entries and rref_id[0] in self._lost_ranks:
                # (its creator is gone and never made it: an entry made now would wait,
                # and stay, for good)
                orphan: torch.futures.Future[Any] = torch.futures.Future()
                orphan.set_exception(PeerLostError(_orphaned(rref_id[0])))
                return orphan
            return self._entry_locked(rref_id).value

    def begin_creation(
        self, rref_id: RRefId, fork: ForkId, creator: int
    ) -> torch.futures.Future[Any]:
        """A ``remote()`` call starts: register the creator's fork, return the value slot."""
        freed: list[_Entry] = []
        with self._lock:
            entry = self._entry_locked(rref_id)
            entry.created = True
            if creator not in self._lost_ranks:  # a dead creator's queued call
                self._add_fork_locked(entry, fork, creator)
            self._free_if_unused_locked(rref_id, entry, freed)
            return entry.value

    def add_forks(self, forks: list[tuple[RRefId, ForkId, int, str]], sender: int) -> None:
        """Register announced forks ``(rref, fork, holder's rank, holder's name)``; tell
        holders other than the sender they are known."""
        confirm: dict[int, list[ForkId]] = defaultdict(list)
        freed: list[_Entry] = []
        with self._lock:
            for rref_id, fork, holder, holder_name in forks:
                if self._is_freed_locked(rref_id):
                    log.debug("%s: stale announcement for freed %s", self.agent.name, rref_id)
                    continue
                entry = self._entry_locked(rref_id)
                if holder in self._lost_ranks or holder_name in self._gone_holders:
                    # (a fork for a worker found dead while the call that sends it ran,
                    # or for one that left the rank a newcomer holds now: nobody would
                    # ever delete it)
                    log.debug("%s: fork of %s for %r (rank %d), no longer in the world, "
                              "not kept", self.agent.name, rref_id, holder_name, holder)
                    self._free_if_unused_locked(rref_id, entry, freed)
                    continue
                added = self._add_fork_locked(entry, fork, holder)
                # A holder that got the RRef from the owner itself knows it is confirmed.
                if added and sender != self.rank and holder != self.rank:
                    confirm[holder].append(fork)
                self._free_if_unused_locked(rref_id, entry, freed)
        self._release(freed)
        for holder, holder_forks in confirm.items():
            self.agent.send_one_way(self.agent.workers[holder], MessageKind.RREF_CONFIRM,
                                    holder_forks)

    def remove_forks(self, forks: list[tuple[RRefId, ForkId]]) -> None:
        """Drop references that are gone; free values nobody holds any more."""
        freed: list[_Entry] = []
        with self._lock:
            for rref_id, fork in forks:
                if self._is_freed_locked(rref_id):
                    continue  # a copy of a deletion already handled
                entry = self._entry_locked(rref_id)
                if entry.forks.pop(fork, None) is None:
                    entry.cancelled.add(fork)
                self._free_if_unused_locked(rref_id, entry, freed)
        self._release(freed)

    def rank_reused(self, rank: int) -> None:
        """A new worker took ``rank`` (a dynamic world): its calls are not a dead
        creator's, and deletions still queued for the one before it are void. Values
        still waiting for their creation at the rank were the dead workers' (the
        newcomer has made none yet), and never come: they go now."""
        workers = self.agent.workers
        freed: list[_Entry] = []
        with self._lock:
            self._orphans_locked(rank, freed)
            self._lost_ranks.discard(rank)
            if 0 <= rank < len(workers):  # (the newcomer, unless it took an old name)
                self._gone_holders.pop(workers[rank].name, None)
        self._release(freed)
        self.deletions.forget_rank(rank)

    def drop_rank(self, rank: int) -> None:
        """A worker is gone: drop its forks and the entries it was about to create."""
        freed: list[_Entry] = []
        workers = self.agent.workers
        with self._lock:
            self._lost_ranks.add(rank)
            if 0 <= rank < len(workers):  # (the entry still names the worker gone)
                self._gone_holders[workers[rank].name] = None
                if len(self._gone_holders) > _GONE_HOLDERS_KEPT:
                    self._gone_holders.popitem(last=False)
            self._orphans_locked(rank, freed)
            for rref_id, entry in list(self._entries.items()):
                for fork in [f for f, holder in entry.forks.items() if holder == rank]:
                    del entry.forks[fork]
                self._free_if_unused_locked(rref_id, entry, freed)
        self._release(freed)
        # Deletions still queued for it go too: its values went with it, and a worker
        # that takes its rank later must not get them.
        self.deletions.forget_rank(rank)
        self._wake_unconfirmed(lambda state: state.owner.id == rank)

    def _orphans_locked(self, rank: int, freed: list[_Entry]) -> None:
        """Move the entries whose value a worker at ``rank`` was to create to ``freed``,
        their ids remembered as gone: forks announced or deleted later, by workers that
        had not heard, find them gone rather than make them anew (the churn's "1 owned
        rrefs left": an entry with no value and nobody holding it)."""
        for rref_id, entry in list(self._entries.items()):
            if not entry.created and rref_id[0] == rank:
                self._entries.pop(rref_id)
                entry.gone = _orphaned(rank)
                self._remember_gone_locked(rref_id, entry.gone)
                freed.append(entry)

    def _is_freed_locked(self, rref_id: RRefId) -> bool:
        return rref_id not in self._entries and rref_id in self._freed_ids

    def _entry_locked(self, rref_id: RRefId) -> _Entry:
        entry = self._entries.get(rref_id)
        if entry is None:
            entry = self._entries[rref_id] = _Entry()
        return entry

    def _release(self, freed: list[_Entry]) -> None:
        # Values never made fail their waiters first (outside the lock: a future's
        # callbacks run as it is set). Dropping a value runs whatever __del__ it has:
        # not on a delivering thread. Counted, so that flush() (shutdown's drain) also
        # waits for the values to go. Values whose going runs no Python code (numbers,
        # strings, plain tensors: what remote() of a small function leaves; a value
        # never made) are dropped here, saving the lane a wake-up per freed value.
        for entry in freed:
            if entry.gone and not entry.value.done():
                entry.value.set_exception(PeerLostError(entry.gone))
        if freed:
            if all(entry.gone or _inert(entry.value) for entry in freed):
                freed.clear()
                return
            with self._lock:
                self._freeing += 1
            self.agent.call_soon(self._free, freed)

    def _free(self, freed: list[_Entry]) -> None:
        try:
            freed.clear()
        finally:
            with self._lock:
                self._freeing -= 1
                if not self._freeing:
                    self._all_freed.notify_all()

    def _remember_gone_locked(self, rref_id: RRefId, why: str) -> None:
        self._freed_ids[rref_id] = why
        if len(self._freed_ids) > _FREED_IDS_KEPT:
            self._freed_ids.popitem(last=False)

    @staticmethod
    def _add_fork_locked(entry: _Entry, fork: ForkId, holder: int) -> bool:
        if fork in entry.cancelled:  # its deletion arrived first
            entry.cancelled.discard(fork)
            return False
        entry.forks[fork] = holder
        return True

    def _free_if_unused_locked(
        self, rref_id: RRefId, entry: _Entry, freed: list[_Entry]
    ) -> None:
        # Freed entries are dropped by the caller after it releases the lock: dropping a
        # value can run arbitrary __del__ code, including other RRefs' __del__.
        if not entry.forks and (entry.created or rref_id[0] in self._lost_ranks):
            # (an uncreated one: announced, then deleted, after its creator was lost)
            freed.append(self._entries.pop(rref_id))
            if not entry.created:
                entry.gone = _orphaned(rref_id[0])
            self._remember_gone_locked(rref_id, entry.gone)
            if entry.cancelled:
                # Deletions whose announcements never came: the senders died, or the
                # frames that carried them failed. Nothing holds them now.
                log.debug("%s: freed %s with %d unmatched deletions",
                          self.agent.name, rref_id, len(entry.cancelled))

    # ------------------------------------------------------------------- user side

    def register_object(self, state: ForkState) -> bool:
        """Track a live RRef object's fork state; returns True if its owner already
        confirmed it."""
        with self._lock:
            self._objects[state.fork] = state
            return self._confirmed_early.pop(state.fork, False) is None

    def _wake_unconfirmed(self, which: Callable[[ForkState], bool]) -> None:
        """RRefs waiting for a confirmation that cannot come now: stop their waits."""
        for state in list(self._objects.values()):
            if not state.settled and which(state):
                state.give_up()

    def confirm(self, forks: list[ForkId]) -> None:
        """The owner registered these forks."""
        confirmed = []
        with self._lock:
            for fork in forks:
                state = self._objects.get(fork)
                if state is not None:
                    confirmed.append(state)
                else:
                    # Not decoded here yet, or already dropped: park it, boundedly (a
                    # confirmation for an RRef that is already gone is never claimed).
                    self._confirmed_early[fork] = None
                    if len(self._confirmed_early) > _CONFIRMED_EARLY_KEPT:
                        self._confirmed_early.popitem(last=False)
        for state in confirmed:
            state.confirm()

    def announce(self, rref: Announced, fork: ForkId, holder: int) -> None:
        """Register a new fork of ``rref`` for ``holder`` with its owner (before sending).

        Until the owner answers, deletions of ``rref``'s own fork are held back
        (:meth:`Deletions.announcing`); the object itself is not kept (its deletion,
        once released, is what a flush waiting for the answer sends). It reads the
        RRef's id and owner only (``_id``, ``_owner``: tests hand it a stand-in with
        just those); its confirmation is driven through its ForkState.
        """
        owner = rref._owner.id
        announced = (rref._id, fork, holder, self.agent.workers[holder].name)
        if owner == self.rank:
            self.add_forks([announced], self.rank)
            return
        rref_id = rref._id
        self.deletions.announcing(rref_id)
        try:
            future = self.agent.request(
                rref._owner, MessageKind.RREF_FORKS, [announced],
                timeout=self.agent.timeout_for(None),
                label=CallLabel("announce", (rref_id, rref._owner.name), _describe_announced),
            )
        except BaseException:
            self.deletions.announced(rref_id)
            raise
        self.deletions.track(future, announced=rref_id)

    def schedule_delete(self, owner: WorkerInfo, rref_id: RRefId, fork: ForkId) -> None:
        """Called from ``RRef.__del__``: reentrant, never blocks, never raises."""
        if (not self._closed and self.agent.workers[owner.id] == owner
                and owner.id not in self._lost_ranks):
            # (else the owner is gone, its values with it, and another worker may hold
            # its rank by the time a deletion is sent: it would be taken for one of the
            # newcomer's own RRefs, and kept for good)
            self.deletions.schedule(owner.id, rref_id, fork)

    def flush(self, left: float | None = None) -> int:
        """Collect garbage, send every queued deletion, wait for all bookkeeping, for at
        most ``left`` seconds (and ``_FLUSH_TIMEOUT``).

        Returns how many messages this had to send or wait for.
        """
        timeout = within(_FLUSH_TIMEOUT, left) or 0.0
        deadline = time.monotonic() + timeout
        if self._objects:
            # RRefs in reference cycles are deleted only by a collection; a full one
            # takes ~0.1 s of CPU with torch loaded (64 workers on 2 cores: 3 s of
            # shutdown), and with no RRef object here it could not send a deletion.
            gc.collect()
        return self.deletions.flush(deadline, timeout, self._values_dropped)

    def _values_dropped(self, left: float) -> bool:
        """Wait at most ``left`` seconds for the freed values handed to the completion
        lane to be dropped; whether they were."""
        with self._lock:
            return self._all_freed.wait_for(lambda: not self._freeing, left)

    # --------------------------------------------------------------------- status

    def stats(self) -> dict[str, int]:
        """Counts for ``rpcx.debug_info()``."""
        objects = list(self._objects.values())
        pending_forks, pending_deletes = self.deletions.stats()
        with self._lock:
            return {
                "owned": len(self._entries),
                "owned_values": sum(1 for e in self._entries.values() if e.created),
                "references_to_owned": sum(len(e.forks) for e in self._entries.values()),
                "user_rrefs": sum(1 for r in objects if r.owner.id != self.rank),
                "owner_rrefs": sum(1 for r in objects if r.owner.id == self.rank),
                "pending_forks": pending_forks,
                "pending_deletes": pending_deletes,
                "parked_confirmations": len(self._confirmed_early),
            }

    def describe_owned(self, most: int = 5) -> list[str]:
        """The first ``most`` entries of the owner table, one line each: what a leak
        report needs (is the value made, who holds it, which deletions came first)."""
        with self._lock:
            entries = list(self._entries.items())[:most]
            lost = sorted(self._lost_ranks)
        names = [w.name for w in self.agent.workers]
        return [f"RRef {rref_id} (creator rank {rref_id[0]}): "
                f"{'created' if entry.created else 'never created'}, holders "
                f"{sorted(entry.forks.values())}, {len(entry.cancelled)} deletions before "
                f"their announcement, value {'set' if entry.value.done() else 'pending'}; "
                f"lost ranks {lost}, workers {names}"
                for rref_id, entry in entries]

    def close(self, left: float | None = None) -> None:
        """The worker has shut down: stop the deleter (waiting at most ``left`` seconds,
        and 5) and release every owned value."""
        self._closed = True
        self.deletions.stop()  # (first: whatever comes next, the deleter is told to go)
        self._wake_unconfirmed(lambda state: True)
        self.deletions.join(within(5.0, left))
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        referenced = sum(1 for e in entries if e.created and e.forks)
        if referenced:
            log.info(
                "%s: shutdown released %d RRef values that were still referenced "
                "(reference cycles through RRefs, or RRefs kept until shutdown)",
                self.agent.name, referenced,
            )
        for entry in entries:
            if not entry.value.done():
                entry.value.set_exception(RpcShutdownError(
                    f"worker {self.agent.name!r} shut down before this RRef's value existed"
                ))
