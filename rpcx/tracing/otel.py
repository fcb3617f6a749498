"""rpcx's timeline as OpenTelemetry spans: ``rpcx trace otel DIR``, :func:`export_spans`.

Reads a directory of worker trace files (docs/design/tracing.md) and hands every call to an
OpenTelemetry tracer provider, so a collector shows rpcx's calls beside the rest of a
service. Like :mod:`rpcx.tracing.merge`, it works on the files alone: no torch, nothing
from rpcx outside ``rpcx.tracing``; OpenTelemetry is imported only when called.

The directory becomes **one trace**, laid out as the merged Chrome trace reads::

    rpcx trace                         INTERNAL  the whole directory
    ├── rpcx worker trainer0           INTERNAL  that worker's first to last event;
    │   │                                        its instants are this span's events
    │   ├── rpc_sync#mod.fn            CLIENT    send -> complete, on trainer0
    │   │   └── serve rpc_sync#mod.fn  SERVER    serve_start -> serve_end, on the
    │   │                                        callee
    │   └── ...
    └── rpcx worker ps1
        └── ...

Why so: one trace per directory keeps a step together in a viewer such as Jaeger (one
trace per call would scatter it into thousands of two-span traces). A worker's root span
is its row, as a process is in the Chrome trace: its calls hang under it, each serve under
the call it answers (as OpenTelemetry's RPC instrumentations nest them), and its instants
(``optimizer step``, ``peer lost: ps1``, ...) are events on it, the one span of that worker
that every instant falls inside. Each worker's spans carry a resource of their own
(``service.name``, ``rpcx.worker``, ``host.name``, ``process.pid``) so a viewer shows
which process did what.

Times are ns since the Unix epoch: a worker's monotonic clock is aligned to the reference
worker's with :class:`~rpcx.tracing.merge.ClockMap`, then turned into wall time by one
worker's ``wall`` pair (the reference worker's). Calls missing their send or completion
(pushed out of a ring, in flight when the trace ended) are skipped and counted; a call
whose callee did not record both ends of its serve (lost, timed out) has no server span.

An SDK span keeps at most ``OTEL_SPAN_EVENT_COUNT_LIMIT`` events (128 by default); a
worker with more instants loses its oldest ones there (:attr:`ExportSummary.dropped_instants`
counts them). ``rpcx trace otel`` lifts that limit.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rpcx.tracing.merge import Call, ClockMap, WorkerTrace, load_traces, match_calls

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import Span, Tracer, TracerProvider
    from opentelemetry.util.types import AttributeValue

__all__ = ["SDK_MISSING", "ExportSummary", "export_spans", "span_json"]

SDK_MISSING = ("OpenTelemetry's SDK is not installed: pip install opentelemetry-sdk "
               "(or pip install 'torch-rpcx[trace]')")

_SCOPE = "rpcx.tracing.otel"


@dataclass(frozen=True)
class ExportSummary:
    """What :func:`export_spans` handed to the tracer provider."""

    workers: int  # trace files read
    spans: int  # all of them: the trace's root, workers' roots, calls, serves
    calls: int  # client spans
    serves: int  # server spans
    instants: int  # span events on the workers' root spans
    skipped_calls: int  # calls without both their send and their completion
    errors: int  # spans whose status is ERROR
    dropped_events: int  # events the workers' rings pushed out (from the files)
    dropped_instants: int  # instants the SDK's span event limit dropped
    trace_id: str | None  # 32 hex digits; None when nothing was recorded (no SDK, sampled out)


def _split(label: str) -> tuple[str, str]:
    """``api#target`` as ``(api, target)``; target empty when the label has no ``#``."""
    api, _, target = label.partition("#")
    return api, target


def export_spans(directory: str | os.PathLike[str],
                 tracer_provider: TracerProvider | None = None, *,
                 service_name: str = "rpcx") -> ExportSummary:
    """Turn ``directory``'s worker trace files into spans of ``tracer_provider``.

    ``tracer_provider``: where the spans go; None means the global one
    (``opentelemetry.trace.get_tracer_provider()``). ``service_name`` becomes the
    ``service.name`` of the spans' resources (with an SDK provider, merged onto its own
    resource). Raises :class:`~rpcx.tracing.merge.TraceError` for unusable input and
    ImportError (saying what to install) without ``opentelemetry-sdk``.
    """
    try:
        from opentelemetry import trace as otel
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.trace import Tracer as SdkTracer
    except ImportError as e:
        raise ImportError(SDK_MISSING) from e

    traces = load_traces(directory)
    calls = match_calls(traces)
    clocks = {t.rank: ClockMap(t.clock) for t in traces}
    provider = otel.get_tracer_provider() if tracer_provider is None else tracer_provider
    base = provider.get_tracer(_SCOPE)

    def tracer_for(attributes: Mapping[str, AttributeValue]) -> Tracer:
        # A resource belongs to a tracer, and an SDK provider gives all its tracers its own:
        # a shallow copy shares the provider's processors, sampler and ids, with the
        # worker's resource. Other tracers (the API's no-op proxy) take none.
        if not isinstance(base, SdkTracer):
            return base
        mine = copy.copy(base)
        mine.resource = base.resource.merge(Resource(attributes))
        return mine

    # Reference-clock ns to Unix ns, by the reference worker's wall pair (any worker's would
    # do, its pair aligned the same way; merge_traces falls back likewise).
    anchor = next((t for t in traces if t.worker == t.reference), traces[0])
    to_wall = anchor.wall_unix_ns - clocks[anchor.rank].to_reference(anchor.wall_monotonic_ns)

    def wall(reference_ns: int) -> int:
        return reference_ns + to_wall

    extents: dict[int, tuple[int, int]] = {}  # rank -> first and last event, reference ns
    for t in traces:
        if t.events:
            times = [clocks[t.rank].to_reference(ev.t_ns) for ev in t.events]
            extents[t.rank] = (min(times), max(times))
    if not extents:
        return ExportSummary(len(traces), 0, 0, 0, 0, len(calls), 0,
                             sum(t.dropped for t in traces), 0, None)

    spans = errors = 0

    def start(tracer: Tracer, name: str, begin_ns: int, parent: Span | None,
              kind: otel.SpanKind = otel.SpanKind.INTERNAL,
              attributes: Mapping[str, AttributeValue] | None = None) -> Span:
        nonlocal spans
        spans += 1
        context = None if parent is None else otel.set_span_in_context(parent)
        return tracer.start_span(name, context=context, kind=kind, attributes=attributes,
                                 start_time=wall(begin_ns))

    def fail(span: Span, why: str) -> None:
        nonlocal errors
        errors += 1
        span.set_status(otel.Status(otel.StatusCode.ERROR, why))

    root = start(tracer_for({"service.name": service_name}), "rpcx trace",
                 min(b for b, _ in extents.values()), None,
                 attributes={"rpcx.trace_dir": os.fspath(directory)})
    by_rank = {t.rank: t for t in traces}
    tracers: dict[int, Tracer] = {}
    workers: dict[int, Span] = {}
    for t in traces:
        tracers[t.rank] = tracer_for(_resource(t, service_name))
        if t.rank in extents:
            workers[t.rank] = start(tracers[t.rank], f"rpcx worker {t.worker}",
                                    extents[t.rank][0], root,
                                    attributes=_worker_attributes(t, clocks[t.rank]))

    exported = serves = 0
    for c in calls:
        if c.send_ns is None or c.complete_ns is None:
            continue
        exported += 1
        caller, callee = by_rank[c.caller_rank], by_rank.get(c.callee_rank)
        client = start(tracers[c.caller_rank], c.label, c.send_ns, workers[c.caller_rank],
                       otel.SpanKind.CLIENT,
                       _call_attributes(c, caller, clocks, c.caller_thread, c.outcome))
        if c.outcome != "ok":
            fail(client, c.outcome or "?")
        if callee is not None and c.serve_start_ns is not None and c.serve_end_ns is not None:
            serves += 1
            server = start(tracers[c.callee_rank], f"serve {c.label}", c.serve_start_ns,
                           client, otel.SpanKind.SERVER,
                           _call_attributes(c, callee, clocks, c.callee_thread,
                                            c.reply_label))
            if c.reply_label == "error":
                fail(server, "error")
            server.end(end_time=wall(c.serve_end_ns))
        client.end(end_time=wall(c.complete_ns))

    names = {t.rank: t.worker for t in traces}
    instants = dropped_instants = 0
    for t in traces:
        if t.rank not in workers:
            continue
        span = workers[t.rank]
        for ev in t.events:
            if ev.kind != "instant":
                continue
            instants += 1
            attributes: dict[str, AttributeValue] = {
                "thread.id": ev.thread, "thread.name": t.thread_name(ev.thread)}
            if ev.peer >= 0:
                attributes["rpcx.peer"] = names.get(ev.peer, f"rank {ev.peer}")
            span.add_event(ev.label, attributes,
                           timestamp=wall(clocks[t.rank].to_reference(ev.t_ns)))
        span.end(end_time=wall(extents[t.rank][1]))
        if isinstance(span, ReadableSpan):
            dropped_instants += span.dropped_events
    root.end(end_time=wall(max(e for _, e in extents.values())))
    trace_id = root.get_span_context().trace_id
    return ExportSummary(
        workers=len(traces), spans=spans, calls=exported, serves=serves, instants=instants,
        skipped_calls=len(calls) - exported, errors=errors,
        dropped_events=sum(t.dropped for t in traces), dropped_instants=dropped_instants,
        trace_id=otel.format_trace_id(trace_id) if trace_id != otel.INVALID_TRACE_ID else None)


def _resource(t: WorkerTrace, service_name: str) -> dict[str, AttributeValue]:
    return {"service.name": service_name, "rpcx.worker": t.worker, "rpcx.rank": t.rank,
            "rpcx.backend": t.backend, "host.name": t.host, "process.pid": t.pid}


def _worker_attributes(t: WorkerTrace, clock: ClockMap) -> dict[str, AttributeValue]:
    out: dict[str, AttributeValue] = {"rpc.system": "rpcx", "rpcx.worker": t.worker,
                                      "rpcx.rank": t.rank, "rpcx.dropped_events": t.dropped}
    if clock.error_ns is not None:  # unknown without clock samples: left out, not guessed
        out["rpcx.clock_error_ns"] = clock.error_ns
    return out


def _call_attributes(c: Call, worker: WorkerTrace, clocks: Mapping[int, ClockMap],
                     thread: int | None, outcome: str | None) -> dict[str, AttributeValue]:
    """A span's attributes; ``worker`` recorded it, so its clock's error bound applies."""
    api, target = _split(c.label)
    out: dict[str, AttributeValue] = {
        "rpc.system": "rpcx", "rpcx.api": api, "rpcx.caller": c.caller,
        "rpcx.callee": c.callee, "rpcx.call_id": c.call_id}
    if target:
        out["rpc.method"] = target
    if outcome is not None:
        out["rpcx.outcome"] = outcome
    error = clocks[worker.rank].error_ns
    if error is not None:
        out["rpcx.clock_error_ns"] = error
    if thread is not None:
        out["thread.id"] = thread
        out["thread.name"] = worker.thread_name(thread)
    return out


def span_json(span: ReadableSpan) -> str:
    """A finished SDK span as one line of compact JSON, newline included (times in Unix ns;
    what ``rpcx trace otel`` prints)."""
    import json

    from opentelemetry.trace import format_span_id, format_trace_id

    context, parent = span.get_span_context(), span.parent
    out = {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": format_trace_id(context.trace_id) if context else None,
        "span_id": format_span_id(context.span_id) if context else None,
        "parent_id": format_span_id(parent.span_id) if parent else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp,
                    "attributes": dict(e.attributes or {})} for e in span.events],
        "resource": dict(span.resource.attributes),
    }
    if span.status.description:
        out["status_description"] = span.status.description
    return json.dumps(out, separators=(",", ":")) + "\n"

