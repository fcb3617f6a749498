"""torch's profiler across workers: a span per call on the caller, the callee's work
shipped back with the reply and added to the caller's profile.

While ``torch.profiler.profile()`` or ``torch.autograd.profiler.profile()`` (Kineto or the
legacy profiler) is active on the calling thread:

* every request records a span named as torch names it,
  ``rpc_async#udf(worker0 -> worker1)``, from the call until its future completes;
* a request that runs user code (``CALL``, ``REMOTE_CALL``, ``RREF_CALL``) travels
  wrapped as ``PROFILED``: the callee serves it under torch's thread-local legacy
  profiler and answers ``(value, serve_ns, events)``; the caller keeps the events;
* when the caller's profile builds its event list, the events kept for its spans are
  added to it as remote events (``is_remote``, ``node_id`` = the callee's rank), named
  ``<span>#remote_op: <op>`` and placed inside their span (the callee's times, shifted
  by half the round trip not spent serving).

torch gives no public way to add events to a profile, so the last step wraps the two
methods that build one (``torch.autograd.profiler.profile._ensure_function_events`` and
``torch.autograd.profiler_legacy.profile.__exit__``), and the two that start one (their
``_start_trace``: a profile takes only the events of calls made after it started), once,
when the first agent starts.
The wrappers call torch's method first and only ever append. docs/design/tracing.md
says more.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rpcx._core.label import CallLabel
from rpcx.futures import RpcFuture
from rpcx.messages import MessageKind

__all__ = [
    "PROFILED_KINDS",
    "CallSpan",
    "RemoteEvent",
    "begin_span",
    "hop_span",
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


def span_name(label: CallLabel, caller: str, callee: str) -> str:
    """The span's name as torch builds it: ``rpc_sync#add(worker0 -> worker1)``."""
    api, target = label.api, label.target
    mode = _EXEC_MODES.get(api, api)
    name = None
    if callable(target):
        find_builtin: Any = torch.jit._builtins._find_builtin
        name = find_builtin(target)  # torch.add -> "aten::add"
        if name is None:
            name = getattr(target, "__qualname__", None)
    if name is None:
        # (an RRef's fetch or proxy call: named by its type, not its repr with ids)
        name = label.describe(target).replace(repr(target), type(target).__name__)
    return f"{mode}#{name}({caller} -> {callee})"


class CallSpan:
    """One profiled call on the caller: its span, and the remote events of its reply."""

    __slots__ = ("_record", "callee_rank", "name", "remote", "sent_ns", "sequence")

    def __init__(self, name: str, callee_rank: int) -> None:
        self.name = name
        self.callee_rank = callee_rank
        self.sequence = _kept.next_sequence()  # (profiles started later do not take it)
        self.remote = False  # the request went wrapped: the reply carries events
        record: Any = torch.autograd.profiler.record_function(name)
        record.__enter__()
        self._record = record
        # Timed once the span is open: the remote events are placed from the span's
        # start, so a round trip counted from before it (a first span can take 100 ms
        # to open under a profiler in a fresh process) would push them past its end.
        self.sent_ns = time.monotonic_ns()

    def end_with(self, future: RpcFuture[Any]) -> RpcFuture[Any]:
        """End the span when ``future`` completes; the returned future completes after
        (so a caller that waits on it and leaves the profiler finds the span ended)."""
        record = self._record
        try:
            ended = record._call_end_callbacks_on_future(future)
        finally:
            record.__exit__(None, None, None)  # (the span itself ends with the future)
        out: RpcFuture[Any] = RpcFuture()

        def relay(_: torch.futures.Future[Any]) -> None:
            # The outcome is read from the call's own future: torch's end-callbacks
            # future carries an error as a plain value.
            try:
                out.set_result(future.value())
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
        _kept.add(self.name, self.callee_rank, self.sequence,
                  [(name, start + shift_us, end + shift_us, thread, shapes)
                   for name, start, end, thread, shapes in events])
        return value


def hop_span(caller: str, callee: str) -> Any:
    """The span of a backward hop (a one-way ``AUTOGRAD_CHAIN``): sending the gradients,
    ``dist_autograd.backward#hop(trainer0 -> ps)``; the callee's share is its own."""
    return torch.autograd.profiler.record_function(
        f"dist_autograd.backward#hop({caller} -> {callee})")


def begin_span(label: CallLabel, caller: str, callee: str, callee_rank: int) -> CallSpan:
    """Open the span of a call about to be sent (only when :func:`profiler_active`)."""
    return CallSpan(span_name(label, caller, callee), callee_rank)


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
        answered: torch.futures.Future[Any] = torch.futures.Future()

        def answer(done: torch.futures.Future[Any]) -> None:
            # (not Future.then: a callback that raises would turn the handler's error
            # into torch's RuntimeError)
            try:
                answered.set_result((done.value(), time.monotonic_ns() - started, events))
            except BaseException as exc:
                answered.set_exception(exc)

        result.future.add_done_callback(answer)
        return defer(answered)
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
    """Remote events of profiled calls, by span name, until a profile takes them.

    Each call gets a sequence number when its span opens; a profile notes the next
    number when it starts, and takes only batches from then on, so events of calls a
    profile never read cannot pair with the spans of a later one. What no profile takes
    is dropped, oldest first, past ``LIMIT`` events.
    """

    LIMIT = 200_000  # events kept in all

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batches: collections.OrderedDict[int, tuple[str, int, list[RemoteEvent]]] = (
            collections.OrderedDict())
        self._sequence = itertools.count()
        self._events = 0

    def next_sequence(self) -> int:
        """A number for a call about to be made (or for a profile about to start)."""
        return next(self._sequence)

    def add(self, span: str, rank: int, sequence: int, events: list[RemoteEvent]) -> None:
        with self._lock:
            self._batches[sequence] = (span, rank, events)
            self._events += len(events)
            while self._events > self.LIMIT and self._batches:
                _, (_, _, dropped) = self._batches.popitem(last=False)
                self._events -= len(dropped)

    def take_for(self, spans: dict[str, list[Any]], since: int
                 ) -> list[tuple[Any, int, list[RemoteEvent]]]:
        """Pair the batches of calls made since sequence ``since`` with the spans of a
        profile: the n-th span of a name with the n-th such call (in the order the
        calls were made)."""
        taken: list[tuple[Any, int, list[RemoteEvent]]] = []
        with self._lock:
            for sequence in sorted(s for s in self._batches if s >= since):
                name, rank, events = self._batches[sequence]
                queue = spans.get(name)
                if queue:
                    taken.append((queue.pop(0), rank, events))
                    del self._batches[sequence]
                    self._events -= len(events)
        return taken


_kept = _KeptEvents()
_hooks_installed = False
_hooks_lock = threading.Lock()


def _add_remote_events(function_events: Any, since: int) -> None:
    """Append to a profile's event list the remote events of the calls it spans (those
    made since sequence ``since``, when the profile started)."""
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
    for span, rank, events in _kept.take_for(spans, since):
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

        for cls in (profiler.profile, profiler_legacy.profile):
            cls._start_trace = _noting_start(cls._start_trace)  # type: ignore[method-assign]

        ensure: Any = profiler.profile._ensure_function_events

        @functools.wraps(ensure)
        def ensure_with_remote(self: Any) -> None:
            first = self._function_events is None  # (built once; later calls return early)
            ensure(self)
            if first:
                _add_safely(self._function_events, self)

        legacy_exit: Any = profiler_legacy.profile.__exit__

        @functools.wraps(legacy_exit)
        def exit_with_remote(self: Any, *exc: Any) -> Any:
            result = legacy_exit(self, *exc)
            _add_safely(getattr(self, "function_events", None), self)
            return result

        profiler.profile._ensure_function_events = ensure_with_remote  # type: ignore[method-assign]
        profiler_legacy.profile.__exit__ = exit_with_remote  # type: ignore[method-assign]
        _hooks_installed = True


def _noting_start(start: Any) -> Any:
    @functools.wraps(start)
    def start_noting_sequence(self: Any) -> Any:
        self._rpcx_since = _kept.next_sequence()
        return start(self)

    return start_noting_sequence


def _add_safely(function_events: Any, profile: Any) -> None:
    try:
        _add_remote_events(function_events, getattr(profile, "_rpcx_since", 0))
    except Exception:  # a profile without our events beats a profile that fails
        log.exception("rpcx: could not add remote events to a profile")
