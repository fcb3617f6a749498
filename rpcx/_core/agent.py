"""The RPC agent: one per worker, a facade over the parts that do the work.

It builds them, knows the worker's identity, resolves destinations, registers handlers,
starts the transport and holds the barrier; everything else it hands on:

* :mod:`rpcx._core.call_path`: send a request, receive a frame, serve it, complete the call
  (read it top to bottom to follow a call);
* :mod:`rpcx._core.peer_health`: lost and silent peers, heartbeats;
* :mod:`rpcx._core.shutdown`: the worker's state and the way out, the teardown order in one
  list;
* :mod:`rpcx._core.executors`: request pool, completion lane, followers, timer;
* optional policies with do-nothing defaults: back-pressure (:mod:`rpcx._core.budget`) and
  retransmission on lossy transports (:mod:`rpcx._core.retransmit`).

The agent never knows how a frame travels (that is the transport's job) and never knows
what a message means beyond its kind (services register handlers per kind).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rpcx._core import context as _context
from rpcx._core.budget import BackPressure, BytesInFlight
from rpcx._core.call_path import CallPath
from rpcx._core.context import receiving
from rpcx._core.executors import Executors
from rpcx._core.peer_health import PeerHealth
from rpcx._core.pending import PendingCalls, describe_callable
from rpcx._core.profiling import mark_profiler_node
from rpcx._core.retransmit import NoRetransmission, Retransmission
from rpcx._core.service_host import Deferred, Handler, MessageScope, NoteSource
from rpcx._core.shutdown import Lifecycle, Shutdown, TeardownStep, bounded, each_hook, step_bound
from rpcx._core.trace_policy import NoTrace
from rpcx._util.intra_op import adopt_intra_op_threads
from rpcx._util.process_watch import PeerProcesses, local_mark
from rpcx._wire.auth import ConnectionAuth, FrameGuard
from rpcx._wire.devices import DeviceRoutes
from rpcx._world import rendezvous
from rpcx._world.membership import Roster
from rpcx._world.membership_events import MembershipChange, MembershipWatchers
from rpcx.errors import LostCause, PeerLostError, RpcError, UnknownWorkerError, lost_reason
from rpcx.futures import RpcFuture
from rpcx.messages import PING, MessageKind
from rpcx.options import RpcBackendOptions
from rpcx.transport import (
    DescribesRoutes,
    Frame,
    ReportsConnections,
    Transport,
    TransportContext,
)
from rpcx.worker import WorkerInfo, find_worker, is_member

__all__ = ["Deferred", "DynamicMembership", "Handler", "MessageScope", "NoteSource",
           "RpcAgent", "describe_callable"]

log = logging.getLogger("rpcx.agent")

_MARK_FETCH_TIMEOUT = 2.0  # seconds the heartbeat waits for a silent peer's process mark
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

    def departing(self, timeout: float) -> contextlib.AbstractContextManager[None]:
        """Held while this worker closes its transport: it is struck off the roster
        first, and no worker joins meanwhile. Waits at most ``timeout`` seconds for
        the world's token."""

    def strike_off(self, rank: int, name: str, timeout: float) -> None:
        """Worker ``name`` at ``rank`` was lost without leaving: take it off the
        world's roster (if nobody did yet), so that its rank and name are free again
        and joining workers do not try to connect to it."""


class RpcAgent:
    """The local end of the RPC world for one worker."""

    def __init__(
        self, *, rank: int, workers: list[WorkerInfo], store: Any, transport: Transport,
        backend: str, options: RpcBackendOptions, init_method: str,
        routes: DeviceRoutes | None = None, guard: FrameGuard | None = None,
        connection_auth: ConnectionAuth | None = None,
        dynamic: DynamicMembership | None = None,
    ) -> None:
        self.info = workers[rank]
        # Ids this worker makes (RRefs, autograd contexts) start past those of earlier
        # holders of its rank in a dynamic world, which other workers may remember.
        self.incarnation = 0 if dynamic is None else dynamic.incarnation
        # Hooks services add to. Graceful shutdown, once every worker has stopped
        # calling: each drain hook sends what it still owes its peers, waits for the
        # acknowledgements, returns how many messages that took; repeated, world-wide,
        # until nobody sends anything. Drain and close hooks get the seconds left of
        # shutdown's budget (``None``: no bound) and must return within them.
        self.on_drain: list[Callable[[float | None], int]] = []
        self.on_close: list[Callable[[float | None], None]] = []  # the transport closed
        self.workers = workers
        self.backend = backend
        self.options = options
        self.init_method = init_method
        self.rpc_timeout: float = options.rpc_timeout
        self.routes = routes if routes is not None else DeviceRoutes(rank, self.names)
        self.services: dict[str, Any] = {}  # per-worker state of services (RRef tables, ...)
        # With a world key every frame is sealed on its way out and checked on its way in
        # (rpcx._wire.auth); without one the transport is called directly.
        self.guard = guard
        self._connection_auth = connection_auth
        # Who holds each rank; in a dynamic world it changes as workers join and leave.
        self.roster = Roster(workers, dynamic=dynamic is not None)
        self._dynamic = dynamic
        self._by_name = self.roster.by_name
        self._transport_names = [w.name for w in workers]  # (the transport's view)
        self._store = store
        self._transport = transport
        capabilities = transport.capabilities
        if capabilities.multi_process:
            mark_profiler_node(rank)  # (torch's profiler: events carry the worker's rank)
        self._back_pressure = (BytesInFlight(len(workers), options.max_bytes_in_flight)
                               if options.max_bytes_in_flight > 0 else BackPressure())
        self._life = Lifecycle()
        self.stopping = self._life.stopping  # set when shutdown() starts
        self._pending = PendingCalls()
        self._executors = Executors(self.name, options.num_worker_threads, self._bind_thread,
                                    lambda rid: self._calls.expire(rid),
                                    self._pending.__contains__)
        # On a transport that may lose or duplicate frames, bookkeeping is acknowledged
        # and sent again until answered; on reliable ones nothing is.
        self._retransmission = (
            Retransmission(f"rpcx-{self.name}", len(workers),
                           lambda dst, frame: self._calls.send_copy(dst, frame),
                           self._pending.__contains__, self._bind_thread)
            if capabilities.lossy else NoRetransmission())
        self._health = PeerHealth(
            name=self.name, workers=workers, lifecycle=self._life, pending=self._pending,
            fail=lambda rids, error: self._calls.fail(rids, error),
            on_forget=[self._retransmission.forget, lambda _: self._back_pressure.wake()],
            heartbeat_timeout=options.heartbeat_timeout, departures_expected=dynamic is not None,
            send_one_way=lambda dst, kind, payload: self._calls.send_one_way(dst, kind, payload))
        send = transport.send
        self._calls = CallPath(
            host=self, workers=workers, rank=rank,
            transmit_frame=send if guard is None
            else lambda dst, frame: send(dst, guard.seal(dst, frame)),
            lifecycle=self._life, executors=self._executors, pending=self._pending,
            lost_error=self._health.lost_error, heard=self._health.heard,
            routes=self.routes, stage_devices=not capabilities.cuda_direct,
            back_pressure=self._back_pressure, retransmission=self._retransmission)
        self.roster.growers += [self._health.grow, self._calls.grow, self._back_pressure.grow,
                                self._retransmission.grow]
        # The kernel's word on silent peers of this host (published in start()).
        self._peer_processes = PeerProcesses(self._process_mark)
        # User code told of joins, departures and losses (rpcx.on_membership_change).
        self.membership = MembershipWatchers(self.name, self._bind_thread)
        self.roster.on_rejoin += [self.membership.rank_reused]
        self.roster.on_rejoin += [self._calls.rejoined, self._retransmission.forget,
                                  self._peer_processes.forget]
        self._shutdown = Shutdown(
            name=self.name, rank=rank, world_size=len(workers), lifecycle=self._life,
            alone=dynamic is not None,
            pending=self._pending, store=store,
            barrier=self.leaving_barrier,
            is_lost=self.is_lost, on_drain=self.on_drain,
            before_waits=self._health.stop_heartbeat, cancel_pending=self._calls.cancel_all,
            teardown=self._teardown)
        # Services add to these: one-way messages that ride in frames sent anyway (RRef
        # deletions); hooks run with a rank when that peer died or left.
        self.note_sources: list[NoteSource] = self._calls.note_sources
        self.on_peer_lost: list[Callable[[int], None]] = self._health.on_peer_lost
        self.on_rank_reused: list[Callable[[int], None]] = self.roster.on_rejoin
        self.on_peer_silent: list[Callable[[int], None]] = self._health.on_peer_silent
        self.register_handler(MessageKind.HEARTBEAT, self._health.on_heartbeat, in_order=True)
        self.register_handler(MessageKind.LEAVING, self._health.on_leaving, in_order=True)
        # rpcx.tracing's clock probes: read the clock as the request arrives
        self.register_handler(MessageKind.CLOCK, lambda caller, payload: time.monotonic_ns(),
                              in_order=True)

    # ------------------------------------------------------------ identity

    @property
    def name(self) -> str:
        """This worker's name."""
        return self.info.name

    @property
    def rank(self) -> int:
        """This worker's rank."""
        return self.info.id

    @property
    def world_size(self) -> int:
        """Number of workers in the world."""
        return len(self.workers)

    @property
    def names(self) -> list[str]:
        """Every worker's name, by rank."""
        return [w.name for w in self.workers]

    @property
    def is_running(self) -> bool:
        """True until ``shutdown`` starts tearing the agent down."""
        return not self._life.closed

    @property
    def lossy(self) -> bool:
        """True if the transport may lose frames: bookkeeping is then acknowledged and
        sent again until answered (see :mod:`rpcx._core.retransmit`)."""
        return self._retransmission.lossy

    @property
    def dynamic(self) -> bool:
        """Whether workers may join and leave this world (``init_rpc`` without
        ``world_size``)."""
        return self._dynamic is not None

    def resolve(self, to: str | int | WorkerInfo) -> WorkerInfo:
        """The ``WorkerInfo`` for a name, a rank or a ``WorkerInfo``."""
        if self._dynamic is None:
            return find_worker(self.workers, self._by_name, to)
        try:
            found = find_worker(self.workers, self._by_name, to)
        except UnknownWorkerError:
            found = None
        if found is None or not self.roster.holds(found.id):
            known = ", ".join(w.name for w in self.roster.members())
            name = to.name if isinstance(to, WorkerInfo) else to
            gone = self.roster.how_gone(name) if isinstance(name, str) else None
            left = (f": {gone}, and is no longer in the world" if gone is not None
                    else " (it left the world)" if found is not None else "")
            raise UnknownWorkerError(
                f"unknown destination worker {name!r}{left}; the workers are: {known}")
        return found

    def on_membership_change(self, callback: Callable[[MembershipChange], object]
                             ) -> Callable[[], None]:
        """Run ``callback`` on each join, departure and loss from now on (see
        :func:`rpcx.on_membership_change`); the function that stops it."""
        return self.membership.add(callback)

    def members(self) -> list[WorkerInfo]:
        """The workers of the world now, by rank (in a dynamic world, those that joined
        and have not left)."""
        return self.roster.members()

    def timeout_for(self, timeout: float | None) -> float | None:
        """Seconds for a call's ``timeout`` argument: negative/None = default, 0 = none."""
        if timeout is None or timeout < 0:
            timeout = self.rpc_timeout
        return float(timeout) if timeout > 0 else None

    @property
    def trace(self) -> NoTrace:
        """The trace policy (:mod:`rpcx._core.trace_policy`): records this worker's calls while
        ``rpcx.tracing`` runs; does nothing otherwise."""
        return self._calls.trace

    @trace.setter
    def trace(self, policy: NoTrace) -> None:
        self._calls.trace = policy  # (one attribute: calls in flight see one or the other)

    def stats(self) -> dict[str, Any]:
        """This worker's call traffic, for ``debug_info``: ``pending_calls``,
        ``request_threads``, ``lost_peers``, ``lost_causes``, ``unresponsive_peers``,
        ``authenticated``, ``refused_frames``, ``resent_frames``, ``bytes_in_flight``,
        ``calls_held_back``, ``routes`` (peer name: how the transport reaches it, for
        transports that choose per peer) and ``connected_peers`` (how many peers this
        worker has a connection to; every one, unless the transport connects on demand)."""
        transport = self._transport
        routes = transport.routes() if isinstance(transport, DescribesRoutes) else {}
        return {
            "pending_calls": len(self._pending),
            "request_threads": self._executors.requests.thread_count,
            **self._health.stats(),
            "authenticated": self.guard is not None,
            "refused_frames": self.guard.refused if self.guard is not None else 0,
            "resent_frames": self._retransmission.resent,
            **self._back_pressure.report(self.names),
            "routes": {self.names[rank]: how for rank, how in sorted(routes.items())},
            "connected_peers": sum(1 for w in self.roster.members()
                                   if w.id != self.rank and self._connected(w.id)),
        }

    # ------------------------------------------------------- handlers, start

    def register_handler(
        self, kind: MessageKind, handler: Handler, *, in_order: bool = False,
        on_decode_error: Callable[[WorkerInfo, Any, BaseException], None] | None = None,
    ) -> None:
        """Run ``handler`` for every message of ``kind`` this worker receives.

        Handlers run on the request pool, concurrently. ``in_order=True`` runs the
        handler on the thread delivering the frame instead, so messages from one peer
        are handled in the order sent. Only for rpcx's own bookkeeping: such a handler
        must not block or run user code. (Whatever it sends goes out from the pool.)

        ``on_decode_error(caller, partial_payload, error)`` is called when a request of
        this kind cannot be unpickled but a lenient decode (missing classes replaced by
        placeholders) recovers its structure, so the service can settle its state.
        """
        self._calls.register(int(kind), handler, in_order, on_decode_error)

    @property
    def scope(self) -> MessageScope | None:
        """The service whose per-call scope travels with requests (distributed autograd)."""
        return self._calls.scope

    @scope.setter
    def scope(self, scope: MessageScope | None) -> None:
        self._calls.scope = scope

    def start(self) -> None:
        """Start the transport. Frames may arrive as soon as this is called."""
        deliver: Callable[[int, Frame], None] = self._calls.on_frame
        if self.guard is not None:
            deliver = self.guard.guarding(
                deliver, lambda src, why: self._on_peer_lost(src, LostCause.PROTOCOL_ERROR, why))
        self._transport.start(TransportContext(
            rank=self.rank, world_size=self.world_size, names=self._transport_names,
            store=rendezvous.prefixed(self._store, "transport"), options=self.options,
            init_method=self.init_method, deliver=deliver, peer_lost=self._on_peer_lost,
            routes=self.routes,
            receive_lane=lambda name, resume: self._executors.new_lane(name, resume, self),
            auth=self._connection_auth,
            admit=self._admit if self._dynamic is not None else None,
            vacant=lambda rank: rank >= len(self.workers) or not is_member(self.workers[rank]),
            progress=self._health.progress,
        ))
        if not self._transport.capabilities.in_process and self._dynamic is None:
            # (see watch_peers; a dynamic worker published its mark as it entered the
            # roster)
            self._store.set(f"process/{self.rank}", local_mark())
        if self._dynamic is not None:
            self._start_heartbeat()  # (a dynamic worker is ready once connected)

    def watch_peers(self, timeout: float | None) -> None:
        """A static world is ready (every worker passed the ``ready`` barrier): read the
        peers' process marks and start the heartbeat.

        Not before: while a world starts, its workers are busy importing and connecting
        (64 on 2 cores: a minute), and a peer's silence then says nothing. The marks are
        read in one store operation now, so that the heartbeat need not ask the store
        when a peer goes quiet, which on a starved host answers late.
        """
        self._learn_peer_processes(timeout)
        self._start_heartbeat()

    def _start_heartbeat(self) -> None:
        interval, timeout = self.options.heartbeat_interval, self.options.heartbeat_timeout
        if interval > 0 and timeout > 0 and not self._transport.capabilities.in_process:
            # (threads of one process cannot hang apart)
            self._health.start_heartbeat(self.rank, interval, self._executors.requests,
                                         vouch=self._peer_processes.vouch,
                                         knows=self._peer_processes.knows,
                                         connected=self._connected)

    def _connected(self, rank: int) -> bool:
        """Whether the transport has a connection to ``rank`` (one that connects pairs
        when they first talk may have none yet)."""
        return not self._on_demand or self._transport.connected(rank)  # type: ignore[attr-defined]

    def _learn_peer_processes(self, timeout: float | None) -> None:
        store = self._store
        if store is None or self._transport.capabilities.in_process:
            return
        ranks = [w.id for w in self.workers if w.id != self.rank and is_member(w)]
        keys = [f"process/{rank}" for rank in ranks]
        try:
            # (check first: multi_get waits for missing keys, a lost worker's say)
            if ranks and store.check(keys, timeout):
                self._peer_processes.learn(dict(zip(ranks, store.multi_get(keys, timeout),
                                                    strict=True)))
        except RpcError as exc:
            log.debug("%s: peers' process marks not read: %s", self.name, exc)

    def _process_mark(self, rank: int) -> bytes | None:
        """The process mark worker ``rank`` published, if any (for the heartbeat)."""
        store, key = self._store, f"process/{rank}"
        if store is None or not store.check([key], _MARK_FETCH_TIMEOUT):
            return None  # (a get of a missing key would hold the store's caller)
        return bytes(store.get(key, _MARK_FETCH_TIMEOUT))

    def barrier(self, tag: str, timeout: float | None) -> None:
        """Wait until every live worker reached the barrier ``tag``."""
        self._wait_at(tag, timeout, probe=False)

    def leaving_barrier(self, tag: str, timeout: float | None) -> None:
        """One of shutdown's barriers: as :meth:`barrier`, and a worker that may be gone
        without a word to this one is probed (see :meth:`_probe`)."""
        self._wait_at(tag, timeout, probe=self._on_demand)

    def _wait_at(self, tag: str, timeout: float | None, probe: bool) -> None:
        rendezvous.barrier(
            self._store, tag, self.rank, self.world_size, timeout=timeout,
            is_gone=self.is_lost, waiter=self.name,
            describe=lambda ranks: ", ".join(self.workers[r].name for r in ranks),
            probe=self._probe if probe else None,
        )

    @functools.cached_property
    def _on_demand(self) -> bool:
        """Whether the transport connects pairs when they first talk (asked once it
        started: it decides at start)."""
        transport = self._transport
        return isinstance(transport, ReportsConnections) and transport.connects_on_demand()

    def _probe(self, missing: list[int]) -> None:
        """Ping the workers a shutdown barrier still waits for that this worker has no
        connection to (a transport that connects on demand): connecting to one that is
        gone fails, and it is reported lost, so the barrier stops waiting for it (a
        connection would have told of its end at once). Not at ``init_rpc``'s barrier:
        there a late worker is starting, not gone."""
        for rank in missing:
            if rank != self.rank and not self._connected(rank) and not self.is_lost(rank):
                self._calls.send_one_way(self.workers[rank], MessageKind.HEARTBEAT, PING)

    # -------------------------------------------------- what services call

    def request(
        self, dst: WorkerInfo, kind: MessageKind, payload: Any, *, timeout: float | None,
        api: str, target: Any, describe_target: Callable[[Any], str] = describe_callable,
    ) -> RpcFuture[Any]:
        """Send a request and return the future of its reply.

        ``api`` and ``target`` only name the call in error messages ("rpc_sync(mod.f)").
        Raises synchronously if the payload cannot be pickled or the agent is shut down;
        every later failure (timeout, remote error, lost peer) goes to the future.
        """
        return self._calls.request(dst, kind, payload, timeout=timeout, api=api,
                                   target=target, describe_target=describe_target)

    def send_one_way(self, dst: WorkerInfo, kind: MessageKind, payload: Any) -> None:
        """Send a one-way message (no reply, no future); failures are only logged."""
        self._calls.send_one_way(dst, kind, payload)

    def send_frame(self, dst: int, frame: Frame) -> None:
        """Send an encoded frame as it is (tests and tools that forge frames)."""
        self._calls.send_frame(dst, frame)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` soon on the completion lane (never on the calling thread)."""
        self._executors.call_soon(fn, *args)

    def is_lost(self, rank: int) -> bool:
        """Whether worker ``rank`` is known to be gone (died, or left the world; in a
        dynamic world also a rank no worker holds)."""
        return self._health.is_lost(rank) or not self.roster.holds(rank)

    def lost_error(self, rank: int, call: str) -> PeerLostError:
        """The error of ``call`` to worker ``rank``, known gone: worded as every call's."""
        return self._health.error_for(rank, call)

    def wait_lost(self, rank: int, timeout: float | None) -> bool:
        """Wait until worker ``rank`` is known gone and this worker has reacted to it
        (its pending calls failed, the services' hooks run); False after ``timeout``."""
        return self._health.wait_lost(rank, timeout)

    def is_unresponsive(self, rank: int) -> bool:
        """Whether worker ``rank`` is silent past ``heartbeat_timeout`` right now."""
        return self._health.is_unresponsive(rank)

    def wait_responsive(self, rank: int, timeout: float) -> bool:
        """Wait (at most ``timeout``) until worker ``rank`` is not marked unresponsive."""
        return self._health.wait_responsive(rank, timeout)

    # --------------------------------------------------------------- leaving

    def shutdown(self, graceful: bool = True, timeout: float | None = None) -> bool:
        """Leave the world.

        Graceful: wait until this worker's own calls are done, then for every live worker
        to arrive (a barrier through the store), then close. ``timeout`` bounds the whole
        wait (``None`` waits as long as peers are alive, logging progress). Non-graceful:
        fail pending calls at once and close locally. Returns False if the worker was
        already shutting down (or shut down) when called.
        """
        return self._shutdown.run(graceful, timeout)

    def say_leaving(self, why: int) -> None:
        """Tell every live peer that this worker is about to leave without ``shutdown()``
        (``why``: a ``LEAVING_*`` code of :mod:`rpcx.messages`), so they report it as such,
        not as "has shut down". The caller shuts down non-gracefully next: the goodbye
        follows this message on each link. Peers silent now are skipped, and no message
        starts after ``_FAREWELL_BOUND`` (the peers not told by then say "has shut down").
        Never raises."""
        if not self._life.running:
            return
        peers = [w for w in self.roster.members() if w.id != self.rank and self._connected(w.id)
                 and not self.is_lost(w.id) and not self.is_unresponsive(w.id)]
        late = threading.Event()

        def tell() -> None:
            for worker in peers:
                if late.is_set():
                    return
                self._calls.send_one_way(worker, MessageKind.LEAVING, why)

        teller = threading.Thread(target=tell, name=f"rpcx-{self.name}-farewell", daemon=True)
        try:
            teller.start()
        except RuntimeError as exc:  # (Python 3.12.0-3.12.1 start no thread at exit)
            log.debug("%s: peers not told it leaves: %s", self.name, exc)
            return
        teller.join(_FAREWELL_BOUND)
        late.set()
        if teller.is_alive():
            log.debug("%s: not every peer was told it leaves within %g s", self.name,
                      _FAREWELL_BOUND)

    def _teardown(self, graceful: bool) -> Sequence[TeardownStep]:
        """What closes, in order, when the worker leaves."""
        def leave(deadline: float | None) -> None:
            if self._dynamic is None:  # (a dynamic world's store host waits for nobody)
                rendezvous.leave(self._store, self.rank, self.world_size, self.is_lost,
                                 timeout=step_bound(deadline, rendezvous.LEAVE_TIMEOUT)
                                 if graceful else 0.0)
            self._store = None  # the last reference may host the rendezvous server
            _context.forget(self)

        def close_transport(deadline: float | None) -> None:
            # A dynamic worker leaves under the membership token, so that no newcomer
            # dials it while it closes; static worlds need none.
            with (self._dynamic.departing(step_bound(deadline)) if self._dynamic is not None
                  else contextlib.nullcontext()):
                self._transport.close(step_bound(deadline))

        return [
            # (first: peers that say goodbye as this worker leaves are no news to anyone)
            ("membership callbacks", lambda deadline: self.membership.close()),
            ("transport", close_transport),
            *[(name, bounded(step)) for name, step in self._executors.teardown()],
            ("retransmission", bounded(self._retransmission.close)),
            ("services", each_hook(self.on_close, self.name)),
            ("rendezvous", leave),
        ]

    # ----------------------------------------------------------- callbacks

    def _on_peer_lost(self, rank: int, cause: LostCause, detail: str = "") -> None:
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
            self.roster.depart(rank, reason)
        departed = cause is LostCause.DEPARTED
        first = self.membership.gone(rank, self.workers[rank], departed, reason,
                                     tuple(self.roster.members()))
        if first and self._dynamic is not None and not departed and self._life.running:
            # Killed, not left: its entry in the store's roster stays until a member
            # strikes it off (on a thread of its own: this one must not block).
            threading.Thread(target=self._strike_off, args=(rank, self.workers[rank].name),
                             name=f"rpcx-strike-off-{rank}", daemon=True).start()

    def _strike_off(self, rank: int, name: str) -> None:
        assert self._dynamic is not None
        try:
            self._dynamic.strike_off(rank, name, _STRIKE_OFF_TIMEOUT)
        except RpcError as exc:  # (the store's host may be the one that died)
            log.info("%s: could not strike worker %r (rank %d) off the dynamic world's "
                     "roster: %s", self.name, name, rank, exc)

    def _admit(self, rank: int) -> str:
        """A worker joined this dynamic world at ``rank`` (the transport calls this when it
        connects, before anything from it is delivered): enter it; its name."""
        assert self._dynamic is not None
        worker = WorkerInfo(self._dynamic.member(rank), rank)
        self.roster.admit(worker)  # (raises for a rank or a name taken)
        names = self._transport_names
        names.extend(w.name for w in self.workers[len(names):])
        names[rank] = worker.name
        self._health.watch(rank)
        self.membership.joined(worker, tuple(self.roster.members()))
        return worker.name

    def _bind_thread(self) -> None:
        adopt_intra_op_threads()  # pool threads run handlers and callbacks
        _context.bind_agent(self)

