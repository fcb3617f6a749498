"""torch's profiler across workers: a span per call on the caller, the callee's work
shipped back with the reply and added to the caller's profile.

While ``torch.profiler.profile()`` or ``torch.autograd.profiler.profile()`` (Kineto or the
legacy profiler) is active on the calling thread:

* every request records a span named as torch names it,
  ``rpc_async#udf(worker0 -> worker1)``, from the call until its future completes;
* a request that runs user code (``CALL``, ``REMOTE_CALL``, ``RREF_CALL``) travels
  wrapped as ``PROFILED``: the callee serves it under torch's thread-local legacy
  profiler and answers ``(value, events)``; the caller keeps the events;
* when the caller's profile builds its event list, the events kept for its spans are
  added to it as remote events (``is_remote``, ``node_id`` = the callee's rank), named
  ``<span>#remote_op: <op>`` and placed inside their span (the callee's times, shifted
  by half the round trip not spent serving).

torch gives no public way to add events to a profile, so the last step wraps the two
methods that build one (``torch.autograd.profiler.profile._ensure_function_events`` and
``torch.autograd.profiler_legacy.profile.__exit__``), once, when the first agent starts.
The wrappers call torch's method first and only ever append. docs/design/tracing.md
says more.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rpcx.futures import RpcFuture
from rpcx.messages import MessageKind

__all__ = [
    "PROFILED_KINDS",
    "CallSpan",
    "RemoteEvent",
    "begin_span",
    "install_profile_hooks",
    "mark_profiler_node",
    "profiler_active",
    "serve_profiled",
    "span_name",
]

log = logging.getLogger("rpcx.profiling")

REMOTE_OP = "#remote_op: "
"""What joins a call's span and a remote event's own name (torch's ``REMOTE_OP_STR``)."""

PROFILED_KINDS = frozenset({MessageKind.CALL, MessageKind.REMOTE_CALL, MessageKind.RREF_CALL})
"""Requests that run user code: their remote operators are worth shipping back."""

_EXEC_MODES = {"rpc_sync": "rpc_sync", "rpc_async": "rpc_async", "remote": "rpc_remote"}

RemoteEvent = tuple[str, float, float, int, list[Any]]
"""``(name, start_us, end_us, thread, input shapes)``, times from the start of serving."""

profiler_active: Callable[[], bool] = torch._C._autograd._profiler_enabled
"""Whether a profiler records on this thread (a C call: cheap enough for every request)."""


def span_name(api: str, target: Any, describe: Callable[[Any], str], caller: str,
              callee: str) -> str:
    """The span's name as torch builds it: ``rpc_sync#add(worker0 -> worker1)``."""
    mode = _EXEC_MODES.get(api, api)
    name = None
    if callable(target):
        find_builtin: Any = torch.jit._builtins._find_builtin
        name = find_builtin(target)  # torch.add -> "aten::add"
        if name is None:
            name = getattr(target, "__qualname__", None)
    if name is None:
        # (an RRef's fetch or proxy call: named by its type, not its repr with ids)
        name = describe(target).replace(repr(target), type(target).__name__)
    return f"{mode}#{name}({caller} -> {callee})"


class CallSpan:
    """One profiled call on the caller: its span, and the remote events of its reply."""

    __slots__ = ("_record", "callee_rank", "name", "remote", "sent_ns")

    def __init__(self, name: str, callee_rank: int) -> None:
        self.name = name
        self.callee_rank = callee_rank
        self.sent_ns = time.monotonic_ns()
        self.remote = False  # the request went wrapped: the reply carries events
        record: Any = torch.autograd.profiler.record_function(name)
        record.__enter__()
        self._record = record

    def end_with(self, future: RpcFuture[Any]) -> RpcFuture[Any]:
        """End the span when ``future`` completes; the returned future completes after
        (so a caller that waits on it and leaves the profiler finds the span ended)."""
        record = self._record
        try:
            ended = record._call_end_callbacks_on_future(future)
        finally:
            record.__exit__(None, None, None)  # (the span itself ends with the future)
        out: RpcFuture[Any] = RpcFuture()

        def relay(done: torch.futures.Future[Any]) -> None:
            try:
                out.set_result(done.value())
            except BaseException as exc:
                out.set_exception(exc)

        ended.add_done_callback(relay)
        return out

    def abandon(self) -> None:
        """The call was never sent: end the span now."""
        self._record.__exit__(None, None, None)

    def received(self, reply: Any) -> Any:
        """The reply of a wrapped request: keep its events, return the value."""
        value, serve_ns, events = reply
        round_trip_ns = time.monotonic_ns() - self.sent_ns
        # The request's travel time is unknown; half of what the round trip did not
        # spend serving is the best guess.
        shift_us = max(0, round_trip_ns - serve_ns) / 2e3
        _kept.add(self.name, self.callee_rank,
                  [(name, start + shift_us, end + shift_us, thread, shapes)
                   for name, start, end, thread, shapes in events])
        return value


def begin_span(api: str, target: Any, describe: Callable[[Any], str], caller: str,
               callee: str, callee_rank: int) -> CallSpan:
    """Open the span of a call about to be sent (only when :func:`profiler_active`)."""
    return CallSpan(span_name(api, target, describe, caller, callee), callee_rank)


def mark_profiler_node(rank: int) -> None:
    """Make the profiler record this process's events with ``node_id`` = ``rank``, as
    torch's ``init_rpc`` does (one worker per process only: it is process-wide)."""
    try:
        from torch._C._distributed_rpc import _set_profiler_node_id
    except ImportError:  # a torch built without distributed support: events keep -1
        return
    _set_profiler_node_id(rank)


# ------------------------------------------------------------------ callee's side

def serve_profiled(run: Callable[[], Any], is_deferred: Callable[[Any], bool],
                   defer: Callable[[torch.futures.Future[Any]], Any]) -> Any:
    """Run a wrapped request's handler under torch's thread-local legacy profiler and
    answer ``(value, serve_ns, events)`` (a deferred result answers when it completes)."""
    if profiler_active():
        # This worker profiles itself (Kineto, all threads): its own profile keeps the
        # events; a thread-local profiler here would take them from it.
        started = time.monotonic_ns()
        result = run()
        events: list[RemoteEvent] = []
    else:
        from torch.autograd import profiler_legacy

        profile: Any = profiler_legacy.profile

        started = time.monotonic_ns()
        # (The caller's profiler settings cannot be read from Python: shapes are always
        # recorded, memory never.)
        with profile(record_shapes=True) as prof:
            result = run()
        events = _remote_events(prof.function_events)
    if is_deferred(result):
        future = result.future

        def answer(done: torch.futures.Future[Any]) -> Any:
            return (done.value(), time.monotonic_ns() - started, events)

        return defer(future.then(answer))
    return (result, time.monotonic_ns() - started, events)


def _remote_events(function_events: Any) -> list[RemoteEvent]:
    """A served request's events as plain data, times from the first event's start."""
    found = [event for event in function_events if event.name != "[memory]"]
    if not found:
        return []
    origin = min(event.time_range.start for event in found)
    return [(str(event.name), float(event.time_range.start - origin),
             float(event.time_range.end - origin), int(event.thread),
             [list(shape) for shape in event.input_shapes or ()]) for event in found]


# ------------------------------------------------- adding them to the caller's profile

class _KeptEvents:
    """Remote events of profiled calls, by span name, until a profile takes them."""

    LIMIT = 10_000  # batches kept; the oldest go first (calls no profile ever read)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batches: collections.OrderedDict[int, tuple[str, int, list[RemoteEvent]]] = (
            collections.OrderedDict())
        self._next = 0

    def add(self, span: str, rank: int, events: list[RemoteEvent]) -> None:
        with self._lock:
            self._batches[self._next] = (span, rank, events)
            self._next += 1
            while len(self._batches) > self.LIMIT:
                self._batches.popitem(last=False)

    def take_for(self, spans: dict[str, list[Any]]) -> list[tuple[Any, int, list[RemoteEvent]]]:
        """Pair kept batches with the spans of a profile: the n-th span of a name
        with the n-th batch kept under it (calls of one name are kept in the order
        their replies came, which is their order unless they overlap)."""
        taken: list[tuple[Any, int, list[RemoteEvent]]] = []
        with self._lock:
            for key, (name, rank, events) in list(self._batches.items()):
                queue = spans.get(name)
                if queue:
                    taken.append((queue.pop(0), rank, events))
                    del self._batches[key]
        return taken


_kept = _KeptEvents()
_hooks_installed = False
_hooks_lock = threading.Lock()


def _add_remote_events(function_events: Any) -> None:
    """Append to a profile's event list the remote events of the calls it spans."""
    if function_events is None:
        return
    spans: dict[str, list[Any]] = {}
    for event in sorted(function_events, key=lambda e: e.time_range.start):
        if "(" in event.name and " -> " in event.name and not event.is_remote:
            spans.setdefault(event.name, []).append(event)
    if not spans:
        return
    from torch.autograd import profiler_util

    function_event: Any = profiler_util.FunctionEvent

    next_id = max((event.id for event in function_events), default=0) + 1
    for span, rank, events in _kept.take_for(spans):
        start = span.time_range.start
        for name, begin_us, end_us, thread, shapes in events:
            full = f"{span.name}{REMOTE_OP}{name}"
            function_events.append(function_event(
                id=next_id, name=full, trace_name=full, thread=thread,
                start_us=start + begin_us, end_us=start + end_us, stack=[],
                input_shapes=shapes, is_remote=True, node_id=rank, is_legacy=True))
            next_id += 1


def install_profile_hooks() -> None:
    """Wrap the two methods of torch's profilers that build a profile's events (once;
    ``init_rpc`` does: a ``with`` block looks its ``__exit__`` up as it enters)."""
    global _hooks_installed
    if _hooks_installed:
        return
    with _hooks_lock:
        if _hooks_installed:
            return
        from torch.autograd import profiler, profiler_legacy

        ensure: Any = profiler.profile._ensure_function_events

        @functools.wraps(ensure)
        def ensure_with_remote(self: Any) -> None:
            ensure(self)
            try:
                _add_remote_events(self._function_events)
            except Exception:  # a profile without our events beats a profile that fails
                log.exception("rpcx: could not add remote events to a profile")

        legacy_exit: Any = profiler_legacy.profile.__exit__

        @functools.wraps(legacy_exit)
        def exit_with_remote(self: Any, *exc: Any) -> Any:
            result = legacy_exit(self, *exc)
            try:
                _add_remote_events(getattr(self, "function_events", None))
            except Exception:
                log.exception("rpcx: could not add remote events to a profile")
            return result

        profiler.profile._ensure_function_events = ensure_with_remote  # type: ignore[method-assign]
        profiler_legacy.profile.__exit__ = exit_with_remote  # type: ignore[method-assign]
        _hooks_installed = True
