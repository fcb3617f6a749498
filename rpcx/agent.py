"""The RPC agent: one per worker. Request ids, pending futures, dispatch, timeouts, the
request pool, failure propagation and the shutdown barrier.

The agent never knows how a frame travels (that is the transport's job) and never knows
what a message means beyond its kind (services register handlers per kind).

Threads: the transport delivers frames on its own threads. Responses complete their
futures right there; requests go to the bounded, elastic request pool. One timer thread
fails calls whose deadline passes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rpcx import _context, rendezvous
from rpcx._budget import PeerBudget
from rpcx._heartbeat import Heartbeat
from rpcx._lanes import LaneWatch, ReceiveLane, current_lane
from rpcx._memory import copy_of
from rpcx._pending import CLOSED, PendingCall, PendingCalls, describe_callable
from rpcx._pool import WorkerPool, blocking, current_pool
from rpcx._recent import RecentIds
from rpcx._retransmit import Retransmission
from rpcx._timer import DeadlineTimer, remaining, within
from rpcx.auth import ConnectionAuth, FrameGuard
from rpcx.devices import DeviceRoutes
from rpcx.errors import (
    LostCause,
    PeerLostError,
    RemoteErrorInfo,
    RpcError,
    RpcShutdownError,
    RpcTimeoutError,
    SerializationError,
    UnknownWorkerError,
    lost_reason,
)
from rpcx.futures import RpcFuture, add_internal_callback, settle_inline
from rpcx.messages import CONTROL_KINDS, PING, PONG, MessageKind
from rpcx.options import RpcBackendOptions
from rpcx.serialization import (
    DecodeContext,
    EncodeContext,
    decode_envelope,
    decode_notes,
    decode_payload,
    decode_scope,
    encode,
    has_notes,
)
from rpcx.transport import Frame, Transport, TransportContext
from rpcx.worker import WorkerInfo

__all__ = [
    "Deferred",
    "Handler",
    "MessageScope",
    "NoteSource",
    "RpcAgent",
    "describe_callable",
]

log = logging.getLogger("rpcx.agent")

# A request handler gets the caller and the decoded payload and returns the reply value,
# or a Deferred whose future supplies it later. Raising sends the error to the caller.
Handler = Callable[[WorkerInfo, Any], Any]

_RUNNING, _STOPPING, _CLOSED = "running", "stopping", "closed"


class _Delivering(threading.local):
    active = False  # True while this thread delivers a frame (a transport's thread)


_delivering = _Delivering()
_PROGRESS_EVERY = 30.0  # seconds between "still waiting" log lines during long waits
_CLOSE_TIMEOUT = 10.0  # bound on each teardown step when shutdown() has no timeout
# shutdown(timeout=t) keeps this share of t (at most _TEARDOWN_MAX seconds) for the
# teardown after the waits for peers: the goodbye exchange above all, which a live peer
# answers in milliseconds (and a gloo process that exits with a receive pending aborts).
_TEARDOWN_SHARE, _TEARDOWN_MAX = 0.25, 1.0
_DRAIN_ROUNDS = 8
_COMPLETION_THREADS = 16  # plus one per thread blocked in a callback (the pool grows)
# Followers: one per lane receiving plus one per request blocked on a lane; no real bound.
_FOLLOWERS = 1 << 16


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


class RpcAgent:
    """The local end of the RPC world for one worker."""

    def __init__(
        self,
        *,
        rank: int,
        workers: list[WorkerInfo],
        store: Any,
        transport: Transport,
        backend: str,
        options: RpcBackendOptions,
        init_method: str,
        routes: DeviceRoutes | None = None,
        guard: FrameGuard | None = None,
        connection_auth: ConnectionAuth | None = None,
    ) -> None:
        self.info = workers[rank]
        self.workers = workers
        self.backend = backend
        self.options = options
        self.init_method = init_method
        self.rpc_timeout: float = options.rpc_timeout
        names = [w.name for w in workers]
        self.routes = routes if routes is not None else DeviceRoutes(rank, names)
        # Transports that cannot move device memory get non-CPU tensors staged on the host.
        self._stage_devices = not transport.capabilities.cuda_direct
        self.services: dict[str, Any] = {}  # per-worker state of services (RRef tables, ...)
        self.scope: MessageScope | None = None  # set by the autograd service
        self._by_name = {w.name: w for w in workers}
        self._store = store
        self._transport = transport
        # With a world key every frame is sealed on its way out and checked on its way in
        # (rpcx.auth); without one the transport is called directly.
        self.guard = guard
        self._connection_auth = connection_auth
        self._transport_send = (
            transport.send if guard is None
            else lambda dst, frame: transport.send(dst, guard.seal(dst, frame))
        )
        self._handlers: dict[int, Handler] = {}
        self._inline_kinds: set[int] = set()
        self._decode_error_hooks: dict[int, Callable[[WorkerInfo, Any, BaseException], None]] = {}
        # Graceful shutdown, once every worker has stopped calling: each hook sends what
        # it still owes its peers, waits for the acknowledgements, returns how many
        # messages that took. Repeated, world-wide, until nobody sends anything.
        # Both get the seconds left of shutdown's budget (``None``: no bound) and must
        # return within them.
        self.on_drain: list[Callable[[float | None], int]] = []
        self.on_close: list[Callable[[float | None], None]] = []  # the transport closed
        self.on_peer_lost: list[Callable[[int], None]] = []  # a peer died or left
        # One-way messages owed to a peer that may ride in the next frame to it (RRef
        # deletions): ``notes_for(dst)`` hands them over, ``notes_not_sent(dst, notes)``
        # takes them back when the frame could not be encoded.
        self.note_sources: list[NoteSource] = []
        self._ids = itertools.count(1)
        self._pending = PendingCalls()
        self._lock = threading.Lock()  # guards _state and _lost_handled
        self._lost_handled: set[int] = set()  # lost peers whose on_peer_lost hooks ran
        self._lost_causes: dict[int, LostCause] = {}  # why each lost peer is gone
        self._lost_cond = threading.Condition(self._lock)
        self._state = _RUNNING
        self.stopping = threading.Event()  # set when shutdown() starts
        self._pool = WorkerPool(
            options.num_worker_threads, f"rpcx-{self.name}-pool", self._bind_thread
        )
        # Futures are completed here, so that user callbacks never run on a transport's
        # receiving thread or the timer thread, and never queue behind request handlers.
        self._completions = WorkerPool(
            _COMPLETION_THREADS, f"rpcx-{self.name}-done", self._bind_thread
        )
        self._timer = DeadlineTimer(
            f"rpcx-{self.name}", self._expire, self._pending.__contains__, self._bind_thread
        )
        # Receive lanes (see rpcx._lanes): requests are served on the thread that
        # received them; these threads take over receiving when such a request blocks.
        self._followers = WorkerPool(_FOLLOWERS, f"rpcx-{self.name}-recv", self._bind_thread)
        self._lane_watch = LaneWatch(f"rpcx-{self.name}")
        # Heartbeats (rpcx._heartbeat), on multi-process backends: ``_heard`` counts the
        # frames from each peer; the watch reads it. A list either way: _on_frame bumps it.
        self._heartbeat: Heartbeat | None = None
        self._heard = [0] * len(workers)
        # Duplicated frames are dropped unread (rpcx._recent): requests by (caller, id),
        # replies by the id of the call they answered.
        self._served = [RecentIds() for _ in workers]
        self._answered = RecentIds(floor=False)  # answers come in any order
        self._pinging: set[int] = set()  # peers with a ping on its way
        self._heard_again = threading.Condition(self._lock)
        self.register_handler(MessageKind.HEARTBEAT, self._on_heartbeat, in_order=True)
        # Back-pressure (rpcx._budget): bytes of calls in flight per peer, capped.
        limit = int(getattr(options, "max_bytes_in_flight", 0))
        self._budget = PeerBudget(len(workers), limit) if limit > 0 else None
        # On a transport that may lose or duplicate frames, bookkeeping is acknowledged
        # and sent again until answered (rpcx._retransmit); ``None`` on reliable ones.
        self._retransmission: Retransmission | None = None
        if getattr(transport.capabilities, "lossy", False):
            self._retransmission = Retransmission(
                f"rpcx-{self.name}", len(workers), self._send_copy,
                self._pending.__contains__, self._bind_thread)

    # ----------------------------------------------------------------- identity & state

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
    def is_running(self) -> bool:
        """True until ``shutdown`` starts tearing the agent down."""
        return self._state != _CLOSED

    @property
    def pending_count(self) -> int:
        """Calls made by this worker that have not completed yet."""
        return len(self._pending)

    @property
    def lossy(self) -> bool:
        """True if the transport may lose frames: bookkeeping is then acknowledged and
        sent again until answered (see :mod:`rpcx._retransmit`)."""
        return self._retransmission is not None

    @property
    def resent_frames(self) -> int:
        """Copies of bookkeeping requests sent again so far (lossy transports)."""
        return 0 if self._retransmission is None else self._retransmission.resent

    def back_pressure(self) -> dict[str, Any]:
        """``bytes_in_flight`` (by peer name, where not zero) and ``calls_held_back``."""
        budget = self._budget
        if budget is None:
            return {"bytes_in_flight": {}, "calls_held_back": 0}
        return {"bytes_in_flight": {w.name: budget.in_flight(w.id) for w in self.workers
                                    if budget.in_flight(w.id)},
                "calls_held_back": budget.waits}

    @property
    def request_threads(self) -> int:
        """Threads in the request pool right now."""
        return self._pool.thread_count

    def resolve(self, to: str | int | WorkerInfo) -> WorkerInfo:
        """The ``WorkerInfo`` for a name, a rank or a ``WorkerInfo``."""
        if isinstance(to, WorkerInfo):
            if 0 <= to.id < len(self.workers) and self.workers[to.id] == to:
                return to
        elif isinstance(to, str):
            found = self._by_name.get(to)
            if found is not None:
                return found
        elif isinstance(to, int) and not isinstance(to, bool):
            if 0 <= to < len(self.workers):
                return self.workers[to]
        else:
            raise TypeError(
                f"destination must be a worker name, rank or WorkerInfo, got {type(to).__name__}"
            )
        known = ", ".join(w.name for w in self.workers)
        raise UnknownWorkerError(f"unknown destination worker {to!r}; the workers are: {known}")

    def register_handler(
        self,
        kind: MessageKind,
        handler: Handler,
        *,
        in_order: bool = False,
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
        self._handlers[int(kind)] = handler
        if on_decode_error is not None:
            self._decode_error_hooks[int(kind)] = on_decode_error
        if in_order:
            self._inline_kinds.add(int(kind))
        else:
            self._inline_kinds.discard(int(kind))

    def timeout_for(self, timeout: float | None) -> float | None:
        """Seconds for a call's ``timeout`` argument: negative/None = default, 0 = none."""
        if timeout is None or timeout < 0:
            timeout = self.rpc_timeout
        return float(timeout) if timeout > 0 else None

    def start(self) -> None:
        """Start the transport. Frames may arrive as soon as this is called."""
        ctx = TransportContext(
            routes=self.routes,
            rank=self.rank,
            world_size=self.world_size,
            names=[w.name for w in self.workers],
            store=rendezvous.prefixed(self._store, "transport"),
            options=self.options,
            init_method=self.init_method,
            deliver=(self._on_frame if self.guard is None else self.guard.guarding(
                self._on_frame,
                lambda src, why: self._on_peer_lost(src, LostCause.PROTOCOL_ERROR, why))),
            peer_lost=self._on_peer_lost,
            receive_lane=self._new_lane,
            auth=self._connection_auth,
        )
        self._transport.start(ctx)
        self._start_heartbeat()

    def _start_heartbeat(self) -> None:
        interval = float(getattr(self.options, "heartbeat_interval", 0.0))
        timeout = float(getattr(self.options, "heartbeat_timeout", 0.0))
        capabilities = self._transport.capabilities
        if interval <= 0 or timeout <= 0 or capabilities.in_process:
            return  # (threads of one process cannot hang apart)
        self._heartbeat = Heartbeat(
            self.name, [w.id for w in self.workers if w.id != self.rank], self.world_size,
            interval=interval, timeout=timeout, ping=self._ping,
            on_silent=self._on_silent, on_heard=self._on_heard_again,
        )
        self._heard = self._heartbeat.heard
        self._heartbeat.start()

    def _ping(self, rank: int) -> None:
        """Ping ``rank`` from the pool (a send may wait); one ping in flight per peer."""
        with self._lock:
            if rank in self._pinging or self._state != _RUNNING:
                return
            self._pinging.add(rank)

        def send() -> None:
            try:
                self.send_one_way(self.workers[rank], MessageKind.HEARTBEAT, PING)
            finally:
                with self._lock:
                    self._pinging.discard(rank)

        try:
            self._pool.submit(send)
        except RpcShutdownError:
            with self._lock:
                self._pinging.discard(rank)

    def _on_heartbeat(self, caller: WorkerInfo, payload: Any) -> None:
        if payload == PING:  # (any frame counts as heard: a pong needs no handling)
            self.send_one_way(caller, MessageKind.HEARTBEAT, PONG)

    def _on_silent(self, rank: int, quiet: float) -> None:
        timeout = float(getattr(self.options, "heartbeat_timeout", 0.0))
        text = (f"worker {self.workers[rank].name!r} (rank {rank}) is unresponsive: silent "
                f"for {quiet:.1f} s (heartbeat_timeout {timeout:g} s)")
        victims = self._pending.silence(rank, text)
        if victims is None:
            return
        log.warning("%s: %s; failing %d pending calls; calls to it fail until it answers",
                    self.name, text, len(victims))
        for rid in victims:
            self._complete(rid, exception=lambda p: self._lost_error(p, text))

    def _on_heard_again(self, rank: int, quiet: float) -> None:
        if self._pending.hear(rank):
            log.warning("%s: worker %r (rank %d) answers again after %.1f s of silence",
                        self.name, self.workers[rank].name, rank, quiet)
        with self._lock:
            self._heard_again.notify_all()

    def wait_responsive(self, rank: int, timeout: float) -> bool:
        """Wait (at most ``timeout``) until worker ``rank`` is not marked unresponsive."""
        with self._lock:
            return self._heard_again.wait_for(lambda: not self._pending.is_silent(rank),
                                              timeout)

    def is_unresponsive(self, rank: int) -> bool:
        """Whether worker ``rank`` is silent past ``heartbeat_timeout`` right now."""
        return self._pending.is_silent(rank)

    def _new_lane(self, name: str, resume: Callable[[], None]) -> ReceiveLane:
        lane = ReceiveLane(name, resume, self._start_follower, owner=self)
        self._lane_watch.add(lane)
        return lane

    def _start_follower(self, resume: Callable[[], None]) -> None:
        try:
            self._followers.submit(resume)
        except RpcShutdownError:  # closing: the loop must still run to its goodbye
            threading.Thread(target=resume, name=f"rpcx-{self.name}-recv-late",
                             daemon=True).start()

    def barrier(self, tag: str, timeout: float | None) -> None:
        """Wait until every live worker reached the barrier ``tag``."""
        rendezvous.barrier(
            self._store,
            tag,
            self.rank,
            self.world_size,
            timeout=timeout,
            is_gone=self.is_lost,
            describe=self._describe_ranks,
            waiter=self.name,
        )

    # ---------------------------------------------------------------------- outgoing

    def request(
        self,
        dst: WorkerInfo,
        kind: MessageKind,
        payload: Any,
        *,
        timeout: float | None,
        api: str,
        target: Any,
        describe_target: Callable[[Any], str] = describe_callable,
    ) -> RpcFuture[Any]:
        """Send a request and return the future of its reply.

        ``api`` and ``target`` only name the call in error messages ("rpc_sync(mod.f)").
        Raises synchronously if the payload cannot be pickled or the agent is shut down;
        every later failure (timeout, remote error, lost peer) goes to the future.
        """
        if self._state == _CLOSED:
            raise self._shut_down_error(api, describe_target(target), dst)
        rid = next(self._ids)
        ctx = self._request_context(dst.id)
        if self.scope is not None:
            ctx.scope = self.scope.outgoing(dst.id)
        try:
            frame = self._encode(kind, rid, payload, ctx)
        except SerializationError as exc:
            raise SerializationError(
                f"{api}({describe_target(target)}) to worker {dst.name!r}: "
                f"could not pickle the call: {exc}"
            ) from exc.__cause__
        future: RpcFuture[Any] = RpcFuture()
        started = time.monotonic()
        pending = PendingCall(future, dst, api, target, started, timeout, describe_target)
        if (self._budget is not None and kind not in CONTROL_KINDS
                and not _delivering.active):  # (a delivering thread must never wait)
            room = self._make_room(dst, frame.nbytes, pending)
            if room is not None:
                future.set_exception(room)
                return future
        refused = self._pending.add(rid, pending)
        if refused is not None and pending.nbytes and self._budget is not None:
            self._budget.give(dst.id, pending.nbytes)
        if refused is CLOSED:
            raise self._shut_down_error(api, describe_target(target), dst)
        if refused is not None:
            future.set_exception(self._lost_error(pending, str(refused)))
            return future
        frame.request_id = rid
        if timeout is not None:
            frame.deadline = started + timeout
            self._timer.schedule(frame.deadline, rid)
        if self._retransmission is not None:
            self._retransmission.sent(kind, rid, dst.id, frame)
        self._transmit(dst.id, frame, ctx, rid)
        return future

    def _make_room(
        self, dst: WorkerInfo, nbytes: int, pending: PendingCall
    ) -> BaseException | None:
        """Count a call's bytes against the budget to ``dst``, waiting within its timeout
        for room (back-pressure); the error to fail it with if there is none. A wait that
        ends because the peer was lost or this worker closed counts nothing and returns
        ``None``: registering the call then refuses it with the usual error."""
        budget = self._budget
        assert budget is not None
        if budget.try_take(dst.id, nbytes):
            pending.nbytes = nbytes
            return None
        def gone() -> bool:
            return self._state == _CLOSED or self.is_lost(dst.id)

        with blocking():  # (a request thread waiting here lets the pool grow)
            taken = budget.take(dst.id, nbytes, pending.timeout, gone)
        if taken:
            pending.nbytes = nbytes
            return None
        if gone():
            return None
        return RpcTimeoutError(
            f"{pending.call} to worker {dst.name!r}: not sent within its timeout "
            f"({pending.timeout:g} s): {budget.in_flight(dst.id) / 2**20:.1f} MiB of calls "
            f"to it are still unanswered, and this one ({nbytes / 2**20:.1f} MiB) would pass "
            f"max_bytes_in_flight ({budget.limit / 2**20:.1f} MiB)")

    def _shut_down_error(self, api: str, target: str, dst: WorkerInfo) -> RpcShutdownError:
        return RpcShutdownError(
            f"{api}({target}) to worker {dst.name!r}: RPC on worker {self.name!r} has shut down"
        )

    def send_one_way(self, dst: WorkerInfo, kind: MessageKind, payload: Any) -> None:
        """Send a one-way message (no reply, no future); failures are only logged."""
        if self._state == _CLOSED:
            return
        if self._retransmission is not None and self._retransmission.acknowledges(kind):
            self._notify_acknowledged(dst, kind, payload)
            return
        ctx = self._request_context(dst.id)
        try:
            frame = self._encode(kind, 0, payload, ctx)
        except SerializationError as exc:
            log.warning("%s: one-way message to %s not sent: %s", self.name, dst.name, exc)
            return
        self._transmit(dst.id, frame, ctx, 0)

    def _notify_acknowledged(self, dst: WorkerInfo, kind: MessageKind, payload: Any) -> None:
        # (On a lossy transport: a request, so that it is sent again until answered.)
        try:
            future = self.request(dst, kind, payload, timeout=self.timeout_for(None),
                                  api="send_one_way", target=kind.name, describe_target=str)
        except RpcError as exc:
            log.warning("%s: one-way message to %s not sent: %s", self.name, dst.name, exc)
            return

        def check(done: torch.futures.Future[Any]) -> None:
            try:
                done.value()
            except Exception as exc:
                log.debug("%s: %s to %s not acknowledged: %s", self.name, kind.name,
                          dst.name, exc)

        add_internal_callback(future, check)

    def _send_copy(self, dst: int, frame: Frame) -> None:
        """Send a copy of a bookkeeping request or reply (lossy transports), from the pool."""
        def send() -> None:
            try:
                self._send(dst, frame)
            except Exception as exc:  # the original's fate decides; this was a spare
                log.debug("%s: copy of a frame to rank %d not sent: %s", self.name, dst, exc)

        with contextlib.suppress(RpcShutdownError):
            self._pool.submit(send)

    def _encode(self, kind: int, rid: int, payload: Any, ctx: EncodeContext) -> Frame:
        """``encode``, with the notes owed to the destination riding along (not on a
        lossy transport: a lost frame would lose them, and only bookkeeping is resent)."""
        taken: list[tuple[NoteSource, list[tuple[int, Any]]]] = []
        for source in self.note_sources if self._retransmission is None else ():
            notes = source.notes_for(ctx.peer)
            if notes:
                taken.append((source, notes))
                ctx.notes.extend(notes)
        try:
            return encode(kind, rid, payload, ctx)
        except BaseException:
            for source, notes in taken:
                source.notes_not_sent(ctx.peer, notes)
            raise

    def _request_context(self, dst: int) -> EncodeContext:
        return EncodeContext(dst, agent=self, routes=self.routes,
                             stage_devices=self._stage_devices)

    def _response_context(self, src: int, scope: int | None = None) -> EncodeContext:
        return EncodeContext(src, agent=self, scope=scope, routes=self.routes, response=True,
                             stage_devices=self._stage_devices)

    def _transmit(self, dst: int, frame: Frame, ctx: EncodeContext, rid: int) -> None:
        """Run the frame's before-send hooks and send it; failures fail request ``rid``."""
        if _delivering.active:
            # A thread delivering a frame must never send: a send can wait for the peer
            # to post a receive, and two delivering threads could wait on each other.
            # (Frames to oneself are deferred too, so their hooks keep their order.)
            try:
                self._pool.submit(self._transmit_now, dst, frame, ctx, rid)
                return
            except RpcShutdownError:
                pass
        self._transmit_now(dst, frame, ctx, rid)

    def _transmit_now(self, dst: int, frame: Frame, ctx: EncodeContext, rid: int) -> None:
        try:
            for hook in ctx.before_send:
                hook()
            ctx.before_send.clear()  # hooks may hold what is being sent: let it go
            self._send(dst, frame)
            ctx.keep_alive.clear()  # handed to the transport: later messages follow it
        except Exception as exc:
            reason = exc.args[0] if isinstance(exc, PeerLostError) and exc.args else str(exc)
            if rid:
                self._complete(rid, exception=lambda p: self._lost_error(p, reason))
            else:
                log.debug("%s: one-way message to rank %d not sent: %s", self.name, dst, reason)

    def _send(self, dst: int, frame: Frame) -> None:
        if dst == self.rank:
            # A call to oneself still crosses the codec, so arguments are copies.
            self._on_frame(dst, Frame(frame.header, [
                b if i in frame.owned else copy_of(b) for i, b in enumerate(frame.buffers)
            ]))
        else:
            self._transport_send(dst, frame)

    # ---------------------------------------------------------------------- incoming

    def _on_frame(self, src: int, frame: Frame) -> None:
        self._heard[src] += 1  # (a lost increment between threads still counts as heard)
        kind, rid = decode_envelope(frame)
        if (rid and kind != MessageKind.RESULT and kind != MessageKind.ERROR
                and not self._served[src].add(rid)):
            if self._retransmission is not None:
                self._retransmission.copy_received(src, rid)
            log.debug("%s: dropped a duplicate of request %d from rank %d", self.name, rid, src)
            return
        elif rid and self._retransmission is not None:
            self._retransmission.received(src, kind, rid)
        if kind not in self._handlers and kind != MessageKind.RESULT and kind != MessageKind.ERROR:
            # Checked before anything in the frame is decoded: not even its notes.
            log.warning("%s: dropped a frame of unknown kind %d from %s", self.name, kind,
                        self._describe_ranks([src]))
            return
        if has_notes(frame):
            if (kind == MessageKind.RESULT or kind == MessageKind.ERROR) and rid in self._answered:
                # A copy of a reply already taken: its notes (fork announcements) were
                # handled with the original and must not be again.
                log.debug("%s: dropped a duplicate reply %d from rank %d", self.name, rid, src)
                return
            self._handle_notes(src, frame)
        if kind == MessageKind.RESULT or kind == MessageKind.ERROR or kind in self._inline_kinds:
            token = _context._thread_agent.set(self)  # callbacks run as this worker
            was_delivering, _delivering.active = _delivering.active, True
            try:
                if kind == MessageKind.RESULT or kind == MessageKind.ERROR:
                    self._on_response(src, kind, rid, frame)
                else:
                    self._serve(src, kind, rid, frame)
            finally:
                _delivering.active = was_delivering
                _context._thread_agent.reset(token)
            return
        lane = current_lane()
        if lane is not None and lane.owner is self and self._state != _CLOSED:
            # Served right here, on the receiving thread (see rpcx._lanes).
            token = _context._thread_agent.set(self)
            try:
                lane.serve(self._serve, src, kind, rid, frame)
            finally:
                _context._thread_agent.reset(token)
            return
        try:
            self._pool.submit(self._serve, src, kind, rid, frame)
        except RpcShutdownError:
            log.debug("%s: dropped request %d from rank %d after shutdown", self.name, rid, src)

    def _handle_notes(self, src: int, frame: Frame) -> None:
        """Handle the one-way messages riding in ``frame``, in order, before the frame."""
        caller = self.workers[src]
        token = _context._thread_agent.set(self)
        was_delivering, _delivering.active = _delivering.active, True
        try:
            for kind, payload in decode_notes(frame):
                handler = self._handlers.get(kind)
                if handler is None or kind not in self._inline_kinds:
                    log.warning("%s: dropped a note of kind %d from %s: no in-order handler",
                                self.name, kind, caller.name)
                    continue
                try:
                    handler(caller, payload)
                except Exception:
                    log.exception("%s: note of kind %d from %s failed",
                                  self.name, kind, caller.name)
        except SerializationError as exc:  # not plain data: nothing of it was run
            log.warning("%s: dropped the notes of a frame from %s: %s", self.name,
                        caller.name, exc)
        except Exception:
            log.exception("%s: could not read the notes of a frame from %s", self.name,
                          caller.name)
        finally:
            _delivering.active = was_delivering
            _context._thread_agent.reset(token)

    def _on_response(self, src: int, kind: int, rid: int, frame: Frame) -> None:
        pending = self._pending.get(rid)
        if pending is not None and pending.dst.id != src:
            # Only the worker a request went to may answer it; nothing in this frame is
            # decoded (it may be forged, or a peer's bug).
            log.warning("%s: dropped a reply to %s from %s: the request went to %s",
                        self.name, pending.call, self._describe_ranks([src]),
                        pending.dst.name)
            return
        if pending is None:
            if not self._answered.add(rid):  # a duplicate: its RRefs were taken already
                log.debug("%s: dropped a duplicate reply %d from rank %d", self.name, rid, src)
                return
            log.debug("%s: response %d from rank %d arrived after its call ended",
                      self.name, rid, src)
            # Decode and drop it anyway: RRefs in it were registered for us and must be
            # released. Off this thread, as unpickling may run user code.
            with contextlib.suppress(RpcShutdownError):
                self._completions.submit(self._discard, src, frame)
            return
        self._answered.add(rid)
        scope, tag = decode_scope(frame)
        try:
            payload = decode_payload(frame, DecodeContext(src, self, scope=scope, scope_tag=tag))
        except SerializationError as exc:
            error = SerializationError(
                f"{pending.call} to worker {pending.dst.name!r}: could not unpickle the "
                f"{'result' if kind == MessageKind.RESULT else 'error'}: {exc}"
            )
            self._complete(rid, exception=lambda _: error)
            return
        if kind == MessageKind.RESULT:
            self._complete(rid, value=payload)
        else:
            self._complete(rid, exception=lambda p: payload.rebuild(p.call))

    def _discard(self, src: int, frame: Frame) -> None:
        try:
            decode_payload(frame, DecodeContext(src, self), lenient=True)
        except Exception as exc:
            log.debug("%s: could not decode a late response: %s", self.name, exc)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` soon on the completion lane (never on the calling thread)."""
        try:
            self._completions.submit(fn, *args)
        except RpcShutdownError:
            fn(*args)

    def _serve(self, src: int, kind: int, rid: int, frame: Frame) -> None:
        caller = self.workers[src]
        scope, tag = decode_scope(frame)
        try:
            handler = self._handlers.get(kind)
            if handler is None:
                raise RpcError(f"worker {self.name!r} does not handle message kind {kind}")
            with self._entered(scope, src):
                try:
                    ctx = DecodeContext(src, self, scope=scope, scope_tag=tag)
                    payload = decode_payload(frame, ctx)
                except SerializationError as exc:
                    error = SerializationError(
                        f"worker {self.name!r} could not unpickle the request: {exc}"
                    )
                    self._recover_undecodable(caller, kind, frame, error)
                    raise error from None
                gates = ctx.before_serve
                del ctx
                if gates is not None:
                    # (never blocking a delivering thread: inline handlers skip them)
                    if not _delivering.active:
                        for gate in gates:
                            gate()
                    del gates
                result = handler(caller, payload)
                del payload  # the arguments (RRefs among them) need not outlive the call
        except BaseException as exc:
            self._reply_error(src, rid, exc)
            return
        if isinstance(result, Deferred):
            result.future.add_done_callback(
                lambda fut: self._reply_with(src, rid, fut, scope)
            )
        else:
            self._reply(src, rid, result, scope)

    def _entered(self, scope: int | None, src: int) -> contextlib.AbstractContextManager[Any]:
        if scope is None or self.scope is None:
            return contextlib.nullcontext()
        return self.scope.entered(scope, src)

    def _recover_undecodable(
        self, caller: WorkerInfo, kind: int, frame: Frame, error: BaseException
    ) -> None:
        # Decoding leniently rebuilds what can be rebuilt. That matters even when nobody
        # looks at the result: RRefs inside get rebuilt, then dropped, so their owners
        # hear that these references are gone.
        try:
            partial = decode_payload(frame, DecodeContext(caller.id, self), lenient=True)
        except Exception as exc:
            log.debug("%s: lenient decode failed too: %s", self.name, exc)
            return
        hook = self._decode_error_hooks.get(kind)
        if hook is not None:
            try:
                hook(caller, partial, error)
            except Exception:
                log.exception("%s: decode-error hook failed", self.name)

    def _reply_with(
        self, src: int, rid: int, future: torch._C.Future[Any], scope: int | None
    ) -> None:
        try:
            value = future.wait()
        except BaseException as exc:
            self._reply_error(src, rid, exc)
        else:
            self._reply(src, rid, value, scope)

    def _reply(self, src: int, rid: int, value: Any, scope: int | None = None) -> None:
        if rid == 0:
            return
        ctx = self._response_context(src, scope)
        try:
            frame = self._encode(MessageKind.RESULT, rid, value, ctx)
        except SerializationError as exc:
            self._reply_error(
                src, rid, SerializationError(f"could not pickle the result: {exc}")
            )
            return
        frame.reply_to = rid
        if self._retransmission is not None:
            self._retransmission.answered(src, rid, frame)
        self._transmit(src, frame, ctx, 0)  # a failed reply is the caller's to notice

    def _reply_error(self, src: int, rid: int, exc: BaseException) -> None:
        if rid == 0:
            log.warning("%s: one-way message from rank %d failed: %r", self.name, src, exc)
            return
        info = RemoteErrorInfo.capture(exc, self.name)
        ctx = self._response_context(src)
        frame = self._encode(MessageKind.ERROR, rid, info, ctx)
        frame.reply_to = rid
        if self._retransmission is not None:
            self._retransmission.answered(src, rid, frame)
        self._transmit(src, frame, ctx, 0)

    # ----------------------------------------------------------- completion & failure

    def _complete(
        self,
        rid: int,
        *,
        value: Any = None,
        exception: Callable[[PendingCall], BaseException] | None = None,
    ) -> None:
        pending = self._pending.pop(rid)
        if pending is None:
            return
        if pending.nbytes and self._budget is not None:
            self._budget.give(pending.dst.id, pending.nbytes)
        outcome = None if exception is None else exception(pending)
        future = pending.future
        if current_pool() is self._completions:
            _settle(future, value, outcome)
            return
        if not future.has_callbacks and (future.has_waiter or future.has_internal):
            # No user callback to run: complete it here, saving a hand-off. One attached
            # since that check is sent to the completion lane when it runs.
            settle_inline(future, value, outcome, self._completions.submit)
            return
        try:
            self._completions.submit(_settle, future, value, outcome)
        except RpcShutdownError:
            _settle(future, value, outcome)  # shutting down: complete it here

    def _expire(self, rid: int) -> None:
        self._complete(rid, exception=self._timeout_error)

    @staticmethod
    def _timeout_error(pending: PendingCall) -> BaseException:
        return RpcTimeoutError(
            f"{pending.call} to worker {pending.dst.name!r} timed out after "
            f"{pending.elapsed:.3g} s (timeout {pending.timeout:g} s)"
        )

    def _lost_error(self, pending: PendingCall, reason: str) -> BaseException:
        rank = pending.dst.id
        cause = self._lost_causes.get(rank) or (
            LostCause.UNRESPONSIVE if self._pending.is_silent(rank) else None)
        return PeerLostError(f"{pending.call} to worker {pending.dst.name!r} failed: {reason}",
                             cause=cause)

    def _on_peer_lost(self, rank: int, cause: LostCause | str,
                      detail: str | LostCause = "") -> None:
        # Transports call this from their receiving threads, which must not send.
        # TRANSITION (issue 26): backends still on the old (rank, reason, cause) form.
        if isinstance(cause, str):
            reason = cause
            cause = detail if isinstance(detail, LostCause) else LostCause.CONNECTION_LOST
        else:
            reason = lost_reason(cause, str(detail))
        was_delivering, _delivering.active = _delivering.active, True
        try:
            self._peer_lost(rank, reason, cause)
        finally:
            _delivering.active = was_delivering

    def _peer_lost(self, rank: int, reason: str, cause: LostCause) -> None:
        name = self.workers[rank].name
        text = f"worker {name!r} (rank {rank}) {reason}"
        self._lost_causes.setdefault(rank, cause)  # (before the calls fail: they read it)
        if self._heartbeat is not None:
            self._heartbeat.forget(rank)
        if self._retransmission is not None:
            self._retransmission.forget(rank)
        victims = self._pending.lose(rank, text)
        if victims is None:
            return  # already known
        if self._budget is not None:  # calls waiting for room to it: fail them now
            self._budget.wake()
        # A peer that leaves while we shut down is expected; one that dies never is.
        expected = self._state != _RUNNING and cause is LostCause.DEPARTED
        level = logging.DEBUG if expected else logging.WARNING
        log.log(level, "%s: %s; failing %d pending calls", self.name, text, len(victims))
        for rid in victims:
            self._complete(rid, exception=lambda p: self._lost_error(p, text))
        for hook in self.on_peer_lost:
            try:
                hook(rank)
            except Exception:
                log.exception("%s: peer-lost hook failed", self.name)
        with self._lock:
            self._lost_handled.add(rank)
            self._lost_cond.notify_all()

    def is_lost(self, rank: int) -> bool:
        """Whether worker ``rank`` is known to be gone (died, or left the world)."""
        return self._pending.lost_reason(rank) is not None

    def lost_error(self, rank: int, call: str) -> PeerLostError:
        """The error of ``call`` to worker ``rank``, known gone: worded as every call's."""
        why = self._pending.lost_reason(rank) or f"worker {self.workers[rank].name!r} is gone"
        return PeerLostError(f"{call} to worker {self.workers[rank].name!r} failed: {why}",
                             cause=self._lost_causes.get(rank))

    def wait_lost(self, rank: int, timeout: float | None) -> bool:
        """Wait until worker ``rank`` is known gone and this worker has reacted to it
        (its pending calls failed, the services' hooks run); False after ``timeout``."""
        with self._lock:
            return self._lost_cond.wait_for(lambda: rank in self._lost_handled, timeout)

    def lost_causes(self) -> dict[str, LostCause]:
        """Workers known to be gone, with the cause their transport reported, by name."""
        return {self.workers[r].name: cause for r, cause in self._lost_causes.items()
                if self._pending.lost_reason(r) is not None}

    def lost_peers(self) -> dict[str, str]:
        """Workers known to be gone, with the reason, by name."""
        return {self.workers[r].name: why for r, why in self._pending.lost().items()}

    # ---------------------------------------------------------------------- shutdown

    def shutdown(self, graceful: bool = True, timeout: float | None = None) -> bool:
        """Leave the world.

        Graceful: wait until this worker's own calls are done, then for every live worker
        to arrive (a barrier through the store), then close. ``timeout`` bounds the whole
        wait (``None`` waits as long as peers are alive, logging progress). Non-graceful:
        fail pending calls at once and close locally. Returns False if the worker was
        already shutting down (or shut down) when called.
        """
        with self._lock:
            if self._state != _RUNNING:
                return False  # another thread is shutting this worker down
            self._state = _STOPPING
        self.stopping.set()
        if self._heartbeat is not None:  # peers leave now: silence is no news
            self._heartbeat.close()
        deadline = waits_end = None
        if timeout is not None:
            deadline = time.monotonic() + timeout
            waits_end = deadline - min(timeout * _TEARDOWN_SHARE, _TEARDOWN_MAX)
        try:
            if graceful:
                self._wait_until_idle(waits_end)
                self.barrier("shutdown", remaining(waits_end))
                self._drain(waits_end)
        except Exception as exc:
            log.warning("%s: graceful shutdown incomplete: %s", self.name, exc)
        finally:
            self._close(deadline, graceful)
        return True

    def _drain(self, deadline: float | None) -> None:
        """Let services settle what they owe each other (RRef deletions, say).

        Handling one worker's messages can make another send more (freeing a value can
        release the RRefs inside it), so this runs in rounds, each ending in a barrier,
        until a round in which no worker sent anything.
        """
        for round_ in range(_DRAIN_ROUNDS):
            sent = 0
            for hook in self.on_drain:
                sent += hook(remaining(deadline))
            self._wait_until_idle(deadline)
            tag = f"drained/{round_}"
            self._store.set(f"{tag}/sent/{self.rank}", str(sent), remaining(deadline))
            self.barrier(tag, remaining(deadline))
            live = [r for r in range(self.world_size) if not self.is_lost(r)]
            if all(int(self._store.get(f"{tag}/sent/{r}", remaining(deadline))) == 0
                   for r in live):
                return
        log.warning("%s: services still busy after %d drain rounds", self.name, _DRAIN_ROUNDS)

    def _wait_until_idle(self, deadline: float | None) -> None:
        started = time.monotonic()
        while True:
            now = time.monotonic()
            left = _PROGRESS_EVERY if deadline is None else min(deadline - now, _PROGRESS_EVERY)
            if self._pending.wait_empty(max(left, 0.0)):
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise RpcTimeoutError(
                    f"{len(self._pending)} calls still pending after {now - started:.1f} s"
                )
            if now - started >= _PROGRESS_EVERY:
                log.info("%s: shutdown waits for %d pending calls (%.0f s so far)",
                         self.name, len(self._pending), now - started)

    def _close(self, deadline: float | None, graceful: bool = True) -> None:
        with self._lock:
            self._state = _CLOSED
        if self._budget is not None:
            self._budget.wake()
        leftovers = self._pending.close()
        for rid in leftovers:
            self._complete(
                rid,
                exception=lambda p: RpcShutdownError(
                    f"{p.call} to worker {p.dst.name!r} was cancelled: "
                    f"worker {self.name!r} shut down"
                ),
            )
        # Without a deadline, each teardown step still gets a bound of its own.
        def budget(default: float) -> float:
            return within(default, remaining(deadline)) or 0.0

        try:
            self._transport.close(budget(_CLOSE_TIMEOUT))
        except Exception:
            log.exception("%s: error while closing the transport", self.name)
        self._lane_watch.close(budget(_CLOSE_TIMEOUT))
        self._pool.shutdown(budget(_CLOSE_TIMEOUT))
        self._followers.shutdown(budget(_CLOSE_TIMEOUT))
        self._completions.shutdown(budget(_CLOSE_TIMEOUT))
        self._timer.close(budget(_CLOSE_TIMEOUT))
        if self._retransmission is not None:
            self._retransmission.close(budget(_CLOSE_TIMEOUT))
        for hook in self.on_close:
            try:
                hook(remaining(deadline))
            except Exception:
                log.exception("%s: close hook failed", self.name)
        rendezvous.leave(
            self._store, self.rank, self.world_size, self.is_lost,
            timeout=budget(rendezvous.LEAVE_TIMEOUT) if graceful else 0.0,
        )
        self._store = None  # the last reference may host the rendezvous server: release it
        _context.forget(self)

    # ------------------------------------------------------------------------ helpers

    def _bind_thread(self) -> None:
        _context.bind_agent(self)

    def _describe_ranks(self, ranks: list[int]) -> str:
        return ", ".join(self.workers[r].name for r in ranks)


def _settle(future: RpcFuture[Any], value: Any, exception: BaseException | None) -> None:
    if exception is None:
        future.set_result(value)
    else:
        future.set_exception(exception)

