"""The agent as services see it: :class:`ServiceHost`, and what a handler returns.

Services (calls, RRefs, distributed autograd, the optimizer, RemoteModule) are written
against this protocol, not against :class:`rpcx.agent.RpcAgent`: it lists exactly what
they use of the agent. ``RpcAgent`` satisfies it (mypy checks that where ``init_rpc``
installs the services), and a test can hand a service anything else that does.

The contract types a handler deals in (:class:`Deferred`, ``Handler``,
:class:`MessageScope`, :class:`NoteSource`) are re-exported here from the agent layer, so
that services import nothing of the agent beyond this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from rpcx.agent import Deferred, Handler, MessageScope, NoteSource, describe_callable
from rpcx.errors import PeerLostError
from rpcx.futures import RpcFuture
from rpcx.messages import MessageKind
from rpcx.worker import WorkerInfo

__all__ = [
    "Deferred",
    "Handler",
    "MessageScope",
    "NoteSource",
    "ServiceHost",
    "describe_callable",
]


class ServiceHost(Protocol):
    """What services use of their worker's agent."""

    info: WorkerInfo
    """This worker's ``WorkerInfo``."""
    workers: list[WorkerInfo]
    """Every worker of the world, by rank."""
    services: dict[str, Any]
    """Per-worker state of services, by service name (the RRef table, autograd's)."""
    scope: MessageScope | None
    """The service whose per-call scope travels with requests (distributed autograd)."""
    on_drain: list[Callable[[float | None], int]]
    """Hooks run by a graceful shutdown until no worker sends anything more."""
    on_close: list[Callable[[float | None], None]]
    """Hooks run once the transport closed."""

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

    def register_handler(
        self, kind: MessageKind, handler: Handler, *, in_order: bool = False,
        on_decode_error: Callable[[WorkerInfo, Any, BaseException], None] | None = None,
    ) -> None:
        """Run ``handler`` for every message of ``kind`` this worker receives."""

    def request(
        self, dst: WorkerInfo, kind: MessageKind, payload: Any, *, timeout: float | None,
        api: str, target: Any, describe_target: Callable[[Any], str] = ...,
    ) -> RpcFuture[Any]:
        """Send a request and return the future of its reply."""

    def send_one_way(self, dst: WorkerInfo, kind: MessageKind, payload: Any) -> None:
        """Send a one-way message (no reply, no future); failures are only logged."""

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` soon on the completion lane (never on the calling thread)."""

    def resolve(self, to: str | int | WorkerInfo) -> WorkerInfo:
        """The ``WorkerInfo`` for a name, a rank or a ``WorkerInfo``."""

    def timeout_for(self, timeout: float | None) -> float | None:
        """Seconds for a call's ``timeout`` argument: negative/None = default, 0 = none."""

    def is_lost(self, rank: int) -> bool:
        """Whether worker ``rank`` is known to be gone (died, or left the world)."""

    def lost_error(self, rank: int, call: str) -> PeerLostError:
        """The error of ``call`` to worker ``rank``, known gone: worded as every call's."""
