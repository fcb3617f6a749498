"""What a worker does as peers come and go: a peer lost (the transport's ``peer_lost``),
a newcomer admitted to a dynamic world (the transport's ``admit``), a killed worker
struck off a dynamic world's roster, and this worker's own farewell.

Part of the agent (:mod:`rpcx._core.agent`), which hands the transport these callbacks.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from rpcx._core.context import receiving
from rpcx._core.peer_health import PeerHealth
from rpcx._core.shutdown import Lifecycle
from rpcx._world.membership import Roster
from rpcx._world.membership_events import MembershipWatchers
from rpcx.errors import LostCause, RpcError, lost_reason
from rpcx.messages import MessageKind
from rpcx.worker import WorkerInfo

__all__ = ["DynamicMembership", "PeerEvents"]

log = logging.getLogger("rpcx.agent")

_STRIKE_OFF_TIMEOUT = 30.0  # seconds to strike a lost worker off a dynamic world's roster
# Seconds telling the peers this worker leaves without shutdown() may take: a send to a
# stopped peer whose socket is full waits until written, and a program must still exit.
_FAREWELL_BOUND = 2.0


class DynamicMembership(Protocol):
    """What the agent of a dynamic world asks the world's record in the store."""

    incarnation: int
    """How many workers held this worker's rank before it."""

    def member(self, rank: int) -> str:
        """The name of the worker that joined at ``rank``."""

    def admitting(self, rank: int) -> list[Callable[[], None]]:
        """Check the worker joining at ``rank`` before it is admitted (its device
        declaration); raise ``RpcError`` to refuse it. Returns what undoes the checks'
        effects, should the worker be refused after all."""

    def departing(self, timeout: float) -> contextlib.AbstractContextManager[None]:
        """Held while this worker closes its transport: it is struck off the roster
        first, and no worker joins meanwhile. Waits at most ``timeout`` seconds for
        the world's token."""

    def strike_off(self, rank: int, name: str, timeout: float) -> None:
        """Worker ``name`` at ``rank`` was lost without leaving: take it off the
        world's roster (if nobody did yet), so that its rank and name are free again
        and joining workers do not try to connect to it."""


class PeerEvents:
    """The agent's answers to peers coming and going.

    Args:
        name: this worker's name (for log lines and thread names).
        workers: every worker by rank (the roster's list).
        roster: who holds each rank.
        health: lost and silent peers.
        membership: user code told of joins, departures and losses.
        lifecycle: whether this worker still runs.
        dynamic: the dynamic world's bookkeeping, ``None`` in a static world.
        transport_names: the names the transport knows the ranks by (grown on admit).
        send_one_way: sends a one-way message.
        reachable: whether a peer is connected, not lost and not silent (told farewells).
    """

    def __init__(self, *, name: str, workers: list[WorkerInfo], roster: Roster,
                 health: PeerHealth, membership: MembershipWatchers, lifecycle: Lifecycle,
                 dynamic: DynamicMembership | None, transport_names: list[str],
                 send_one_way: Callable[[WorkerInfo, MessageKind, Any], None],
                 reachable: Callable[[int], bool]) -> None:
        self._name = name
        self._workers = workers
        self._roster = roster
        self._health = health
        self._membership = membership
        self._life = lifecycle
        self._dynamic = dynamic
        self._transport_names = transport_names
        self._send_one_way = send_one_way
        self._reachable = reachable

    def peer_lost(self, rank: int, cause: LostCause, detail: str = "") -> None:
        """The transport's report: worker ``rank`` is gone (see ``PeerLost``)."""
        farewell = self._health.farewell(rank)  # (taken whatever the cause: ranks are reused)
        if cause is LostCause.DEPARTED and farewell is not None:
            detail = farewell
        # Transports call this from their receiving threads, which must not send.
        with receiving():
            self._health.peer_lost(rank, cause, detail)
        reason = lost_reason(cause, detail)
        if self._dynamic is not None:
            # A worker gone from a dynamic world, whichever way, leaves its rank to the
            # next (a static world's roster never changes).
            self._roster.depart(rank, reason)
        departed = cause is LostCause.DEPARTED
        worker = self._workers[rank]
        first = self._membership.gone(rank, worker, departed, reason,
                                      tuple(self._roster.members()))
        if first and self._dynamic is not None and not departed and self._life.running:
            # Killed, not left: its entry in the store's roster stays until a member
            # strikes it off (on a thread of its own: this one must not block).
            threading.Thread(target=self._strike_off, args=(rank, worker.name),
                             name=f"rpcx-strike-off-{rank}", daemon=True).start()

    def _strike_off(self, rank: int, name: str) -> None:
        assert self._dynamic is not None
        try:
            self._dynamic.strike_off(rank, name, _STRIKE_OFF_TIMEOUT)
        except RpcError as exc:  # (the store's host may be the one that died)
            log.info("%s: could not strike worker %r (rank %d) off the dynamic world's "
                     "roster: %s", self._name, name, rank, exc)

    def admit(self, rank: int) -> str:
        """A worker joined this dynamic world at ``rank`` (the transport calls this when it
        connects, before anything from it is delivered): enter it; its name."""
        assert self._dynamic is not None
        worker = WorkerInfo(self._dynamic.member(rank), rank)
        undo = self._dynamic.admitting(rank)  # (raises for one whose devices do not fit)
        try:
            self._roster.admit(worker)  # (raises for a rank or a name taken)
        except BaseException:
            for step in undo:
                step()
            raise
        names = self._transport_names
        names.extend(w.name for w in self._workers[len(names):])
        names[rank] = worker.name
        self._health.watch(rank)
        self._membership.joined(worker, tuple(self._roster.members()))
        return worker.name

    def departing(self, timeout: float) -> contextlib.AbstractContextManager[None]:
        """Held while this worker closes its transport: a dynamic worker leaves under the
        membership token, so that no newcomer dials it meanwhile; static worlds need
        none."""
        if self._dynamic is None:
            return contextlib.nullcontext()
        return self._dynamic.departing(timeout)

    def say_leaving(self, rank: int, why: int) -> None:
        """Tell every reachable peer that this worker (``rank``) is about to leave without
        ``shutdown()`` (``why``: a ``LEAVING_*`` code of :mod:`rpcx.messages`); see
        ``RpcAgent.say_leaving``. No message starts after ``_FAREWELL_BOUND``. Never
        raises."""
        if not self._life.running:
            return
        peers = [w for w in self._roster.members() if w.id != rank and self._reachable(w.id)]
        late = threading.Event()

        def tell() -> None:
            for worker in peers:
                if late.is_set():
                    return
                self._send_one_way(worker, MessageKind.LEAVING, why)

        teller = threading.Thread(target=tell, name=f"rpcx-{self._name}-farewell", daemon=True)
        try:
            teller.start()
        except RuntimeError as exc:  # (Python 3.12.0-3.12.1 start no thread at exit)
            log.debug("%s: peers not told it leaves: %s", self._name, exc)
            return
        teller.join(_FAREWELL_BOUND)
        late.set()
        if teller.is_alive():
            log.debug("%s: not every peer was told it leaves within %g s", self._name,
                      _FAREWELL_BOUND)
