"""The call path, in reading order: send a request, receive a frame, serve it, complete.

1. **Send** (:meth:`CallPath.request`): encode the payload (with the one-way notes owed
   to that peer riding along), admit it past back-pressure, register it as pending,
   schedule its deadline, transmit.
2. **Receive** (:meth:`CallPath.on_frame`, on a transport's thread): drop duplicates and
   unknown kinds before anything is decoded, run the notes, then route: replies and
   rpcx's in-order bookkeeping are handled right there; other requests are served on the
   receiving thread when it holds a receive lane (:mod:`rpcx._core.lanes`), else on the pool.
3. **Serve** (:meth:`CallPath.serve`): decode, pass the gates the codec set (an RRef's
   confirmation), run the handler, reply now or when its :class:`Deferred` completes.
4. **Complete** (:meth:`CallPath.complete`): a reply, a timeout, a lost peer or shutdown
   settles the pending call's future, on the completion lane if a user callback waits.

A thread that delivers a frame never sends and never waits: what it would send goes out
from the request pool (a send can wait for the peer, and two receiving threads could
wait on each other).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from rpcx._core import context as _context
from rpcx._core.budget import BackPressure
from rpcx._core.context import receiving
from rpcx._core.context import receiving_thread as _receiving_thread
from rpcx._core.executors import Executors
from rpcx._core.label import CallLabel
from rpcx._core.lanes import current_lane
from rpcx._core.pending import PendingCall, PendingCalls
from rpcx._core.profiled import ProfiledRequests, profiled_reply
from rpcx._core.profiling import (
    PROFILED_KINDS,
    CallSpan,
    begin_span,
    hop_span,
    profiler_active,
)
from rpcx._core.retransmit import NoRetransmission
from rpcx._core.service_host import Deferred, Handler, MessageScope, NoteSource
from rpcx._core.shutdown import Lifecycle
from rpcx._core.trace_policy import NoTrace
from rpcx._util.pool import current_pool
from rpcx._util.recent import RecentIds
from rpcx._wire.codec import (
    DecodeContext,
    EncodeContext,
    decode_envelope,
    decode_notes,
    decode_payload,
    decode_scope,
    encode,
    has_notes,
)
from rpcx._wire.devices import DeviceRoutes
from rpcx.errors import (
    PeerLostError,
    RemoteErrorInfo,
    RpcError,
    RpcShutdownError,
    RpcTimeoutError,
    SerializationError,
)
from rpcx.futures import RpcFuture, add_internal_callback, settle_inline
from rpcx.messages import CONTROL_KINDS, PASSING_KINDS, MessageKind
from rpcx.transport import Frame
from rpcx.worker import WorkerInfo

__all__ = ["CallPath"]

log = logging.getLogger("rpcx.agent")

_RESULT, _ERROR = int(MessageKind.RESULT), int(MessageKind.ERROR)


class CallPath:
    """Requests out, frames in, requests served, calls completed: one worker's traffic.

    Args:
        host: the worker's agent, handed to the codec (RRefs bind to it).
        workers: every worker, by rank; ``workers[rank]`` is this one.
        rank: this worker's rank.
        transmit_frame: sends a frame to a peer (the transport's ``send``; with a world
            key, the transport seals it: rpcx._wire.keyed).
        lifecycle: the worker's state (running, stopping, closed).
        executors: the pools and the timer.
        pending: the table of calls waiting for replies.
        lost_error: ``lost_error(pending, reason)``, the error of a call to a lost peer.
        heard: frames received per peer (the heartbeat reads it).
        routes: device routes for the codec; ``stage_devices``: copy device tensors to
            the host (a transport that cannot move device memory).
        back_pressure, retransmission: the optional policies (do-nothing by default).

    ``trace`` is the trace policy (:mod:`rpcx._core.trace_policy`): do-nothing unless
    ``rpcx.tracing`` records this worker; it may be swapped while calls run.
    """

    def __init__(
        self, *, host: Any, workers: list[WorkerInfo], rank: int,
        transmit_frame: Callable[[int, Frame], None], lifecycle: Lifecycle,
        executors: Executors, pending: PendingCalls,
        lost_error: Callable[[PendingCall, str], BaseException], heard: list[int],
        routes: DeviceRoutes, stage_devices: bool,
        back_pressure: BackPressure, retransmission: NoRetransmission,
    ) -> None:
        self._host = host
        self._workers = workers
        self._rank = rank
        self._name = workers[rank].name
        self._transmit_frame = transmit_frame
        self._life = lifecycle
        self._executors = executors
        self._pool = executors.requests
        self._completions = executors.completions
        self._pending = pending
        self._lost_error = lost_error
        self.heard = heard
        self._routes = routes
        self._stage_devices = stage_devices
        self._back_pressure = back_pressure
        self._retransmission = retransmission
        self.trace: NoTrace = NoTrace()
        self._ids = itertools.count(1)
        # The handler table (services fill it through the agent).
        self.handlers: dict[int, Handler] = {}
        self.in_order_kinds: set[int] = set()
        self.decode_error_hooks: dict[int, Callable[[WorkerInfo, Any, BaseException], None]] = {}
        self.note_sources: list[NoteSource] = []
        self.scope: MessageScope | None = None
        # Duplicated frames are dropped unread (rpcx._util.recent): requests by (caller, id),
        # replies by the id of the call they answered.
        self._served = [RecentIds() for _ in workers]
        # How many workers have taken each rank since this one started: a request is
        # served, and answered, only while its sender still holds the rank (see serve).
        self._holders = [0] * len(workers)
        self._answered = RecentIds(floor=False)  # answers come in any order
        ProfiledRequests(self._name, self.handlers, self.decode_error_hooks).install()

    def grow(self, size: int) -> None:
        """The roster grew to ``size`` ranks (a worker joined a dynamic world)."""
        self._served.extend(RecentIds() for _ in range(size - len(self._served)))
        self._holders.extend(0 for _ in range(size - len(self._holders)))

    def rejoined(self, rank: int) -> None:
        """A new worker took ``rank``: its request ids start afresh, and requests of the
        one before it still waiting here are not served (nor answered: to whom?)."""
        self._served[rank] = RecentIds()
        self._holders[rank] += 1

    def register(self, kind: int, handler: Handler, in_order: bool,
                 on_decode_error: Callable[[WorkerInfo, Any, BaseException], None] | None
                 ) -> None:
        """Enter ``handler`` in the table (see ``RpcAgent.register_handler``)."""
        self.handlers[kind] = handler
        if on_decode_error is not None:
            self.decode_error_hooks[kind] = on_decode_error
        if in_order:
            self.in_order_kinds.add(kind)
        else:
            self.in_order_kinds.discard(kind)

    # ------------------------------------------------------------------ 1. send

    def request(
        self, dst: WorkerInfo, kind: MessageKind, payload: Any, *, timeout: float | None,
        label: CallLabel,
    ) -> RpcFuture[Any]:
        """Send a request and return the future of its reply (see ``RpcAgent.request``)."""
        if self._life.closed:
            raise self._shut_down_error(label, dst)
        if not profiler_active():  # (torch's profiler records this thread: rpcx._core.profiling)
            return self._send_request(dst, kind, payload, timeout, label, None)
        span = begin_span(label, self._name, dst.name, dst.id)
        if kind in PROFILED_KINDS:
            kind, payload, span.remote = MessageKind.PROFILED, (int(kind), payload), True
        try:
            future = self._send_request(dst, kind, payload, timeout, label, span)
        except BaseException:
            span.abandon()
            raise
        return span.end_with(future)  # (the span ends when the call's own future does)

    def _send_request(
        self, dst: WorkerInfo, kind: MessageKind, payload: Any, timeout: float | None,
        label: CallLabel, span: CallSpan | None,
    ) -> RpcFuture[Any]:
        rid = next(self._ids)
        ctx = self._request_context(dst.id)
        if self.scope is not None:
            ctx.scope = self.scope.outgoing(dst.id)
        try:
            frame = self._encode(kind, rid, payload, ctx)
        except SerializationError as exc:
            raise SerializationError(
                f"{label.call} to worker {dst.name!r}: "
                f"could not pickle the call: {exc}"
            ) from exc.__cause__
        future: RpcFuture[Any] = RpcFuture()
        started = time.monotonic()
        pending = PendingCall(future, dst, label, started, timeout)
        if span is not None and span.remote:
            pending.span = span
        if kind not in CONTROL_KINDS and not _receiving_thread.delivering:  # (it must never wait)
            refusal = self._back_pressure.admit(pending, frame, self._gone)
            if refusal is not None:
                future.set_exception(refusal)
                return future
        # (recorded before the call can complete: a timer or a lost peer may settle it
        # as soon as it is registered)
        self.trace.sent(dst.id, rid, kind, label)
        refused = self._pending.register(rid, pending)
        if refused is not None:
            self.trace.completed(dst.id, rid, "refused")
            if pending.nbytes:
                self._back_pressure.give(dst.id, pending.nbytes)
            if refused.closed:
                raise self._shut_down_error(label, dst)
            future.set_exception(self._lost_error(pending, refused.reason))
            return future
        frame.request_id = rid
        frame.settled = future.done  # (a send still waiting may leave once it failed)
        if timeout is not None:
            frame.deadline = started + timeout
            self._executors.timer.schedule(frame.deadline, rid)
        self._retransmission.sent(kind, rid, dst.id, frame)
        self._transmit(dst.id, frame, ctx, rid)
        return future

    def _gone(self, rank: int) -> bool:
        """Whether calls to ``rank`` can no longer be sent (it is lost, or we closed)."""
        return self._life.closed or self._pending.lost_reason(rank) is not None

    def send_one_way(self, dst: WorkerInfo, kind: MessageKind, payload: Any) -> None:
        """Send a message that gets no reply; failures are only logged."""
        if self._life.closed:
            return
        if kind == MessageKind.AUTOGRAD_CHAIN and profiler_active():
            with hop_span(self._name, dst.name):  # (a backward hop, in the profile)
                self._send_one_way(dst, kind, payload)
            return
        self._send_one_way(dst, kind, payload)

    def _send_one_way(self, dst: WorkerInfo, kind: MessageKind, payload: Any) -> None:
        if self._retransmission.acknowledges(kind):
            self._send_acknowledged(dst, kind, payload)
            return
        ctx = self._request_context(dst.id)
        try:
            frame = self._encode(kind, 0, payload, ctx)
        except SerializationError as exc:
            log.warning("%s: one-way message to %s not sent: %s", self._name, dst.name, exc)
            return
        self.trace.posted(dst.id, kind)
        self._transmit(dst.id, frame, ctx, 0)

    def _send_acknowledged(self, dst: WorkerInfo, kind: MessageKind, payload: Any) -> None:
        # (On a lossy transport: a request, so that it is sent again until answered.)
        try:
            timeout = self._host.timeout_for(None)
            future = self.request(dst, kind, payload, timeout=timeout,
                                  label=CallLabel("send_one_way", kind.name, str))
        except RpcError as exc:
            log.warning("%s: one-way message to %s not sent: %s", self._name, dst.name, exc)
            return

        def check(done: torch.futures.Future[Any]) -> None:
            try:
                done.value()
            except Exception as exc:
                log.debug("%s: %s to %s not acknowledged: %s", self._name, kind.name,
                          dst.name, exc)

        add_internal_callback(future, check)

    def send_copy(self, dst: int, frame: Frame) -> None:
        """Send a spare copy of a bookkeeping request or reply (lossy transports), from
        the pool (:meth:`_transmit_now`, with no hooks); a failure is only logged: the
        original's fate decides."""
        with contextlib.suppress(RpcShutdownError):  # (shut down: nothing to send it for)
            self._pool.submit(self._transmit_now, dst, frame, None, 0)

    def _encode(self, kind: int, rid: int, payload: Any, ctx: EncodeContext) -> Frame:
        """``encode``, with the notes owed to the destination riding along (not on a
        lossy transport: a lost frame would lose them, and only bookkeeping is resent)."""
        taken: list[tuple[NoteSource, list[tuple[int, Any]]]] = []
        for source in () if self._retransmission.lossy else self.note_sources:
            notes = source.notes_for(ctx.peer)
            if notes:
                taken.append((source, notes))
                ctx.notes.extend(notes)
        try:
            frame = encode(kind, rid, payload, ctx)
        except BaseException:
            for source, notes in taken:
                source.notes_not_sent(ctx.peer, notes)
            raise
        # (a frame with bookkeeping in it, or announced by a hook, keeps its order)
        frame.may_pass = kind in PASSING_KINDS and not ctx.notes and not ctx.before_send
        return frame

    def _request_context(self, dst: int) -> EncodeContext:
        return EncodeContext(dst, agent=self._host, routes=self._routes,
                             stage_devices=self._stage_devices)

    def _response_context(self, src: int, scope: int | None = None) -> EncodeContext:
        return EncodeContext(src, agent=self._host, scope=scope, routes=self._routes,
                             response=True, stage_devices=self._stage_devices)

    def _transmit(self, dst: int, frame: Frame, ctx: EncodeContext, rid: int) -> None:
        """How an encoded message leaves the call path: run its before-send hooks, then
        hand it to the transport (or to oneself, see :meth:`send_frame`), on this thread
        or, when this thread delivers, from the pool. A failure fails request ``rid``;
        for 0 it is only logged. (Spare copies go from the pool: :meth:`send_copy`.)"""
        if _receiving_thread.delivering:
            # Sent from the pool (see the module docstring). Frames to oneself are
            # deferred too, so their hooks keep their order.
            try:
                self._pool.submit(self._transmit_now, dst, frame, ctx, rid)
                return
            except RpcShutdownError:
                pass
        elif not ctx.before_send and dst != self._rank:
            # The common case: no hook to run, straight to the transport.
            try:
                self._transmit_frame(dst, frame)
            except Exception as exc:
                self._not_sent(dst, rid, exc)
            return
        self._transmit_now(dst, frame, ctx, rid)

    def _transmit_now(self, dst: int, frame: Frame, ctx: EncodeContext | None,
                      rid: int) -> None:
        """Run ``ctx``'s before-send hooks (``None``: a spare copy, none), then
        :meth:`send_frame`; on the thread that sends."""
        try:
            if ctx is not None:
                for hook in ctx.before_send:
                    hook()
                ctx.before_send.clear()  # hooks may hold what is being sent: let it go
            self.send_frame(dst, frame)
            if ctx is not None:
                ctx.keep_alive.clear()  # handed to the transport: later messages follow it
        except Exception as exc:
            self._not_sent(dst, rid, exc)

    def _not_sent(self, dst: int, rid: int, exc: Exception) -> None:
        """Sending request ``rid`` (0: a one-way message or a reply) to ``dst`` failed."""
        reason = exc.args[0] if isinstance(exc, PeerLostError) and exc.args else str(exc)
        if rid:
            self.complete(rid, exception=lambda p: self._lost_error(p, reason))
        else:
            log.debug("%s: a reply, one-way message or spare copy to rank %d not sent: %s",
                      self._name, dst, reason)

    def send_frame(self, dst: int, frame: Frame) -> None:
        """Hand an encoded frame to the transport (or, to oneself, straight to
        :meth:`on_frame`: a call to oneself still crosses the codec): :meth:`_transmit`'s
        last step, with no hooks and no pool; it raises what the transport raises."""
        if dst == self._rank:
            self.on_frame(dst, frame.private_copy())
        else:
            self._transmit_frame(dst, frame)

    # --------------------------------------------------------------- 2. receive

    def on_frame(self, src: int, frame: Frame) -> None:
        """A frame from ``src`` (``TransportContext.deliver``)."""
        self.heard[src] += 1  # (a lost increment between threads still counts as heard)
        kind, rid = decode_envelope(frame)
        is_reply = kind in (_RESULT, _ERROR)
        if rid and not is_reply and not self._served[src].add(rid):
            self._retransmission.copy_received(src, rid)
            log.debug("%s: dropped a duplicate of request %d from rank %d", self._name, rid,
                      src)
            return
        if rid:
            self._retransmission.received(src, kind, rid)
            if not is_reply:
                self.trace.arrived(src, rid, kind)
        else:
            self.trace.delivered(src, kind)
        if not is_reply and kind not in self.handlers:
            # Checked before anything in the frame is decoded: not even its notes.
            log.warning("%s: dropped a frame of unknown kind %d from %s", self._name, kind,
                        self._workers[src].name)
            return
        if has_notes(frame):
            if is_reply and rid in self._answered:
                # A copy of a reply already taken: its notes (fork announcements) were
                # handled with the original and must not be again.
                log.debug("%s: dropped a duplicate reply %d from rank %d", self._name, rid,
                          src)
                return
            self._handle_notes(src, frame)
        if is_reply or kind in self.in_order_kinds:
            with receiving(self._host):  # (callbacks run as this worker)
                if is_reply:
                    self._on_reply(src, kind, rid, frame)
                else:
                    self.serve(src, kind, rid, frame, self._holders[src])
            return
        lane = current_lane()
        host = self._host
        if lane is not None and lane.owner is host and not self._life.closed:
            # Served right here, on the receiving thread (see rpcx._core.lanes).
            token = _context.bind_thread_agent(self._host)
            try:
                lane.serve(self.serve, src, kind, rid, frame, self._holders[src])
            finally:
                _context.unbind_thread_agent(token)
            return
        try:
            self._pool.submit(self.serve, src, kind, rid, frame, self._holders[src])
        except RpcShutdownError:
            log.debug("%s: dropped request %d from rank %d after shutdown", self._name, rid,
                      src)

    def _handle_notes(self, src: int, frame: Frame) -> None:
        """Handle the one-way messages riding in ``frame``, in order, before the frame."""
        caller = self._workers[src]
        with receiving(self._host):
            self._run_notes(caller, frame)

    def _run_notes(self, caller: WorkerInfo, frame: Frame) -> None:
        try:
            for kind, payload in decode_notes(frame):
                handler = self.handlers.get(kind)
                if handler is None or kind not in self.in_order_kinds:
                    log.warning("%s: dropped a note of kind %d from %s: no in-order handler",
                                self._name, kind, caller.name)
                    continue
                try:
                    handler(caller, payload)
                except Exception:
                    log.exception("%s: note of kind %d from %s failed",
                                  self._name, kind, caller.name)
        except SerializationError as exc:  # not plain data: nothing of it was run
            log.warning("%s: dropped the notes of a frame from %s: %s", self._name,
                        caller.name, exc)
        except Exception:
            log.exception("%s: could not read the notes of a frame from %s", self._name,
                          caller.name)

    def _on_reply(self, src: int, kind: int, rid: int, frame: Frame) -> None:
        pending = self._pending.get(rid)
        if pending is not None and pending.dst.id != src:
            # Only the worker a request went to may answer it; nothing in this frame is
            # decoded (it may be forged, or a peer's bug).
            log.warning("%s: dropped a reply to %s from %s: the request went to %s",
                        self._name, pending.call, self._workers[src].name, pending.dst.name)
            return
        if pending is None:
            if not self._answered.add(rid):  # a duplicate: its RRefs were taken already
                log.debug("%s: dropped a duplicate reply %d from rank %d", self._name, rid,
                          src)
                return
            log.debug("%s: response %d from rank %d arrived after its call ended",
                      self._name, rid, src)
            # Decode and drop it anyway: RRefs in it were registered for us and must be
            # released. Off this thread, as unpickling may run user code.
            with contextlib.suppress(RpcShutdownError):
                self._completions.submit(self._discard, src, frame)
            return
        self._answered.add(rid)
        scope, tag = decode_scope(frame)
        try:
            payload = decode_payload(frame, DecodeContext(src, self._host, scope=scope,
                                                          scope_tag=tag))
        except SerializationError as exc:
            error = SerializationError(
                f"{pending.call} to worker {pending.dst.name!r}: could not unpickle the "
                f"{'result' if kind == _RESULT else 'error'}: {exc}"
            )
            self.complete(rid, exception=lambda _: error)
            return
        if kind == _RESULT:
            if pending.span is not None:
                payload = profiled_reply(self._name, pending, payload)
            self.complete(rid, value=payload)
        else:
            self.complete(rid, exception=lambda p: payload.rebuild(p.call))

    def _discard(self, src: int, frame: Frame) -> None:
        try:
            decode_payload(frame, DecodeContext(src, self._host), lenient=True)
        except Exception as exc:
            log.debug("%s: could not decode a late response: %s", self._name, exc)

    # ----------------------------------------------------------------- 3. serve

    def serve(self, src: int, kind: int, rid: int, frame: Frame,
              holder: int | None = None) -> None:
        """Decode request ``rid`` from ``src``, run its handler, reply.

        ``holder`` counts the workers that had taken ``src`` when the request came
        (:meth:`rejoined`); if another has taken the rank since, the sender is dead and
        the request is dropped (a queued ``remote()`` would leave a value only the dead
        worker could free, in a world that believes it settled).
        """
        if holder is not None and self._holders[src] != holder:
            self._drop_stale(src, rid, frame)
            return
        caller = self._workers[src]
        trace = self.trace
        trace.serving(src, rid, kind)
        scope, tag = decode_scope(frame)
        try:
            handler = self.handlers.get(kind)
            if handler is None:
                raise RpcError(f"worker {self._name!r} does not handle message kind {kind}")
            if scope is None or self.scope is None:
                result = self._run(caller, handler, kind, frame, None, 0)
            else:
                with self.scope.entered(scope, src):
                    result = self._run(caller, handler, kind, frame, scope, tag)
        except BaseException as exc:
            trace.served(src, rid)
            self._reply_error(src, rid, exc)
            return
        if isinstance(result, Deferred):
            result.future.add_done_callback(
                lambda fut: self._reply_with(src, rid, fut, scope, holder)
            )
        else:
            trace.served(src, rid)
            self._reply(src, rid, result, scope, holder)

    def _drop_stale(self, src: int, rid: int, frame: Frame) -> None:
        log.debug("%s: dropped request %d of the worker that held rank %d before %s",
                  self._name, rid, src, self._workers[src].name)
        # (read and dropped, not ignored: the RRefs it carries tell their owners that
        # this worker holds no reference to them)
        self._discard(src, frame)

    def _run(self, caller: WorkerInfo, handler: Handler, kind: int, frame: Frame,
             scope: int | None, tag: int) -> Any:
        """Decode the request, pass its gates, run its handler (inside its scope)."""
        try:
            ctx = DecodeContext(caller.id, self._host, scope=scope, scope_tag=tag)
            payload = decode_payload(frame, ctx)
        except SerializationError as exc:
            error = SerializationError(
                f"worker {self._name!r} could not unpickle the request: {exc}"
            )
            self._recover_undecodable(caller, kind, frame, error)
            raise error from None
        gates = ctx.before_serve
        del ctx
        if gates is not None:
            # (never blocking a delivering thread: in-order handlers skip them)
            if not _receiving_thread.delivering:
                for gate in gates:
                    gate()
            del gates
        return handler(caller, payload)
        # (the arguments, RRefs among them, go as this returns: they need not outlive
        # the call)

    def _recover_undecodable(
        self, caller: WorkerInfo, kind: int, frame: Frame, error: BaseException
    ) -> None:
        # Decoding leniently rebuilds what can be rebuilt. That matters even when nobody
        # looks at the result: RRefs inside get rebuilt, then dropped, so their owners
        # hear that these references are gone.
        try:
            partial = decode_payload(frame, DecodeContext(caller.id, self._host), lenient=True)
        except Exception as exc:
            log.debug("%s: lenient decode failed too: %s", self._name, exc)
            return
        hook = self.decode_error_hooks.get(kind)
        if hook is not None:
            try:
                hook(caller, partial, error)
            except Exception:
                log.exception("%s: decode-error hook failed", self._name)

    def _reply_with(
        self, src: int, rid: int, future: torch._C.Future[Any], scope: int | None,
        holder: int | None = None,
    ) -> None:
        self.trace.served(src, rid)
        try:
            value = future.wait()
        except BaseException as exc:
            self._reply_error(src, rid, exc)
        else:
            self._reply(src, rid, value, scope, holder)

    def _reply(self, src: int, rid: int, value: Any, scope: int | None = None,
               holder: int | None = None) -> None:
        if rid == 0:
            return
        if holder is not None and self._holders[src] != holder:
            # The caller died while its request ran and another worker took its rank:
            # the answer is not encoded (RRefs in it would be registered as held by a
            # worker that never gets them).
            log.debug("%s: dropped the answer to request %d of the worker that held rank "
                      "%d before %s", self._name, rid, src, self._workers[src].name)
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
        self._retransmission.answered(src, rid, frame)
        self.trace.replied(src, rid, True)
        self._transmit(src, frame, ctx, 0)  # a failed reply is the caller's to notice

    def _reply_error(self, src: int, rid: int, exc: BaseException) -> None:
        if rid == 0:
            log.warning("%s: one-way message from rank %d failed: %r", self._name, src, exc)
            return
        info = RemoteErrorInfo.capture(exc, self._name)
        ctx = self._response_context(src)
        frame = self._encode(MessageKind.ERROR, rid, info, ctx)
        frame.reply_to = rid
        self._retransmission.answered(src, rid, frame)
        self.trace.replied(src, rid, False)
        self._transmit(src, frame, ctx, 0)

    # -------------------------------------------------------------- 4. complete

    def complete(
        self, rid: int, *, value: Any = None,
        exception: Callable[[PendingCall], BaseException] | None = None,
    ) -> None:
        """Settle call ``rid`` with ``value``, or with ``exception(pending)``; once."""
        pending = self._pending.pop(rid)
        if pending is None:
            return
        if pending.nbytes:
            self._back_pressure.give(pending.dst.id, pending.nbytes)
        outcome = None if exception is None else exception(pending)
        self.trace.completed(pending.dst.id, rid,
                             "ok" if outcome is None else type(outcome).__name__)
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

    def expire(self, rid: int) -> None:
        """Call ``rid``'s deadline passed (the timer)."""
        self.complete(rid, exception=_timeout_error)

    def fail(self, rids: list[int], error: Callable[[PendingCall], BaseException]) -> None:
        """Settle each of calls ``rids`` with ``error(pending)``."""
        for rid in rids:
            self.complete(rid, exception=error)

    def cancel_all(self) -> None:
        """The worker closes: refuse new calls, fail every pending one."""
        self._back_pressure.wake()
        self.fail(self._pending.close(), lambda p: RpcShutdownError(
            f"{p.call} to worker {p.dst.name!r} was cancelled: worker {self._name!r} shut down"))

    def _shut_down_error(self, label: CallLabel, dst: WorkerInfo) -> RpcShutdownError:
        return RpcShutdownError(
            f"{label.call} to worker {dst.name!r}: RPC on worker {self._name!r} has shut "
            f"down"
        )


def _timeout_error(pending: PendingCall) -> BaseException:
    return RpcTimeoutError(
        f"{pending.call} to worker {pending.dst.name!r} timed out after "
        f"{pending.elapsed:.3g} s (timeout {pending.timeout:g} s)"
    )


def _settle(future: RpcFuture[Any], value: Any, exception: BaseException | None) -> None:
    if exception is None:
        future.set_result(value)
    else:
        future.set_exception(exception)
