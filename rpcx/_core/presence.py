"""Who is there: the world's barriers through the store, the peers' process marks, the
heartbeat's start, and probes of peers a shutdown barrier still waits for.

Part of the agent (:mod:`rpcx._core.agent`), kept apart so that the facade only hands
on: everything here talks to the store or asks the transport about connections.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from rpcx._core.executors import Executors
from rpcx._core.peer_health import PeerHealth
from rpcx._core.shutdown import step_bound
from rpcx._util.process_watch import PeerProcesses, local_mark
from rpcx._world import rendezvous, sealed
from rpcx._world.dynamic import process_mark_label
from rpcx.errors import RpcError
from rpcx.messages import PING, MessageKind
from rpcx.options import RpcBackendOptions
from rpcx.transport import ReportsConnections, Transport
from rpcx.worker import WorkerInfo, is_member

__all__ = ["Presence"]

log = logging.getLogger("rpcx.agent")

_MARK_FETCH_TIMEOUT = 2.0  # seconds the heartbeat waits for a silent peer's process mark


class Presence:
    """One worker's view of who is there.

    Args:
        name, rank: this worker.
        workers: every worker by rank (the roster's list: it grows in a dynamic world).
        store: the world's bounded store (``None`` once the worker left).
        transport: asked whether it connects on demand, and to whom it is connected.
        health: the heartbeat it starts.
        executors: the request pool the heartbeat runs on.
        options: ``heartbeat_interval`` and ``heartbeat_timeout``.
        is_lost: whether a rank is known gone (the barriers stop waiting for it).
        send_one_way: sends a one-way message (a ping probes a worker that may be gone).
    """

    def __init__(self, *, name: str, rank: int, workers: list[WorkerInfo], store: Any,
                 transport: Transport, health: PeerHealth, executors: Executors,
                 options: RpcBackendOptions, is_lost: Callable[[int], bool],
                 send_one_way: Callable[[WorkerInfo, MessageKind, Any], None]) -> None:
        self._name = name
        self._rank = rank
        self._workers = workers
        self.store = store
        self._transport = transport
        self._health = health
        self._executors = executors
        self._options = options
        self._is_lost = is_lost
        self._send_one_way = send_one_way
        # The kernel's word on silent peers of this host (marks published at start).
        self.peer_processes = PeerProcesses(self._process_mark)

    @functools.cached_property
    def on_demand(self) -> bool:
        """Whether the transport connects pairs when they first talk (asked once it
        started: it decides at start)."""
        transport = self._transport
        return isinstance(transport, ReportsConnections) and transport.connects_on_demand()

    def connected(self, rank: int) -> bool:
        """Whether the transport has a connection to ``rank`` (one that connects pairs
        when they first talk may have none yet)."""
        return not self.on_demand or self._transport.connected(rank)  # type: ignore[attr-defined]

    def started(self, dynamic: bool) -> None:
        """The transport started. A static world's worker puts its process mark in the
        store, for peers' heartbeats to ask the kernel about it (see
        :meth:`watch_peers`); a dynamic world's published its mark as it entered the
        roster, and is ready once connected: its heartbeat starts now."""
        if dynamic:
            self.start_heartbeat()
        elif not self._transport.capabilities.in_process:
            sealed.publish(self.store, f"process/{self._rank}", local_mark())

    def watch_peers(self, timeout: float | None) -> None:
        """A static world is ready (every worker passed the ``ready`` barrier): read the
        peers' process marks and start the heartbeat.

        Not before: while a world starts, its workers are busy importing and connecting
        (64 on 2 cores: a minute), and a peer's silence then says nothing. The marks are
        read in one store operation now, so that the heartbeat need not ask the store
        when a peer goes quiet, which on a starved host answers late.
        """
        self._learn_peer_processes(timeout)
        self.start_heartbeat()

    def start_heartbeat(self) -> None:
        """Start pinging quiet peers, if the options ask for it (never between threads
        of one process: they cannot hang apart)."""
        interval = self._options.heartbeat_interval
        timeout = self._options.heartbeat_timeout
        if interval > 0 and timeout > 0 and not self._transport.capabilities.in_process:
            self._health.start_heartbeat(self._rank, interval, self._executors.requests,
                                         vouch=self.peer_processes.vouch,
                                         knows=self.peer_processes.knows,
                                         connected=self.connected)

    def _learn_peer_processes(self, timeout: float | None) -> None:
        store = self.store
        if store is None or self._transport.capabilities.in_process:
            return
        ranks = [w.id for w in self._workers if w.id != self._rank and is_member(w)]
        keys = [f"process/{rank}" for rank in ranks]
        try:
            # (check first: multi_get waits for missing keys, a lost worker's say)
            if ranks and store.check(keys, timeout):
                marks = sealed.read(store, keys, timeout)  # (a forged mark is not learnt)
                self.peer_processes.learn({rank: mark for rank, mark in zip(ranks, marks,
                                                                            strict=True)
                                           if mark is not None})
        except RpcError as exc:
            log.debug("%s: peers' process marks not read: %s", self._name, exc)

    def _process_mark(self, rank: int) -> bytes | None:
        """The process mark worker ``rank`` published, if any (for the heartbeat)."""
        store, key = self.store, f"process/{rank}"
        if store is None or not store.check([key], _MARK_FETCH_TIMEOUT):
            return None  # (a get of a missing key would hold the store's caller)
        # (in a dynamic world, bound to the holder's incarnation: see rpcx._world.dynamic)
        label = (process_mark_label(store, rank, _MARK_FETCH_TIMEOUT)
                 if store.seal is not None else None)
        return sealed.read(store, [key], _MARK_FETCH_TIMEOUT,
                           labels=None if label is None else [label])[0]

    def barrier(self, tag: str, timeout: float | None, *, leaving: bool = False) -> None:
        """Wait until every live worker reached the barrier ``tag``. ``leaving``: one of
        shutdown's barriers, where a worker that may be gone without a word to this one
        is probed (see :meth:`_probe`)."""
        rendezvous.barrier(
            self.store, tag, self._rank, len(self._workers), timeout=timeout,
            is_gone=self._is_lost, waiter=self._name,
            describe=lambda ranks: ", ".join(self._workers[r].name for r in ranks),
            probe=self._probe if leaving and self.on_demand else None,
        )

    def leave(self, graceful: bool, deadline: float | None, *, dynamic: bool) -> None:
        """This worker's last word through the store (a static world's store host waits
        for every worker's; a dynamic world's for nobody's), bounded by ``deadline``
        when ``graceful``; then the store is let go (its last reference may host the
        rendezvous server)."""
        if not dynamic:
            rendezvous.leave(self.store, self._rank, len(self._workers), self._is_lost,
                             timeout=step_bound(deadline, rendezvous.LEAVE_TIMEOUT)
                             if graceful else 0.0)
        self.store = None

    def _probe(self, missing: list[int]) -> None:
        """Ping the workers a shutdown barrier still waits for that this worker has no
        connection to (a transport that connects on demand): connecting to one that is
        gone fails, and it is reported lost, so the barrier stops waiting for it (a
        connection would have told of its end at once). Not at ``init_rpc``'s barrier:
        there a late worker is starting, not gone."""
        for rank in missing:
            if rank != self._rank and not self.connected(rank) and not self._is_lost(rank):
                self._send_one_way(self._workers[rank], MessageKind.HEARTBEAT, PING)
