"""The agent as services see it: :class:`ServiceHost`, and what a handler returns.

Services (calls, RRefs, distributed autograd, the optimizer, RemoteModule) are written
against this protocol, not against :class:`rpcx._core.agent.RpcAgent`: it lists exactly what
they use of the agent. ``RpcAgent`` satisfies it (mypy checks that where ``init_rpc``
installs the services), and a test can hand a service anything else that does.

The contract types between services and the agent (:class:`Deferred`, ``Handler``,
:class:`MessageScope`, :class:`NoteSource`) are declared here too, below the agent, so
that services import nothing of the agent and the agent's call path imports them from
here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rpcx._core.label import CallLabel, describe_callable
from rpcx._core.trace_policy import NoTrace
from rpcx._wire.devices import DeviceRoutes
from rpcx._world.membership_events import MembershipChange
from rpcx.errors import PeerLostError
from rpcx.futures import RpcFuture
from rpcx.messages import MessageKind
from rpcx.worker import WorkerInfo

__all__ = [
    "ID_SPAN",
    "CallLabel",
    "Deferred",
    "Handler",
    "MessageScope",
    "NoteSource",
    "ServiceHost",
    "describe_callable",
    "first_id",
]


# A request handler gets the caller and the decoded payload and returns the reply value,
# or a Deferred whose future supplies it later. Raising sends the error to the caller.
Handler = Callable[[WorkerInfo, Any], Any]


class MessageScope(Protocol):
    """A service's per-call state that travels with requests and their replies.

    Distributed autograd is the one user: its context id. A request sent while a scope is
    current carries it; the callee decodes and serves the request with that scope entered
    and its reply carries it back. (See the codec's scope hooks for what it is used for.)
    """

    def outgoing(self, dst: int) -> int | None:
        """The scope for a request to rank ``dst`` sent now from this thread, or ``None``."""

    def entered(self, scope: int, src: int) -> contextlib.AbstractContextManager[Any]:
        """Make ``scope`` current on this thread while a request from ``src`` is served."""


class NoteSource(Protocol):
    """A service whose one-way messages to a peer ride in frames sent to it anyway."""

    def notes_for(self, dst: int) -> list[tuple[int, Any]]:
        """Notes ``(kind, payload)`` for a frame about to be sent to rank ``dst``."""

    def notes_not_sent(self, dst: int, notes: list[tuple[int, Any]]) -> None:
        """Take back notes whose frame could not be encoded."""


@dataclass(frozen=True)
class Deferred:
    """Returned by a handler whose reply comes later: the reply is this future's outcome."""

    future: torch._C.Future[Any]


ID_SPAN = 1 << 32  # ids (of RRefs, of autograd contexts) one holder of a rank may make


def first_id(incarnation: int) -> int:
    """The first id the ``incarnation``-th holder of a rank makes (see
    :attr:`ServiceHost.incarnation`): past every id its predecessors could make."""
    return incarnation * ID_SPAN + 1


class ServiceHost(Protocol):
    """What the layers above the agent use of it: services, the public API, the kit."""

    info: WorkerInfo
    """This worker's ``WorkerInfo``."""
    workers: list[WorkerInfo]
    """Every worker of the world, by rank."""
    services: dict[str, Any]
    """Per-worker state of services, by service name (the RRef table, autograd's)."""
    scope: MessageScope | None
    """The service whose per-call scope travels with requests (distributed autograd)."""
    on_drain: list[Callable[[float | None], int]]
    """Hooks run by a graceful shutdown, once every worker has stopped calling: each
    sends what it still owes its peers, waits for the acknowledgements and returns how
    many messages that took; repeated, world-wide, until nobody sends anything. A hook
    gets the seconds left of shutdown's budget (``None``: no bound) and must return
    within them."""
    on_close: list[Callable[[float | None], None]]
    """Hooks run once the transport closed, with the seconds left (as ``on_drain``)."""
    routes: DeviceRoutes
    """The world's device maps as they apply to this worker."""
    backend: str
    """The backend's name."""
    rpc_timeout: float
    """The default call timeout in seconds (0: none)."""
    incarnation: int
    """How many workers held this worker's rank before it (a dynamic world; else 0).
    Ids this worker makes must not repeat theirs: other workers may remember them."""
    trace: NoTrace
    """The trace policy (``rpcx.tracing``): services record point events with
    ``trace.instant``."""

    @property
    def name(self) -> str:
        """This worker's name."""

    @property
    def rank(self) -> int:
        """This worker's rank."""

    @property
    def world_size(self) -> int:
        """Number of workers in the world."""

    @property
    def is_running(self) -> bool:
        """True until ``shutdown`` starts tearing the agent down."""

    @property
    def lossy(self) -> bool:
        """True if the transport may lose frames (bookkeeping is then acknowledged)."""

    @property
    def note_sources(self) -> list[NoteSource]:
        """Services whose one-way messages ride in frames sent anyway (RRef deletions)."""

    @property
    def on_peer_lost(self) -> list[Callable[[int], None]]:
        """Hooks run with a rank when that peer died or left."""

    @property
    def on_rank_reused(self) -> list[Callable[[int], None]]:
        """Hooks run with a rank a new worker took after the one before it left (a
        dynamic world): what was remembered about the old one's loss must not apply
        to it."""

    @property
    def on_peer_silent(self) -> list[Callable[[int], None]]:
        """Hooks run with a rank when that peer went silent past ``heartbeat_timeout``."""

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

    def request(
        self, dst: WorkerInfo, kind: MessageKind, payload: Any, *, timeout: float | None,
        label: CallLabel,
    ) -> RpcFuture[Any]:
        """Send a request and return the future of its reply.

        ``label`` only names the call in error messages, traces and profiles
        ("rpc_sync(mod.f)").
        Raises synchronously if the payload cannot be pickled or the agent is shut down;
        every later failure (timeout, remote error, lost peer) goes to the future.
        """

    def send_one_way(self, dst: WorkerInfo, kind: MessageKind, payload: Any) -> None:
        """Send a one-way message (no reply, no future); failures are only logged."""

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` soon on the completion lane (never on the calling thread)."""

    def members(self) -> list[WorkerInfo]:
        """The workers of the world now, by rank (``workers`` less vacant ranks and, in a
        dynamic world, those that left)."""

    def on_membership_change(self, callback: Callable[[MembershipChange], object]
                             ) -> Callable[[], None]:
        """Run ``callback`` on each join, departure and loss from now on (see
        :func:`rpcx.on_membership_change`); the function that stops it."""

    def resolve(self, to: str | int | WorkerInfo) -> WorkerInfo:
        """The ``WorkerInfo`` for a name, a rank or a ``WorkerInfo``."""

    def timeout_for(self, timeout: float | None) -> float | None:
        """Seconds for a call's ``timeout`` argument: negative/None = default, 0 = none."""

    def stats(self) -> dict[str, Any]:
        """This worker's call traffic, for ``debug_info``: ``pending_calls``,
        ``request_threads``, ``lost_peers``, ``lost_causes``, ``unresponsive_peers``,
        ``authenticated``, ``encrypted_peers``, ``refused_frames``, ``resent_frames``,
        ``bytes_in_flight``, ``calls_held_back``, ``routes`` (peer name: how the
        transport reaches it, for transports that choose per peer) and
        ``connected_peers`` (how many peers this worker has a connection to; every one,
        unless the transport connects on demand)."""

    def shutdown(self, graceful: bool = True, timeout: float | None = None) -> bool:
        """Leave the world.

        Graceful: wait until this worker's own calls are done, then for every live worker
        to arrive (a barrier through the store), then close. ``timeout`` bounds the whole
        wait (``None`` waits as long as peers are alive, logging progress). Non-graceful:
        fail pending calls at once and close locally. Returns False if the worker was
        already shutting down (or shut down) when called.
        """

    def say_leaving(self, why: int) -> None:
        """Tell the live peers this worker leaves without ``shutdown()`` (see
        ``RpcAgent.say_leaving``)."""

    def is_unresponsive(self, rank: int) -> bool:
        """Whether worker ``rank`` is silent past ``heartbeat_timeout`` right now."""

    def wait_responsive(self, rank: int, timeout: float) -> bool:
        """Wait (at most ``timeout``) until worker ``rank`` is not marked unresponsive."""

    def is_lost(self, rank: int) -> bool:
        """Whether worker ``rank`` is known to be gone (died, or left the world)."""

    def lost_error(self, rank: int, call: str) -> PeerLostError:
        """The error of ``call`` to worker ``rank``, known gone: worded as every call's."""
