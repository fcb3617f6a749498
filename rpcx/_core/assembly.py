"""Building a worker's parts in the order they depend on each other.

The call path needs the pools, the table of pending calls and the peers' health; the
timer, the resender and the peers' health call back into the call path (a deadline
passed, a copy to resend, calls to fail, a ping to send). Those callbacks go through
:class:`CallsPort`, plugged in once the call path exists, so each part is built whole,
once, and the agent (:mod:`rpcx._core.agent`) only hands work to what :func:`assemble`
returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rpcx._core.budget import BackPressure, BytesInFlight
from rpcx._core.call_path import CallPath
from rpcx._core.executors import Executors
from rpcx._core.peer_events import DynamicMembership, PeerEvents
from rpcx._core.peer_health import PeerHealth
from rpcx._core.pending import PendingCall, PendingCalls
from rpcx._core.presence import Presence
from rpcx._core.profiling import mark_profiler_node
from rpcx._core.retransmit import NoRetransmission, Retransmission
from rpcx._core.shutdown import Lifecycle, Shutdown, TeardownStep
from rpcx._wire.auth import FrameGuard
from rpcx._wire.devices import DeviceRoutes
from rpcx._world.membership import Roster
from rpcx._world.membership_events import MembershipWatchers
from rpcx.messages import MessageKind
from rpcx.options import RpcBackendOptions
from rpcx.transport import DescribesRoutes, Frame, Transport
from rpcx.worker import WorkerInfo

__all__ = ["CallsPort", "Parts", "assemble"]


class CallsPort:
    """The call path as the parts built before it call it: the timer (``expire``), the
    resender (``send_copy``), the peers' health (``fail``, ``send_one_way``). Plugged
    (:meth:`plug`) as soon as the call path exists, before anything can call."""

    __slots__ = ("_calls",)

    def __init__(self) -> None:
        self._calls: CallPath | None = None

    def plug(self, calls: CallPath) -> None:
        """Route every entry to ``calls`` from now on."""
        self._calls = calls

    def expire(self, rid: int) -> None:
        """Call ``rid``'s deadline passed."""
        assert self._calls is not None
        self._calls.expire(rid)

    def send_copy(self, dst: int, frame: Frame) -> None:
        """Send a copy of a bookkeeping frame again (lossy transports)."""
        assert self._calls is not None
        self._calls.send_copy(dst, frame)

    def fail(self, rids: list[int], error: Callable[[PendingCall], BaseException]) -> None:
        """Fail these pending calls (their peer is lost)."""
        assert self._calls is not None
        self._calls.fail(rids, error)

    def send_one_way(self, dst: WorkerInfo, kind: MessageKind, payload: Any) -> None:
        """Send a one-way message (a heartbeat, a farewell)."""
        assert self._calls is not None
        self._calls.send_one_way(dst, kind, payload)


@dataclass(frozen=True)
class Parts:
    """A worker's parts (see docs/design/architecture.md, "The agent: a facade")."""

    lifecycle: Lifecycle
    pending: PendingCalls
    executors: Executors
    back_pressure: BackPressure
    retransmission: NoRetransmission
    health: PeerHealth
    calls: CallPath
    roster: Roster
    membership: MembershipWatchers
    presence: Presence
    events: PeerEvents
    shutdown: Shutdown
    is_lost: Callable[[int], bool]
    """Whether worker ``rank`` is known to be gone (died, or left the world; in a
    dynamic world also a rank no worker holds)."""

    def stats(self, transport: Transport, guard: FrameGuard | None,
              names: list[str], rank: int) -> dict[str, Any]:
        """What ``debug_info`` reports of this worker's traffic (see
        ``RpcAgent.stats``)."""
        routes = transport.routes() if isinstance(transport, DescribesRoutes) else {}
        return {
            "pending_calls": len(self.pending),
            "request_threads": self.executors.requests.thread_count,
            **self.health.stats(),
            "authenticated": guard is not None,
            "refused_frames": guard.refused if guard is not None else 0,
            # Peers this worker encrypts frames with (a cipher: encrypt was set).
            "encrypted_peers": sum(1 for peer, on in enumerate(getattr(guard, "encrypted", ()))
                                   if on and peer != rank),
            "resent_frames": self.retransmission.resent,
            **self.back_pressure.report(names),
            "routes": {names[peer]: how for peer, how in sorted(routes.items())},
            "connected_peers": sum(1 for w in self.roster.members()
                                   if w.id != rank and self.presence.connected(w.id)),
        }


def assemble(*, host: Any, name: str, rank: int, workers: list[WorkerInfo], store: Any,
             transport: Transport, options: RpcBackendOptions, routes: DeviceRoutes,
             transport_names: list[str],
             dynamic: DynamicMembership | None, bind_thread: Callable[[], None],
             on_drain: list[Callable[[float | None], int]],
             teardown: Callable[[bool], Sequence[TeardownStep]]) -> Parts:
    """Build one worker's parts; ``host`` is its agent (the codec binds RRefs to it),
    ``bind_thread`` what every thread of its pools runs first, ``on_drain`` the
    services' drain hooks and ``teardown`` the order things close in (see
    :class:`~rpcx._core.shutdown.Shutdown`)."""
    capabilities = transport.capabilities
    if capabilities.multi_process:
        mark_profiler_node(rank)  # (torch's profiler: events carry the worker's rank)
    port = CallsPort()
    life, pending = Lifecycle(), PendingCalls()
    back_pressure = (BytesInFlight(len(workers), options.max_bytes_in_flight)
                     if options.max_bytes_in_flight > 0 else BackPressure())
    executors = Executors(name, options.num_worker_threads, bind_thread, port.expire,
                          pending.__contains__)
    # On a transport that may lose or duplicate frames, bookkeeping is acknowledged and
    # sent again until answered; on reliable ones nothing is.
    retransmission = (Retransmission(f"rpcx-{name}", len(workers), port.send_copy,
                                     pending.__contains__, bind_thread)
                      if capabilities.lossy else NoRetransmission())
    health = PeerHealth(
        name=name, workers=workers, lifecycle=life, pending=pending, fail=port.fail,
        on_forget=[retransmission.forget, lambda _: back_pressure.wake()],
        heartbeat_timeout=options.heartbeat_timeout, departures_expected=dynamic is not None,
        send_one_way=port.send_one_way)
    calls = CallPath(
        host=host, workers=workers, rank=rank, transmit_frame=transport.send,
        lifecycle=life, executors=executors, pending=pending, lost_error=health.lost_error,
        heard=health.heard, routes=routes, stage_devices=not capabilities.cuda_direct,
        back_pressure=back_pressure, retransmission=retransmission)
    port.plug(calls)
    calls.register(int(MessageKind.HEARTBEAT), health.on_heartbeat, True, None)
    calls.register(int(MessageKind.LEAVING), health.on_leaving, True, None)
    # rpcx.tracing's clock probes: read the clock as the request arrives
    calls.register(int(MessageKind.CLOCK), lambda caller, payload: time.monotonic_ns(), True,
                   None)
    # Who holds each rank; in a dynamic world it changes as workers join and leave.
    roster = Roster(workers, dynamic=dynamic is not None)
    roster.growers += [health.grow, calls.grow, back_pressure.grow, retransmission.grow]

    def is_lost(rank: int) -> bool:
        return health.is_lost(rank) or not roster.holds(rank)

    presence = Presence(name=name, rank=rank, workers=workers, store=store,
                        transport=transport, health=health, executors=executors,
                        options=options, is_lost=is_lost, send_one_way=calls.send_one_way)
    # User code told of joins, departures and losses (rpcx.on_membership_change).
    membership = MembershipWatchers(name, bind_thread)
    events = PeerEvents(
        name=name, workers=workers, roster=roster, health=health, membership=membership,
        lifecycle=life, dynamic=dynamic, transport_names=transport_names,
        send_one_way=calls.send_one_way,
        reachable=lambda rank: (presence.connected(rank) and not is_lost(rank)
                                and not health.is_unresponsive(rank)))
    roster.on_rejoin += [membership.rank_reused, calls.rejoined, retransmission.forget,
                         presence.peer_processes.forget]
    shutdown = Shutdown(
        name=name, rank=rank, world_size=len(workers), lifecycle=life,
        alone=dynamic is not None, pending=pending, store=store,
        barrier=lambda tag, timeout: presence.barrier(tag, timeout, leaving=True),
        is_lost=is_lost, on_drain=on_drain, before_waits=health.stop_heartbeat,
        cancel_pending=calls.cancel_all, teardown=teardown)
    return Parts(lifecycle=life, pending=pending, executors=executors,
                 back_pressure=back_pressure, retransmission=retransmission, health=health,
                 calls=calls, roster=roster, membership=membership, presence=presence,
                 events=events, shutdown=shutdown, is_lost=is_lost)
