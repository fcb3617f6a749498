"""rpcx's timeline as OpenTelemetry spans (rpcx.tracing.otel, ``rpcx trace otel``).

The traces are synthetic, as in test_trace_merge.py: a small world is described on the
reference clock, and each worker's file is written with its own monotonic clock skewed
from it, as a real one is. Spans go to an SDK provider that keeps them in memory.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanContext, SpanKind, StatusCode

from rpcx.cli import main as cli_main
from rpcx.tracing.merge import TraceError
from rpcx.tracing.otel import ExportSummary, export_spans

BASE = 1_000_000_000  # the reference clock's reading at the start of the step
WALL = 1_764_240_000_000_000_000  # the Unix time of that reading
US = 1000

# worker -> (rank, skew: local clock minus reference clock, error bound of its sample)
WORKERS = {
    "trainer0": (0, 0, 0),
    "ps1": (1, 5_000_000_000, 20 * US),  # its monotonic clock runs 5 s ahead
}
THREADS = {"trainer0": {1001: "MainThread", 1002: "rpcx-trainer0-pool-0"},
           "ps1": {2001: "rpcx-ps1-pool-0", 2002: "MainThread"}}
# (worker, reference time in us after BASE, kind, thread, peer worker or None, call id, label)
EVENTS: list[tuple[str, int, str, int, str | None, int, str]] = [
    ("trainer0", 50, "instant", 1001, None, 0, "optimizer step"),
    # #1: a call that went well
    ("trainer0", 100, "send", 1001, "ps1", 1, "rpc_sync#mod.add"),
    ("ps1", 150, "arrive", 2001, "trainer0", 1, ""),
    ("ps1", 200, "serve_start", 2001, "trainer0", 1, "rpc_sync#mod.add"),
    ("ps1", 500, "serve_end", 2001, "trainer0", 1, ""),
    ("ps1", 550, "reply", 2001, "trainer0", 1, "ok"),
    ("trainer0", 600, "complete", 1001, "ps1", 1, "ok"),
    # #2: its function raised
    ("trainer0", 700, "send", 1001, "ps1", 2, "rpc_async#mod.fail"),
    ("ps1", 750, "serve_start", 2001, "trainer0", 2, "rpc_async#mod.fail"),
    ("ps1", 800, "serve_end", 2001, "trainer0", 2, ""),
    ("ps1", 820, "reply", 2001, "trainer0", 2, "error"),
    ("trainer0", 900, "complete", 1001, "ps1", 2, "error"),
    # #3: still in flight when the trace ended
    ("trainer0", 1000, "send", 1001, "ps1", 3, "rpc_sync#mod.slow"),
    ("ps1", 1050, "serve_start", 2001, "trainer0", 3, "rpc_sync#mod.slow"),
    # ps1's #4: its send fell out of ps1's ring
    ("trainer0", 1100, "serve_start", 1002, "ps1", 4, "remote#mod.make"),
    ("trainer0", 1200, "serve_end", 1002, "ps1", 4, ""),
    ("ps1", 1250, "complete", 2002, "trainer0", 4, "ok"),
    # #5: timed out, the callee never served it
    ("trainer0", 1300, "send", 1001, "ps1", 5, "rpc_sync#mod.lost"),
    ("trainer0", 1400, "complete", 1001, "ps1", 5, "timeout"),
    ("ps1", 1450, "instant", 2002, "trainer0", 0, "peer lost: trainer0"),
    ("trainer0", 1500, "instant", 1001, "ps1", 0, "sent AUTOGRAD_CHAIN"),
]


def wall(ref_us: int) -> int:
    """Where reference time ``ref_us`` (us after BASE) lands in Unix ns."""
    return WALL + ref_us * US


def write_world(directory: pathlib.Path,
                clock: dict[str, list[dict[str, int]]] | None = None) -> pathlib.Path:
    """One trace file per worker of the world above; ``clock`` replaces samples."""
    directory.mkdir(parents=True, exist_ok=True)
    for worker, (rank, skew, error) in WORKERS.items():
        def local(ref_us: int, skew: int = skew) -> int:
            return BASE + ref_us * US + skew

        samples = [{"at_ns": local(0), "offset_ns": -skew, "error_ns": error}]
        if clock is not None and worker in clock:
            samples = clock[worker]
        data = {
            "format": "rpcx-trace/1", "worker": worker, "rank": rank, "pid": 4000 + rank,
            "backend": "loopback", "host": "node3", "reference": "trainer0",
            "clock": samples,
            "wall": {"monotonic_ns": local(0), "unix_ns": WALL},
            "threads": {str(tid): name for tid, name in THREADS[worker].items()},
            "capacity": 100_000, "dropped": 1 if worker == "ps1" else 0,
            "events": [[local(t), kind, thread, WORKERS[peer][0] if peer else -1, call_id,
                        label]
                       for w, t, kind, thread, peer, call_id, label in EVENTS if w == worker],
        }
        (directory / f"{worker}.rpcx-trace.json").write_text(json.dumps(data))
    return directory


def export(directory: pathlib.Path, limits: SpanLimits | None = None,
           **kwargs: Any) -> tuple[ExportSummary, dict[str, ReadableSpan]]:
    """Export into a fresh in-memory provider: the summary and the spans by name."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(span_limits=limits, shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    summary = export_spans(directory, provider, **kwargs)
    spans = exporter.get_finished_spans()
    by_name = {s.name: s for s in spans}
    assert len(by_name) == len(spans), [s.name for s in spans]
    return summary, by_name


def context(span: ReadableSpan) -> SpanContext:
    ctx = span.get_span_context()
    assert ctx is not None
    return ctx


def span_id(span: ReadableSpan) -> int:
    return context(span).span_id


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_spans_and_their_tree(tmp_path: pathlib.Path) -> None:
    summary, spans = export(write_world(tmp_path))
    assert sorted(spans) == sorted([
        "rpcx trace", "rpcx worker trainer0", "rpcx worker ps1",
        "rpc_sync#mod.add", "serve rpc_sync#mod.add",
        "rpc_async#mod.fail", "serve rpc_async#mod.fail",
        "rpc_sync#mod.lost",  # timed out: a client span without a server span
    ])
    root, trainer0, ps1 = spans["rpcx trace"], spans["rpcx worker trainer0"], spans[
        "rpcx worker ps1"]
    client, server = spans["rpc_sync#mod.add"], spans["serve rpc_sync#mod.add"]
    assert client.kind is SpanKind.CLIENT and server.kind is SpanKind.SERVER
    assert root.kind is trainer0.kind is SpanKind.INTERNAL
    # One trace: root -> worker -> call -> its serve (on the callee's resource).
    trace_ids = {context(s).trace_id for s in spans.values()}
    assert len(trace_ids) == 1
    assert summary.trace_id == f"{trace_ids.pop():032x}"
    assert root.parent is None
    assert parent_id(trainer0) == parent_id(ps1) == span_id(root)
    assert parent_id(client) == span_id(trainer0)
    assert parent_id(server) == span_id(client)
    assert parent_id(spans["serve rpc_async#mod.fail"]) == span_id(spans["rpc_async#mod.fail"])
    assert summary == ExportSummary(
        workers=2, spans=8, calls=3, serves=2, instants=3, skipped_calls=2, errors=3,
        dropped_events=1, dropped_instants=0, trace_id=summary.trace_id)


def test_times_are_aligned_wall_clock(tmp_path: pathlib.Path) -> None:
    _, spans = export(write_world(tmp_path))
    client, server = spans["rpc_sync#mod.add"], spans["serve rpc_sync#mod.add"]
    # ps1's clock runs 5 s ahead; its sample says so, so its serve lands inside the call.
    assert (client.start_time, client.end_time) == (wall(100), wall(600))
    assert (server.start_time, server.end_time) == (wall(200), wall(500))
    # A worker's root covers its first to last event; the trace's covers them all.
    ps1 = spans["rpcx worker ps1"]
    assert (ps1.start_time, ps1.end_time) == (wall(150), wall(1450))
    assert (spans["rpcx trace"].start_time, spans["rpcx trace"].end_time) == (wall(50),
                                                                              wall(1500))


def test_attributes_and_resources(tmp_path: pathlib.Path) -> None:
    _, spans = export(write_world(tmp_path), service_name="trainer-job")
    client, server = spans["rpc_sync#mod.add"], spans["serve rpc_sync#mod.add"]
    assert dict(client.attributes or {}) == {
        "rpc.system": "rpcx", "rpc.method": "mod.add", "rpcx.api": "rpc_sync",
        "rpcx.caller": "trainer0", "rpcx.callee": "ps1", "rpcx.call_id": 1,
        "rpcx.outcome": "ok", "rpcx.clock_error_ns": 0,
        "thread.id": 1001, "thread.name": "MainThread"}
    assert dict(server.attributes or {}) == {
        **dict(client.attributes or {}), "rpcx.clock_error_ns": 20 * US,
        "thread.id": 2001, "thread.name": "rpcx-ps1-pool-0"}
    assert client.resource.attributes["service.name"] == "trainer-job"
    assert client.resource.attributes["rpcx.worker"] == "trainer0"
    assert server.resource.attributes["rpcx.worker"] == "ps1"
    assert server.resource.attributes["process.pid"] == 4001
    assert "rpcx.worker" not in spans["rpcx trace"].resource.attributes
    # The provider's own resource is kept underneath.
    assert "telemetry.sdk.name" in server.resource.attributes


def test_error_outcomes_set_error_status(tmp_path: pathlib.Path) -> None:
    _, spans = export(write_world(tmp_path))
    assert spans["rpc_sync#mod.add"].status.status_code is StatusCode.UNSET
    assert spans["serve rpc_sync#mod.add"].status.status_code is StatusCode.UNSET
    for name, why in [("rpc_async#mod.fail", "error"), ("serve rpc_async#mod.fail", "error"),
                      ("rpc_sync#mod.lost", "timeout")]:
        assert spans[name].status.status_code is StatusCode.ERROR, name
        assert spans[name].status.description == why
    assert (spans["serve rpc_async#mod.fail"].attributes or {})["rpcx.outcome"] == "error"


def test_instants_are_events_of_their_workers_root(tmp_path: pathlib.Path) -> None:
    _, spans = export(write_world(tmp_path))
    events = [(e.name, e.timestamp, dict(e.attributes or {}))
              for e in spans["rpcx worker trainer0"].events]
    assert events == [
        ("optimizer step", wall(50), {"thread.id": 1001, "thread.name": "MainThread"}),
        ("sent AUTOGRAD_CHAIN", wall(1500),
         {"thread.id": 1001, "thread.name": "MainThread", "rpcx.peer": "ps1"}),
    ]
    [lost] = spans["rpcx worker ps1"].events
    assert (lost.name, lost.timestamp) == ("peer lost: trainer0", wall(1450))
    # The SDK's span event limit drops instants; the summary says how many.
    summary, spans = export(write_world(tmp_path / "again"), SpanLimits(max_events=1))
    assert summary.instants == 3 and summary.dropped_instants == 1


def test_without_clock_samples_the_error_is_left_out(tmp_path: pathlib.Path) -> None:
    _, spans = export(write_world(tmp_path, clock={"ps1": []}))
    assert "rpcx.clock_error_ns" not in (spans["serve rpc_sync#mod.add"].attributes or {})
    assert "rpcx.clock_error_ns" in (spans["rpc_sync#mod.add"].attributes or {})


def test_global_provider_by_default(tmp_path: pathlib.Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import opentelemetry.trace

    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(opentelemetry.trace, "get_tracer_provider", lambda: provider)
    summary = export_spans(write_world(tmp_path))
    assert len(exporter.get_finished_spans()) == summary.spans == 8


def test_missing_sdk_or_input_is_a_clear_error(tmp_path: pathlib.Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TraceError, match="no \\*\\.rpcx-trace\\.json"):
        export_spans(tmp_path, TracerProvider(shutdown_on_exit=False))
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(ImportError, match="pip install opentelemetry-sdk"):
        export_spans(write_world(tmp_path / "w"))


# -- the command line ---------------------------------------------------------------------


def test_cli_prints_one_json_object_per_span(tmp_path: pathlib.Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["trace", "otel", str(write_world(tmp_path))]) == 0
    out, err = capsys.readouterr()
    spans = [json.loads(line) for line in out.splitlines()]
    assert len(spans) == 8
    by_name = {s["name"]: s for s in spans}
    client, server = by_name["rpc_sync#mod.add"], by_name["serve rpc_sync#mod.add"]
    assert (client["kind"], server["kind"]) == ("CLIENT", "SERVER")
    assert server["parent_id"] == client["span_id"]
    assert server["trace_id"] == client["trace_id"]
    assert (server["start_ns"], server["end_ns"]) == (wall(200), wall(500))
    assert by_name["rpc_sync#mod.lost"]["status"] == "ERROR"
    assert server["resource"]["rpcx.worker"] == "ps1"
    assert [e["name"] for e in by_name["rpcx worker ps1"]["events"]] == ["peer lost: trainer0"]
    [line] = err.splitlines()
    assert "2 workers, 3 calls, 2 serves, 3 instants, 2 incomplete calls skipped" in line
    assert f"trace {client['trace_id']}" in line


def test_cli_errors_are_one_line_exit_2(tmp_path: pathlib.Path,
                                        capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli_main(["trace", "otel", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("rpcx trace otel: ")
    world = str(write_world(tmp_path / "w"))
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                        None)
    assert cli_main(["trace", "otel", world, "--endpoint", "http://localhost:4317"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "pip install opentelemetry-exporter-otlp" in err
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    assert cli_main(["trace", "otel", world]) == 2
    assert "pip install opentelemetry-sdk" in capsys.readouterr().err
