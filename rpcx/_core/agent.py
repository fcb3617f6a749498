"""The RPC agent: one per worker, a facade over the parts that do the work.

It knows the worker's identity, resolves destinations, registers handlers, starts the
transport and holds the barrier; everything else it hands on to the parts
:func:`~rpcx._core.assembly.assemble` builds:

* :mod:`rpcx._core.call_path`: send a request, receive a frame, serve it, complete the call
  (read it top to bottom to follow a call);
* :mod:`rpcx._core.peer_health`: lost and silent peers, heartbeats;
* :mod:`rpcx._core.presence`: barriers, the peers' process marks, the heartbeat's start;
* :mod:`rpcx._core.peer_events`: peers lost, newcomers admitted, this worker's farewell;
* :mod:`rpcx._core.shutdown`: the worker's state and the way out;
* :mod:`rpcx._core.executors`: request pool, completion lane, followers, timer;
* optional policies with do-nothing defaults: back-pressure (:mod:`rpcx._core.budget`) and
  retransmission on lossy transports (:mod:`rpcx._core.retransmit`).

The agent never knows how a frame travels (that is the transport's job; with a world
key, :mod:`rpcx._wire.keyed` seals and checks every frame), nor what a message means
beyond its kind (services register handlers per kind).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rpcx._core import context as _context
from rpcx._core.assembly import assemble
from rpcx._core.label import CallLabel
from rpcx._core.peer_events import DynamicMembership
from rpcx._core.service_host import Deferred, Handler, MessageScope, NoteSource
from rpcx._core.shutdown import TeardownStep, bounded, each_hook, step_bound
from rpcx._core.trace_policy import NoTrace
from rpcx._util.intra_op import adopt_intra_op_threads
from rpcx._wire.auth import ConnectionAuth, FrameGuard
from rpcx._wire.devices import DeviceRoutes
from rpcx._world import rendezvous
from rpcx._world.membership_events import MembershipChange
from rpcx.errors import PeerLostError
from rpcx.futures import RpcFuture
from rpcx.messages import MessageKind
from rpcx.options import RpcBackendOptions
from rpcx.transport import Frame, Transport, TransportContext
from rpcx.worker import WorkerInfo, is_member

__all__ = ["Deferred", "DynamicMembership", "Handler", "MessageScope", "NoteSource",
           "RpcAgent"]

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
        # (incarnation, on_drain, on_close: what they are is in ServiceHost's docs)
        self.incarnation = 0 if dynamic is None else dynamic.incarnation
        self.on_drain: list[Callable[[float | None], int]] = []
        self.on_close: list[Callable[[float | None], None]] = []
        self.workers = workers
        self.backend = backend
        self.options = options
        self.init_method = init_method
        self.rpc_timeout: float = options.rpc_timeout
        self.routes = routes if routes is not None else DeviceRoutes(rank, self.names)
        self.services: dict[str, Any] = {}  # per-worker state of services (RRef tables, ...)
        # With a world key the transport seals and checks every frame (init_rpc wraps it:
        # rpcx._wire.keyed); the agent only reports what the guard refused.
        self.guard = guard
        self._connection_auth = connection_auth
        self._dynamic = dynamic
        self._transport_names = [w.name for w in workers]  # (the transport's view)
        self._transport = transport
        parts = assemble(
            host=self, name=self.name, rank=rank, workers=workers, store=store,
            transport=transport, options=options, routes=self.routes,
            transport_names=self._transport_names, dynamic=dynamic,
            bind_thread=self._bind_thread, on_drain=self.on_drain, teardown=self._teardown)
        self._parts, self._shutdown = parts, parts.shutdown
        self._life, self._pending, self._executors = parts.lifecycle, parts.pending, parts.executors
        self._back_pressure, self._retransmission = parts.back_pressure, parts.retransmission
        self._health, self._calls, self._presence = parts.health, parts.calls, parts.presence
        self.roster, self.membership, self._events = parts.roster, parts.membership, parts.events
        self.stopping = self._life.stopping  # set when shutdown() starts
        # (services add to these: see ServiceHost)
        self.note_sources: list[NoteSource] = self._calls.note_sources
        self.on_peer_lost: list[Callable[[int], None]] = self._health.on_peer_lost
        self.on_rank_reused: list[Callable[[int], None]] = self.roster.on_rejoin
        self.on_peer_silent: list[Callable[[int], None]] = self._health.on_peer_silent

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
        """The ``WorkerInfo`` for a name, a rank or a ``WorkerInfo`` (see
        :meth:`Roster.resolve <rpcx._world.membership.Roster.resolve>`)."""
        return self.roster.resolve(to)

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
        """See :meth:`~rpcx._core.service_host.ServiceHost.stats` (what ``debug_info`` reports)."""
        return self._parts.stats(self._transport, self.guard, self.names, self.rank)

    # ------------------------------------------------------- handlers, start

    def register_handler(
        self, kind: MessageKind, handler: Handler, *, in_order: bool = False,
        on_decode_error: Callable[[WorkerInfo, Any, BaseException], None] | None = None,
    ) -> None:
        """See :meth:`~rpcx._core.service_host.ServiceHost.register_handler`."""
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
        self._transport.start(TransportContext(
            rank=self.rank, world_size=self.world_size, names=self._transport_names,
            store=rendezvous.prefixed(self._presence.store, "transport",
                                      self.options.rpc_timeout or None),
            options=self.options,
            init_method=self.init_method, deliver=self._calls.on_frame,
            peer_lost=self._events.peer_lost,
            routes=self.routes,
            receive_lane=lambda name, resume: self._executors.new_lane(name, resume, self),
            auth=self._connection_auth,
            admit=self._events.admit if self._dynamic is not None else None,
            vacant=lambda rank: rank >= len(self.workers) or not is_member(self.workers[rank]),
            progress=self._health.progress,
        ))
        self._presence.started(dynamic=self._dynamic is not None)

    def watch_peers(self, timeout: float | None) -> None:
        """A static world is ready: read the peers' process marks and start the heartbeat
        (see :meth:`Presence.watch_peers <rpcx._core.presence.Presence.watch_peers>`)."""
        self._presence.watch_peers(timeout)

    def barrier(self, tag: str, timeout: float | None) -> None:
        """Wait until every live worker reached the barrier ``tag``."""
        self._presence.barrier(tag, timeout)

    # -------------------------------------------------- what services call

    def request(
        self, dst: WorkerInfo, kind: MessageKind, payload: Any, *, timeout: float | None,
        label: CallLabel,
    ) -> RpcFuture[Any]:
        """See :meth:`~rpcx._core.service_host.ServiceHost.request`."""
        return self._calls.request(dst, kind, payload, timeout=timeout, label=label)

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
        return self._parts.is_lost(rank)

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
        """Leave the world (see :meth:`~rpcx._core.service_host.ServiceHost.shutdown`)."""
        return self._shutdown.run(graceful, timeout)

    def say_leaving(self, why: int) -> None:
        """Tell every live peer this worker leaves without ``shutdown()`` (``why``: a
        ``LEAVING_*`` code of :mod:`rpcx.messages`); the caller shuts down non-gracefully
        next (see :meth:`PeerEvents.say_leaving <rpcx._core.peer_events.PeerEvents.say_leaving>`).
        Never raises."""
        self._events.say_leaving(self.rank, why)

    def _teardown(self, graceful: bool) -> Sequence[TeardownStep]:
        """What closes, in order, when the worker leaves."""
        def leave(deadline: float | None) -> None:
            self._presence.leave(graceful, deadline, dynamic=self._dynamic is not None)
            _context.forget(self)

        def close_transport(deadline: float | None) -> None:
            with self._events.departing(step_bound(deadline)):
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

    def _bind_thread(self) -> None:
        adopt_intra_op_threads()  # pool threads run handlers and callbacks
        _context.bind_agent(self)

