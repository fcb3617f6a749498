"""``rpcx trace merge DIR -o OUT.json``, ``rpcx trace plot DIR -o OUT.png`` and ``rpcx
trace otel DIR [--endpoint URL]``.

``merge`` writes one Chrome trace of every worker's ``*.rpcx-trace.json`` in DIR and
prints a summary line; its exit status is 1 if the aligned clocks still put a call's
steps out of order (each such call is printed). ``plot`` draws the timeline as a PNG.
``otel`` sends it as OpenTelemetry spans to an OTLP endpoint, or prints them, one JSON
object a line. Unusable input (no trace files, a bad file) or a missing package is one
line on stderr and exit status 2.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["merge_command", "otel_command", "plot_command"]

_MAX_VIOLATIONS = 20


def _fail(command: str, error: Exception) -> int:
    print(f"rpcx trace {command}: {error}", file=sys.stderr)
    return 2


def merge_command(directory: str, out: str) -> int:
    """``rpcx trace merge``: write the merged trace, print what it holds."""
    from rpcx.tracing.merge import TraceError, write_merged

    try:
        summary = write_merged(directory, out)
    except (TraceError, OSError) as e:
        return _fail("merge", e)
    if summary.unaligned:
        clock = f"clock error unknown (no clock samples from {', '.join(summary.unaligned)})"
    else:
        clock = f"worst clock error {(summary.worst_clock_error_ns or 0) / 1000:.1f} us"
    extra = ""
    if summary.incomplete_calls:
        extra += f", {summary.incomplete_calls} incomplete"
    if summary.dropped:
        extra += f", {summary.dropped} events dropped"
    print(f"{summary.path}: {summary.workers} workers, {summary.calls} calls{extra}, "
          f"{clock}, {len(summary.violations)} causality violations")
    for line in summary.violations[:_MAX_VIOLATIONS]:
        print(f"  {line}")
    if len(summary.violations) > _MAX_VIOLATIONS:
        print(f"  ... and {len(summary.violations) - _MAX_VIOLATIONS} more")
    return 1 if summary.violations else 0


def plot_command(directory: str, out: str, title: str | None = None) -> int:
    """``rpcx trace plot``: draw the timeline, print what was drawn."""
    from rpcx.tracing.merge import TraceError
    from rpcx.tracing.plot import plot_timeline

    try:
        summary = plot_timeline(directory, out, title=title)
    except (TraceError, OSError, ImportError) as e:
        return _fail("plot", e)
    workers = len({row.split(" / ", 1)[0] for row in summary.rows})
    print(f"{summary.path}: {len(summary.rows)} rows ({workers} workers), "
          f"{summary.spans} spans, {summary.arrows} arrows, {summary.instants} instants")
    return 0


_OTLP_MISSING = "the OTLP exporter is not installed: pip install opentelemetry-exporter-otlp"


def otel_command(directory: str, endpoint: str | None = None,
                 service_name: str = "rpcx") -> int:
    """``rpcx trace otel``: export the timeline as OpenTelemetry spans.

    With ``endpoint``, over OTLP: gRPC (``http://localhost:4317``), or HTTP when the URL
    ends in ``/v1/traces``. Without, print the spans to stdout, one JSON object a line,
    and the summary to stderr.
    """
    from rpcx.tracing.merge import TraceError
    from rpcx.tracing.otel import SDK_MISSING, export_spans, span_json

    try:
        from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
            SpanExporter,
        )
    except ImportError:
        return _fail("otel", ImportError(SDK_MISSING))
    exporter: SpanExporter
    processor: SpanProcessor
    if endpoint is None:
        # sys.stdout now, not the default's (bound at import); in order, as they end.
        processor = SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stdout,
                                                            formatter=span_json))
    else:
        # By name: the exporter is optional, and mypy must not need it either.
        http = endpoint.rstrip("/").endswith("/v1/traces")
        try:
            module = importlib.import_module("opentelemetry.exporter.otlp.proto."
                                             f"{'http' if http else 'grpc'}.trace_exporter")
        except ImportError:
            return _fail("otel", ImportError(_OTLP_MISSING))
        exporter = module.OTLPSpanExporter(endpoint=endpoint)
        processor = BatchSpanProcessor(exporter)
    # Every instant is an event of its worker's span: no cap on how many a span keeps.
    provider = TracerProvider(span_limits=SpanLimits(max_events=SpanLimits.UNSET),
                              shutdown_on_exit=False)
    provider.add_span_processor(processor)
    try:
        summary = export_spans(directory, provider, service_name=service_name)
    except (TraceError, OSError) as e:
        provider.shutdown()
        return _fail("otel", e)
    flushed = provider.force_flush()
    provider.shutdown()
    extra = f", {summary.skipped_calls} incomplete calls skipped" if summary.skipped_calls else ""
    line = (f"{directory}: {summary.workers} workers, {summary.calls} calls, "
            f"{summary.serves} serves, {summary.instants} instants{extra}: {summary.spans} "
            f"spans, trace {summary.trace_id}")
    if endpoint is None:
        print(line, file=sys.stderr)
        return 0
    if not flushed:
        return _fail("otel", TimeoutError(f"{endpoint}: spans not all sent in time"))
    print(f"{line}, sent to {endpoint}")
    return 0
