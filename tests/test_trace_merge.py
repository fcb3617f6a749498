"""rpcx.tracing's offline side: reading trace files, aligning clocks, joining calls, the
merged Chrome trace, the plot and ``rpcx trace`` (docs/design/tracing.md).

Every trace here is synthetic: a small world is described on the reference clock and each
worker's file is written with its own monotonic clock skewed from it, as a real one is.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from rpcx.cli import main as cli_main
from rpcx.tracing.merge import (
    Call,
    ClockMap,
    ClockSample,
    TraceError,
    _assign_lanes,
    causality_violations,
    load_traces,
    match_calls,
    merge,
    write_merged,
)

BASE = 1_000_000_000  # the reference clock's reading at the start of the step
US = 1000

# worker -> (rank, skew: local clock minus reference clock, error bound of its samples)
WORKERS = {
    "trainer0": (0, 0, 0),
    "ps1": (1, 5_000_000_000, 20 * US),  # its monotonic clock runs 5 s ahead
    "ps2": (2, -3_000_000_000, 30 * US),  # and this one 3 s behind
}
THREADS = {
    "trainer0": {1001: "MainThread", 1002: "rpcx-trainer0-pool-0"},
    "ps1": {2001: "rpcx-ps1-pool-0", 2002: "MainThread"},
    "ps2": {3001: "rpcx-ps2-pool-0"},
}
# (worker, reference time in us after BASE, kind, thread, peer worker or None, call id, label)
EVENTS: list[tuple[str, int, str, int, str | None, int, str]] = [
    ("trainer0", 50, "instant", 1001, None, 0, "optimizer step"),
    # trainer0 -> ps1 #1
    ("trainer0", 100, "send", 1001, "ps1", 1, "rpc_sync#add"),
    ("ps1", 150, "arrive", 2001, "trainer0", 1, ""),
    ("ps1", 200, "serve_start", 2001, "trainer0", 1, "rpc_sync#add"),
    ("ps1", 500, "serve_end", 2001, "trainer0", 1, ""),
    ("ps1", 550, "reply", 2001, "trainer0", 1, "ok"),
    ("trainer0", 600, "complete", 1001, "ps1", 1, "ok"),
    # trainer0 -> ps2 #2
    ("trainer0", 700, "send", 1001, "ps2", 2, "rpc_async#mul"),
    ("ps2", 760, "arrive", 3001, "trainer0", 2, ""),
    ("ps2", 800, "serve_start", 3001, "trainer0", 2, "rpc_async#mul"),
    ("ps2", 1200, "serve_end", 3001, "trainer0", 2, ""),
    ("ps2", 1250, "reply", 3001, "trainer0", 2, "ok"),
    ("trainer0", 1300, "complete", 1001, "ps2", 2, "ok"),
    # ps1 -> trainer0 #1: the same call id as trainer0's first call, another caller
    ("ps1", 1400, "send", 2002, "trainer0", 1, "remote#make"),
    ("trainer0", 1450, "arrive", 1002, "ps1", 1, ""),
    ("trainer0", 1500, "serve_start", 1002, "ps1", 1, "remote#make"),
    ("trainer0", 1700, "serve_end", 1002, "ps1", 1, ""),
    ("trainer0", 1720, "reply", 1002, "ps1", 1, "ok"),
    ("ps1", 1800, "complete", 2002, "trainer0", 1, "ok"),
    # trainer0 -> trainer0 #3: a call to itself, both roles on one worker
    ("trainer0", 1900, "send", 1001, "trainer0", 3, "rpc_sync#local"),
    ("trainer0", 1910, "arrive", 1002, "trainer0", 3, ""),
    ("trainer0", 1920, "serve_start", 1002, "trainer0", 3, "rpc_sync#local"),
    ("trainer0", 1980, "serve_end", 1002, "trainer0", 3, ""),
    ("trainer0", 1990, "reply", 1002, "trainer0", 3, "ok"),
    ("trainer0", 2000, "complete", 1001, "trainer0", 3, "ok"),
]
# trainer0 -> ps2 #9 whose send fell out of trainer0's ring (it counts one dropped event).
DROPPED_CALL = [
    ("ps2", 2100, "arrive", 3001, "trainer0", 9, ""),
    ("ps2", 2150, "serve_start", 3001, "trainer0", 9, "rpc_sync#late"),
    ("ps2", 2300, "serve_end", 3001, "trainer0", 9, ""),
    ("ps2", 2320, "reply", 3001, "trainer0", 9, "ok"),
    ("trainer0", 2400, "complete", 1001, "ps2", 9, "ok"),
]
COMPLETE_CALLS = 4
ROWS = [  # workers by rank, a worker's threads by their first span
    "trainer0 / MainThread",
    "trainer0 / rpcx-trainer0-pool-0",
    "ps1 / rpcx-ps1-pool-0",
    "ps1 / MainThread",
    "ps2 / rpcx-ps2-pool-0",
]

# A world where calls are in flight together. trainer0's MainThread makes rpc_async calls
# A [100, 1000], B [200, 1200], C [300, 900] (inside A) and D [400, 1300], then a sync E
# [1400, 1600]: A, C and E nest on the thread's own track, B and D need a lane each. ps2's
# pool thread serves B [300, 1100] and D [500, 1250] (deferred results: they overlap).
# trainer0 also has a thread whose id is the first a lane would take (it must skip it).
ODD_TID = 0xFFFF_FFFF
LANE_THREADS = {
    "trainer0": {1001: "MainThread", ODD_TID: "rpcx-trainer0-pool-7"},
    "ps1": {2001: "rpcx-ps1-pool-0", 2002: "rpcx-ps1-pool-1"},
    "ps2": {3001: "rpcx-ps2-pool-0"},
}
LANE_EVENTS: list[tuple[str, int, str, int, str | None, int, str]] = [
    ("trainer0", 50, "instant", ODD_TID, None, 0, "optimizer step"),
    ("trainer0", 100, "send", 1001, "ps1", 11, "rpc_async#a"),
    ("trainer0", 200, "send", 1001, "ps2", 12, "rpc_async#b"),
    ("trainer0", 300, "send", 1001, "ps1", 13, "rpc_async#c"),
    ("trainer0", 400, "send", 1001, "ps2", 14, "rpc_async#d"),
    ("ps1", 200, "serve_start", 2001, "trainer0", 11, "rpc_async#a"),
    ("ps1", 800, "serve_end", 2001, "trainer0", 11, ""),
    ("ps2", 300, "serve_start", 3001, "trainer0", 12, "rpc_async#b"),
    ("ps2", 1100, "serve_end", 3001, "trainer0", 12, ""),
    ("ps1", 400, "serve_start", 2002, "trainer0", 13, "rpc_async#c"),
    ("ps1", 850, "serve_end", 2002, "trainer0", 13, ""),
    ("ps2", 500, "serve_start", 3001, "trainer0", 14, "rpc_async#d"),
    ("ps2", 1250, "serve_end", 3001, "trainer0", 14, ""),
    ("trainer0", 900, "complete", 1001, "ps1", 13, "ok"),
    ("trainer0", 1000, "complete", 1001, "ps1", 11, "ok"),
    ("trainer0", 1200, "complete", 1001, "ps2", 12, "ok"),
    ("trainer0", 1300, "complete", 1001, "ps2", 14, "ok"),
    ("trainer0", 1400, "send", 1001, "ps1", 15, "rpc_sync#e"),
    ("ps1", 1450, "serve_start", 2001, "trainer0", 15, "rpc_sync#e"),
    ("ps1", 1550, "serve_end", 2001, "trainer0", 15, ""),
    ("trainer0", 1600, "complete", 1001, "ps1", 15, "ok"),
]
LANE_ROWS = [
    "trainer0 / MainThread",
    "trainer0 / MainThread #1",
    "trainer0 / MainThread #2",
    "ps1 / rpcx-ps1-pool-0",
    "ps1 / rpcx-ps1-pool-1",
    "ps2 / rpcx-ps2-pool-0",
    "ps2 / rpcx-ps2-pool-0 #1",
]


def write_lane_world(directory: pathlib.Path) -> pathlib.Path:
    return write_world(directory, events=LANE_EVENTS, threads=LANE_THREADS)


def write_world(directory: pathlib.Path, *, dropped: bool = False,
                clock: dict[str, list[dict[str, int]]] | None = None,
                events: list[tuple[str, int, str, int, str | None, int, str]] | None = None,
                threads: dict[str, dict[int, str]] | None = None) -> pathlib.Path:
    """Write one trace file per worker of the world above (or of ``events`` and
    ``threads``); ``clock`` replaces samples."""
    directory.mkdir(parents=True, exist_ok=True)
    threads = THREADS if threads is None else threads
    events = (EVENTS if events is None else events) + (DROPPED_CALL if dropped else [])
    for worker, (rank, skew, error) in WORKERS.items():
        def local(ref_us: int, skew: int = skew) -> int:
            return BASE + ref_us * US + skew

        samples = [{"at_ns": local(0), "offset_ns": -skew, "error_ns": error}]
        if clock is not None and worker in clock:
            samples = clock[worker]
        mine = [[local(t), kind, thread, WORKERS[peer][0] if peer else -1, call_id, label]
                for w, t, kind, thread, peer, call_id, label in events if w == worker]
        data = {
            "format": "rpcx-trace/1", "worker": worker, "rank": rank, "pid": 4000 + rank,
            "backend": "loopback", "host": "node3", "reference": "trainer0",
            "clock": samples,
            "wall": {"monotonic_ns": local(0), "unix_ns": 1_764_240_000_000_000_000},
            "threads": {str(tid): name for tid, name in threads[worker].items()},
            "capacity": 100_000, "dropped": 1 if dropped and worker == "trainer0" else 0,
            "events": mine,
        }
        (directory / f"{worker}.rpcx-trace.json").write_text(json.dumps(data))
    return directory


def by_ph(merged: dict[str, Any], ph: str) -> list[dict[str, Any]]:
    return [e for e in merged["traceEvents"] if e["ph"] == ph]


def _track_spans(merged: dict[str, Any]) -> dict[tuple[int, int], list[tuple[int, int, str]]]:
    """(pid, tid) -> its X spans as (start ns, end ns, name), as a viewer reads them."""
    tracks: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    for e in by_ph(merged, "X"):
        start = round(e["ts"] * 1000)
        tracks.setdefault((e["pid"], e["tid"]), []).append(
            (start, start + round(e["dur"] * 1000), e["name"]))
    return tracks


def assert_well_nested(merged: dict[str, Any]) -> None:
    """Every two X spans of one thread track are disjoint (touching allowed) or one lies
    inside the other: Chrome and Perfetto drop or mangle slices that overlap otherwise."""
    for track, spans in _track_spans(merged).items():
        for i, (s0, e0, n0) in enumerate(spans):
            for s1, e1, n1 in spans[i + 1:]:
                disjoint = e0 <= s1 or e1 <= s0
                nested = (s0 <= s1 and e1 <= e0) or (s1 <= s0 and e0 <= e1)
                assert disjoint or nested, (
                    f"track {track}: {n0} [{s0}, {e0}] and {n1} [{s1}, {e1}] overlap")


def assert_flows_bound(merged: dict[str, Any], *, unbound: int = 0) -> None:
    """Every flow event lies (ends included) inside a span of its call's name on its own
    track, so the arrow attaches to that slice; ``unbound`` ends have no span drawn."""
    tracks = _track_spans(merged)
    loose = []
    for e in merged["traceEvents"]:
        if e["ph"] in ("s", "f"):
            t = round(e["ts"] * 1000)
            if not any(s <= t <= end and name == e["name"]
                       for s, end, name in tracks.get((e["pid"], e["tid"]), [])):
                loose.append(e)
    assert len(loose) == unbound, loose


# -- reading ------------------------------------------------------------------------------


def test_load_traces_in_rank_order(tmp_path: pathlib.Path) -> None:
    traces = load_traces(write_world(tmp_path))
    assert [(t.worker, t.rank) for t in traces] == [("trainer0", 0), ("ps1", 1), ("ps2", 2)]
    assert traces[1].threads == {2001: "rpcx-ps1-pool-0", 2002: "MainThread"}
    assert traces[1].clock == (ClockSample(BASE + 5_000_000_000, -5_000_000_000, 20 * US),)
    assert traces[0].events[0].kind == "instant"


def test_load_errors_name_the_file_or_directory(tmp_path: pathlib.Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match=r"empty: no \*\.rpcx-trace\.json"):
        load_traces(empty)
    world = write_world(tmp_path / "world")
    bad = world / "ps1.rpcx-trace.json"
    bad.write_text(json.dumps({**json.loads(bad.read_text()), "format": "rpcx-trace/2"}))
    with pytest.raises(TraceError, match=r"ps1\.rpcx-trace\.json: .*rpcx-trace/2"):
        load_traces(world)
    bad.write_text("{not json")
    with pytest.raises(TraceError, match=r"ps1\.rpcx-trace\.json: not JSON"):
        load_traces(world)
    world = write_world(tmp_path / "world2")
    bad = world / "ps2.rpcx-trace.json"
    data = json.loads(bad.read_text())
    data["events"][0] = data["events"][0][:5]
    bad.write_text(json.dumps(data))
    with pytest.raises(TraceError, match=r"ps2\.rpcx-trace\.json: events\[0\]"):
        load_traces(world)


# -- clocks -------------------------------------------------------------------------------


def test_clock_map_interpolates_between_samples() -> None:
    clock = ClockMap([ClockSample(3000, 1000, 7), ClockSample(1000, 0, 5)])
    assert clock.offset_at(2000) == 500
    assert clock.offset_at(2500) == 750
    assert clock.to_reference(2500) == 3250
    assert clock.offset_at(500) == 0  # before the first sample: the first holds
    assert clock.offset_at(9000) == 1000  # after the last: the last holds
    assert clock.error_ns == 7
    unknown = ClockMap([])
    assert unknown.to_reference(1234) == 1234
    assert unknown.error_ns is None


# -- calls and causality ------------------------------------------------------------------


def test_match_calls_joins_across_workers(tmp_path: pathlib.Path) -> None:
    calls = match_calls(load_traces(write_world(tmp_path)))
    assert [(c.caller, c.callee, c.call_id, c.label) for c in calls] == [
        ("trainer0", "ps1", 1, "rpc_sync#add"),
        ("trainer0", "ps2", 2, "rpc_async#mul"),
        ("ps1", "trainer0", 1, "remote#make"),
        ("trainer0", "trainer0", 3, "rpc_sync#local"),
    ]
    first = calls[0]
    # ps1's local times are 5 s ahead; on the reference clock they are where they happened.
    assert (first.send_ns, first.arrive_ns, first.serve_start_ns, first.serve_end_ns,
            first.reply_ns, first.complete_ns) == tuple(
        BASE + t * US for t in (100, 150, 200, 500, 550, 600))
    assert (first.caller_thread, first.callee_thread, first.outcome) == (1001, 2001, "ok")
    assert all(c.complete for c in calls)


def test_aligned_clocks_have_no_violations_unaligned_do(tmp_path: pathlib.Path) -> None:
    calls = match_calls(load_traces(write_world(tmp_path / "aligned")))
    assert causality_violations(calls) == []
    aligned = merge(tmp_path / "aligned")
    assert aligned["metadata"]["violations"] == []
    assert_well_nested(aligned)
    assert_flows_bound(aligned)
    # The same world without ps1's sample (offset 0, error unknown): ps1's serve is 5 s
    # late and the call it made returns 5 s before it was sent.
    unaligned = write_world(tmp_path / "unaligned", clock={"ps1": []})
    merged = merge(unaligned)
    lines = merged["metadata"]["violations"]
    assert_well_nested(merged)  # a worker's spans keep their order on any clock
    assert_flows_bound(merged)
    assert any(line.startswith("trainer0 -> ps1 #1 rpc_sync#add: completed") for line in lines)
    assert any(line.startswith("ps1 -> trainer0 #1 remote#make: serve started")
               and "before its send" in line for line in lines)
    assert not any("ps2" in line for line in lines)
    # Zeroed samples say the same.
    zeroed = write_world(tmp_path / "zeroed",
                         clock={"ps1": [{"at_ns": 0, "offset_ns": 0, "error_ns": 0}]})
    merged = merge(zeroed)
    assert merged["metadata"]["violations"] == lines
    assert_well_nested(merged)


def test_violations_allow_the_clock_error_bounds() -> None:
    def call(serve_start_us: int) -> Call:
        return Call(caller="a", callee="b", caller_rank=0, callee_rank=1, call_id=7,
                    label="rpc_sync#f", send_ns=1000 * US, arrive_ns=None,
                    serve_start_ns=serve_start_us * US, serve_end_ns=1200 * US,
                    reply_ns=None, complete_ns=1300 * US, caller_thread=1,
                    callee_thread=2)

    errors: dict[int, int | None] = {0: 0, 1: 50 * US}
    assert causality_violations([call(960)], errors) == []  # 40 us early, within 50
    assert causality_violations([call(880)], errors) == [
        "a -> b #7 rpc_sync#f: serve started 120 us before its send "
        "(clock error bound 50 us)"]
    assert causality_violations([call(880)]) == [
        "a -> b #7 rpc_sync#f: serve started 120 us before its send"]
    # A missing time is skipped: send is compared with the next recorded step.
    lost = Call(caller="a", callee="b", caller_rank=0, callee_rank=1, call_id=8,
                label="?", send_ns=None, arrive_ns=None, serve_start_ns=None,
                serve_end_ns=5, reply_ns=None, complete_ns=3, caller_thread=1,
                callee_thread=2)
    assert causality_violations([lost]) == ["a -> b #8 ?: completed 0 us before its serve end"]


# -- the merged trace ---------------------------------------------------------------------


def test_merged_trace_processes_threads_spans_flows(tmp_path: pathlib.Path) -> None:
    merged = merge(write_world(tmp_path))
    assert merged["displayTimeUnit"] == "ms"
    meta = {(e["name"], e["pid"], e["tid"]): e["args"] for e in by_ph(merged, "M")}
    assert {pid: meta[("process_name", pid, 0)]["name"] for pid in (0, 1, 2)} == {
        0: "trainer0", 1: "ps1", 2: "ps2"}
    assert meta[("process_sort_index", 2, 0)] == {"sort_index": 2}
    assert meta[("thread_name", 1, 2001)] == {"name": "rpcx-ps1-pool-0"}
    assert meta[("thread_name", 0, 1002)] == {"name": "rpcx-trainer0-pool-0"}
    # A worker's threads in the order they recorded; no lanes (nothing overlaps).
    assert [meta[("thread_sort_index", 1, tid)]["sort_index"] for tid in (2001, 2002)] == [
        0, 1]
    assert merged["metadata"]["lanes"] == []

    spans = by_ph(merged, "X")
    assert len(spans) == 2 * COMPLETE_CALLS
    # Times are us from the earliest event (the instant at +50 us), on the reference clock.
    call = next(s for s in spans if s["cat"] == "call" and s["args"]["callee"] == "ps1")
    serve = next(s for s in spans if s["cat"] == "serve" and s["pid"] == 1)
    assert (call["pid"], call["tid"], call["name"]) == (0, 1001, "rpc_sync#add")
    assert call["ts"] == pytest.approx(50.0) and call["dur"] == pytest.approx(500.0)
    assert (serve["tid"], serve["ts"], serve["dur"]) == (2001, pytest.approx(150.0),
                                                         pytest.approx(300.0))
    assert call["ts"] <= serve["ts"] and serve["ts"] + serve["dur"] <= call["ts"] + call["dur"]
    ps2 = next(s for s in spans if s["cat"] == "serve" and s["pid"] == 2)
    assert ps2["ts"] == pytest.approx(750.0)  # 3 s behind, put back
    assert all(0 <= e["ts"] <= 2000 for e in merged["traceEvents"] if e["ph"] != "M")

    starts, ends = by_ph(merged, "s"), by_ph(merged, "f")
    assert len(starts) == len(ends) == 2 * COMPLETE_CALLS
    assert len({e["id"] for e in starts}) == len(starts)
    assert all(e["cat"] == "rpc" and e["bp"] == "e" for e in ends)
    request = next(e for e in starts if e["pid"] == 0 and e["ts"] == pytest.approx(50.0))
    arrival = next(e for e in ends if e["id"] == request["id"])
    assert (arrival["pid"], arrival["tid"], arrival["ts"]) == (1, 2001, pytest.approx(150.0))

    [instant] = by_ph(merged, "i")
    assert (instant["name"], instant["s"], instant["ts"], instant["pid"]) == (
        "optimizer step", "t", 0.0, 0)
    clock = merged["metadata"]["clock"]
    assert clock["ps1"] == {"offset_ns": -5_000_000_000, "error_ns": 20 * US, "samples": 1}
    assert clock["trainer0"]["error_ns"] == 0
    assert_well_nested(merged)
    assert_flows_bound(merged)
    json.dumps(merged)  # serializable as is


def test_dropped_send_is_counted_not_fatal(tmp_path: pathlib.Path) -> None:
    world = write_world(tmp_path, dropped=True)
    calls = match_calls(load_traces(world))
    late = next(c for c in calls if c.call_id == 9)
    assert (late.caller, late.callee, late.label, late.send_ns) == (
        "trainer0", "ps2", "rpc_sync#late", None)
    assert not late.complete
    merged = merge(world)
    assert merged["metadata"]["dropped"] == {"trainer0": 1, "ps1": 0, "ps2": 0}
    assert merged["metadata"]["incomplete_calls"] == 1
    assert merged["metadata"]["violations"] == []
    # Its serve is drawn, and the reply's flow; the caller's span and the request's flow
    # are not (there is no send to start them).
    assert len(by_ph(merged, "X")) == 2 * COMPLETE_CALLS + 1
    assert len(by_ph(merged, "s")) == 2 * COMPLETE_CALLS + 1
    assert_well_nested(merged)
    assert_flows_bound(merged, unbound=1)  # the reply's arrow ends on a thread, not a span
    summary = write_merged(world, tmp_path / "out.json")
    assert (summary.calls, summary.incomplete_calls, summary.dropped) == (5, 1, 1)
    assert summary.worst_clock_error_ns == 30 * US


def test_assign_lanes_nests_or_moves_on() -> None:
    assert _assign_lanes([]) == []
    # Touching spans share a lane; a span inside the open one nests; equal spans nest.
    assert _assign_lanes([(0, 10), (10, 20), (12, 15), (12, 15)]) == [0, 0, 0, 0]
    # send A, send B, complete A, complete B: B cannot nest in A.
    assert _assign_lanes([(0, 10), (5, 15)]) == [0, 1]
    # Longer first at one start: the short one nests in the long one, whatever the order.
    assert _assign_lanes([(0, 5), (0, 20), (3, 25)]) == [0, 0, 1]
    # A lane's ended spans do not block it: (30, 40) goes back to lane 0.
    assert _assign_lanes([(0, 10), (5, 35), (30, 40)]) == [0, 1, 0]
    # The first lane that takes the span: (6, 9) fits inside lane 0's (0, 10).
    assert _assign_lanes([(0, 10), (5, 15), (6, 9)]) == [0, 1, 0]
    assert _assign_lanes([(5, 3)]) == [0]  # a negative duration counts as none


def test_calls_in_flight_get_lanes(tmp_path: pathlib.Path) -> None:
    merged = merge(write_lane_world(tmp_path))
    assert merged["metadata"]["violations"] == []
    assert_well_nested(merged)
    assert_flows_bound(merged)
    spans = {(s["cat"], s["name"]): s for s in by_ph(merged, "X")}
    tid = {name.split("#")[1]: spans[("call", name)]["tid"]
           for cat, name in spans if cat == "call"}
    # A, C and E nest on the thread's own track; B and D each need a lane of their own. Lane
    # ids go down from 2**32 - 1, skipping ODD_TID, a recorded thread.
    assert tid == {"a": 1001, "b": ODD_TID - 1, "c": 1001, "d": ODD_TID - 2, "e": 1001}
    assert len({s["tid"] for s in by_ph(merged, "X") if s["pid"] == 0}) >= 2
    # The callee too: ps2's pool thread serves B and D at once.
    assert spans[("serve", "rpc_async#b")]["tid"] == 3001
    assert spans[("serve", "rpc_async#d")]["tid"] == ODD_TID - 3
    meta = {(e["name"], e["pid"], e["tid"]): e["args"] for e in by_ph(merged, "M")}
    assert meta[("thread_name", 0, ODD_TID - 1)] == {
        "name": "MainThread (calls in flight, lane 1)"}
    assert meta[("thread_name", 0, ODD_TID - 2)] == {
        "name": "MainThread (calls in flight, lane 2)"}
    assert meta[("thread_name", 0, ODD_TID)] == {"name": "rpcx-trainer0-pool-7"}
    assert meta[("thread_name", 2, ODD_TID - 3)] == {
        "name": "rpcx-ps2-pool-0 (calls in flight, lane 1)"}
    # A thread's lanes sort right after it, before the worker's next thread.
    order = sorted((args["sort_index"], tid) for (name, pid, tid), args in meta.items()
                   if name == "thread_sort_index" and pid == 0)
    assert [t for _, t in order] == [1001, ODD_TID - 1, ODD_TID - 2, ODD_TID]
    assert merged["metadata"]["lanes"] == [
        {"worker": "trainer0", "pid": 0, "tid": ODD_TID - 1, "thread": 1001, "lane": 1},
        {"worker": "trainer0", "pid": 0, "tid": ODD_TID - 2, "thread": 1001, "lane": 2},
        {"worker": "ps2", "pid": 2, "tid": ODD_TID - 3, "thread": 3001, "lane": 1},
    ]
    # Each flow is on its own span's track, at the span's start or end: D's request leaves
    # D's lane and lands on D's serve lane, its reply the other way.
    d_call, d_serve = spans[("call", "rpc_async#d")], spans[("serve", "rpc_async#d")]
    flows = [e for e in merged["traceEvents"]
             if e["ph"] in ("s", "f") and e["name"] == "rpc_async#d"]
    assert sorted((e["ph"], e["pid"], e["tid"], e["ts"]) for e in flows) == sorted([
        ("s", 0, d_call["tid"], d_call["ts"]),
        ("f", 2, d_serve["tid"], d_serve["ts"]),
        ("s", 2, d_serve["tid"], d_serve["ts"] + d_serve["dur"]),
        ("f", 0, d_call["tid"], d_call["ts"] + d_call["dur"]),
    ])
    # The instant stays on its thread, which keeps its own id.
    [instant] = by_ph(merged, "i")
    assert (instant["pid"], instant["tid"]) == (0, ODD_TID)


# -- the command line ---------------------------------------------------------------------


def test_cli_merge(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "step.json"
    assert cli_main(["trace", "merge", str(write_world(tmp_path / "w")), "-o", str(out)]) == 0
    [line] = capsys.readouterr().out.splitlines()
    assert "3 workers, 4 calls" in line and "worst clock error 30.0 us" in line
    assert "0 causality violations" in line
    written = json.loads(out.read_text())
    assert len(written["traceEvents"]) > 0
    assert_well_nested(written)
    assert_flows_bound(written)


def test_cli_merge_violations_exit_1(tmp_path: pathlib.Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    world = write_world(tmp_path / "w", clock={"ps1": []})
    assert cli_main(["trace", "merge", str(world), "-o", str(tmp_path / "s.json")]) == 1
    assert_well_nested(json.loads((tmp_path / "s.json").read_text()))
    lines = capsys.readouterr().out.splitlines()
    assert "clock error unknown (no clock samples from ps1)" in lines[0]
    assert any("trainer0 -> ps1 #1 rpc_sync#add" in line for line in lines[1:])


def test_cli_errors_are_one_line(tmp_path: pathlib.Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["trace", "merge", str(tmp_path), "-o", str(tmp_path / "s.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith("rpcx trace merge: ") and str(tmp_path) in err
    assert cli_main(["trace", "plot", str(tmp_path), "-o", str(tmp_path / "s.png")]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1


# -- the plot -----------------------------------------------------------------------------


def assert_bar_in_every_row(summary: Any) -> None:
    """Each of the plot's rows has a bar drawn in it (PlotSummary's pixel geometry)."""
    from matplotlib.image import imread

    image = imread(str(summary.path))
    left, top, right, bottom = summary.plot_box
    assert 0 <= left < right <= image.shape[1] and 0 <= top < bottom <= image.shape[0]
    rgb = image[..., :3]
    # Bars are the only coloured things in the plot area (text, arrows, shading are grey).
    coloured = (rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.12
    assert len(summary.row_bands) == len(summary.rows)
    for row, (y0, y1) in zip(summary.rows, summary.row_bands, strict=True):
        assert top <= y0 < y1 <= bottom, row
        assert coloured[y0:y1, left:right].sum() > 20, f"no bar drawn in row {row!r}"
    assert coloured[top:bottom, left:right].mean() > 0.002  # not blank


def test_plot_shows_every_row(tmp_path: pathlib.Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    from rpcx.tracing.plot import plot_timeline

    world = write_world(tmp_path / "w")
    summary = plot_timeline(world, tmp_path / "step.png", title="a step")
    assert summary.rows == ROWS
    assert summary.spans == 2 * COMPLETE_CALLS and summary.arrows == 2 * COMPLETE_CALLS
    assert summary.instants == 1
    assert_bar_in_every_row(summary)
    # A merged trace file draws the same, and the command says what it drew.
    merged = tmp_path / "step.json"
    merged.write_text(json.dumps(merge(world)))
    assert_well_nested(json.loads(merged.read_text()))
    assert plot_timeline(merged, tmp_path / "again.png").rows == ROWS
    assert cli_main(["trace", "plot", str(world), "-o", str(tmp_path / "cli.png")]) == 0
    assert "5 rows (3 workers), 8 spans, 8 arrows, 1 instants" in capsys.readouterr().out


def test_plot_draws_lanes_as_rows(tmp_path: pathlib.Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    from rpcx.tracing.plot import plot_timeline

    world = write_lane_world(tmp_path / "w")
    summary = plot_timeline(world, tmp_path / "lanes.png")
    # Calls in flight together side by side, a thread's lanes right after it.
    assert summary.rows == LANE_ROWS
    assert summary.spans == 10 and summary.arrows == 10 and summary.instants == 1
    assert_bar_in_every_row(summary)
    # A merged trace file draws the same rows.
    merged = tmp_path / "lanes.json"
    merged.write_text(json.dumps(merge(world)))
    assert plot_timeline(merged, tmp_path / "again.png").rows == LANE_ROWS
    assert cli_main(["trace", "plot", str(world), "-o", str(tmp_path / "cli.png")]) == 0
    assert "7 rows (3 workers), 10 spans, 10 arrows" in capsys.readouterr().out
