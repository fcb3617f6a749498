"""Offline side of rpcx's timeline: read every worker's trace file, align clocks, join calls.

Everything here works on the files alone (docs/design/tracing.md, "The per-worker trace
file" and "The merged trace"), on a machine without a world: no torch, nothing from rpcx
outside ``rpcx.tracing``.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "FORMAT",
    "Call",
    "ClockMap",
    "ClockSample",
    "Summary",
    "TraceError",
    "TraceEvent",
    "WorkerTrace",
    "causality_violations",
    "load_traces",
    "match_calls",
    "merge",
    "merge_traces",
    "write_merged",
]

FORMAT = "rpcx-trace/1"
SUFFIX = ".rpcx-trace.json"

CALLER_KINDS = frozenset({"send", "complete"})
CALLEE_KINDS = frozenset({"arrive", "serve_start", "serve_end", "reply"})
KINDS = CALLER_KINDS | CALLEE_KINDS | {"instant"}


class TraceError(ValueError):
    """A trace directory or file that cannot be merged; the message names which."""


class ClockSample(NamedTuple):
    """One measurement of a worker's offset to the reference clock (at local ``at_ns``)."""

    at_ns: int
    offset_ns: int
    error_ns: int


class TraceEvent(NamedTuple):
    """One recorded event: ``[t_ns, kind, thread_id, peer_rank, call_id, label]``."""

    t_ns: int
    kind: str
    thread: int
    peer: int
    call_id: int
    label: str


@dataclass(frozen=True)
class WorkerTrace:
    """One worker's trace file, parsed and checked."""

    worker: str
    rank: int
    pid: int
    backend: str
    host: str
    reference: str
    clock: tuple[ClockSample, ...]
    wall_monotonic_ns: int
    wall_unix_ns: int
    threads: Mapping[int, str]
    capacity: int
    dropped: int
    events: tuple[TraceEvent, ...]
    path: pathlib.Path | None = None

    def thread_name(self, thread: int) -> str:
        """The recorded name of ``thread``, or a stand-in when the file has none."""
        return self.threads.get(thread, f"thread {thread}")


# -- reading ------------------------------------------------------------------------------


def _need(obj: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = obj.get(key)
    # bool is an int to isinstance; a true/false where a number belongs is malformed.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TraceError(f"{where}: {key!r} missing or not {kind.__name__}")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse(data: object, where: str) -> WorkerTrace:
    if not isinstance(data, dict):
        raise TraceError(f"{where}: not an rpcx trace (not a JSON object)")
    if data.get("format") != FORMAT:
        raise TraceError(f"{where}: not an rpcx trace (format {data.get('format')!r}, "
                         f"expected {FORMAT!r})")
    clock: list[ClockSample] = []
    for i, sample in enumerate(_need(data, "clock", list, where)):
        at = f"{where}: clock[{i}]"
        if not isinstance(sample, dict):
            raise TraceError(f"{at}: not an object")
        clock.append(ClockSample(_need(sample, "at_ns", int, at),
                                 _need(sample, "offset_ns", int, at),
                                 _need(sample, "error_ns", int, at)))
    wall = _need(data, "wall", dict, where)
    threads: dict[int, str] = {}
    for key, name in _need(data, "threads", dict, where).items():
        try:
            tid = int(key)
        except ValueError:
            raise TraceError(f"{where}: threads: key {key!r} is not a thread id") from None
        if not isinstance(name, str):
            raise TraceError(f"{where}: threads[{key!r}] is not a name")
        threads[tid] = name
    events: list[TraceEvent] = []
    for i, ev in enumerate(_need(data, "events", list, where)):
        if not (isinstance(ev, list) and len(ev) == 6 and _is_int(ev[0])
                and isinstance(ev[1], str) and _is_int(ev[2]) and _is_int(ev[3])
                and _is_int(ev[4]) and isinstance(ev[5], str)):
            raise TraceError(f"{where}: events[{i}] is not "
                             f"[t_ns, kind, thread_id, peer_rank, call_id, label]: {ev!r}")
        if ev[1] not in KINDS:
            raise TraceError(f"{where}: events[{i}]: unknown kind {ev[1]!r}")
        events.append(TraceEvent(*ev))
    return WorkerTrace(
        worker=_need(data, "worker", str, where),
        rank=_need(data, "rank", int, where),
        pid=_need(data, "pid", int, where),
        backend=_need(data, "backend", str, where),
        host=_need(data, "host", str, where),
        reference=_need(data, "reference", str, where),
        clock=tuple(sorted(clock)),
        wall_monotonic_ns=_need(wall, "monotonic_ns", int, f"{where}: wall"),
        wall_unix_ns=_need(wall, "unix_ns", int, f"{where}: wall"),
        threads=threads,
        capacity=_need(data, "capacity", int, where),
        dropped=_need(data, "dropped", int, where),
        events=tuple(events),
    )


def load_trace(path: str | os.PathLike[str]) -> WorkerTrace:
    """Read one ``<worker>.rpcx-trace.json``; :class:`TraceError` names it if it is bad."""
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: not JSON: {e}") from None
    trace = _parse(data, str(path))
    return dataclasses.replace(trace, path=path)


def load_traces(directory: str | os.PathLike[str]) -> list[WorkerTrace]:
    """Every ``*.rpcx-trace.json`` in ``directory``, in rank order."""
    root = pathlib.Path(directory)
    if not root.is_dir():
        raise TraceError(f"{root}: not a directory")
    paths = sorted(root.glob(f"*{SUFFIX}"))
    if not paths:
        raise TraceError(f"{root}: no *{SUFFIX} files")
    traces = [load_trace(p) for p in paths]
    by_rank: dict[int, WorkerTrace] = {}
    for t in traces:
        # pid = rank in the merged trace: two files of one rank would be one process there.
        if t.rank in by_rank:
            raise TraceError(f"{t.path}: rank {t.rank} is also {by_rank[t.rank].path}")
        by_rank[t.rank] = t
    return sorted(traces, key=lambda t: t.rank)


# -- clocks -------------------------------------------------------------------------------


class ClockMap:
    """A worker's local ``monotonic_ns`` to the reference worker's clock.

    The offset is interpolated linearly between samples (by ``at_ns``); before the first
    or after the last the nearest sample holds. With no samples the offset is 0 and the
    error unknown (``error_ns`` is None).
    """

    def __init__(self, samples: Iterable[ClockSample]) -> None:
        self._samples = tuple(sorted(samples))
        self._ats = [s.at_ns for s in self._samples]

    @property
    def samples(self) -> tuple[ClockSample, ...]:
        """The samples, by ``at_ns``."""
        return self._samples

    @property
    def error_ns(self) -> int | None:
        """The worst error bound of the samples; None when there are none."""
        return max((s.error_ns for s in self._samples), default=None)

    def offset_at(self, t_ns: int) -> int:
        """The offset (reference minus local) at local time ``t_ns``."""
        if not self._samples:
            return 0
        i = bisect.bisect_right(self._ats, t_ns)
        if i == 0:
            return self._samples[0].offset_ns
        if i == len(self._samples):
            return self._samples[-1].offset_ns
        a, b = self._samples[i - 1], self._samples[i]  # a.at_ns <= t_ns < b.at_ns
        num = (b.offset_ns - a.offset_ns) * (t_ns - a.at_ns)
        span = b.at_ns - a.at_ns
        return a.offset_ns + (2 * num + span) // (2 * span)  # exact, rounded to nearest ns

    def to_reference(self, t_ns: int) -> int:
        """Local ``t_ns`` as reference-clock ns."""
        return t_ns + self.offset_at(t_ns)


# -- calls --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One call joined across its two workers; times are reference-clock ns or None."""

    caller: str
    callee: str
    caller_rank: int
    callee_rank: int
    call_id: int
    label: str
    send_ns: int | None
    arrive_ns: int | None
    serve_start_ns: int | None
    serve_end_ns: int | None
    reply_ns: int | None
    complete_ns: int | None
    caller_thread: int | None
    callee_thread: int | None
    outcome: str | None = None  # the complete's label: ok, error, timeout, lost
    reply_label: str | None = None

    @property
    def name(self) -> str:
        """How messages name the call: ``caller -> callee #id label``."""
        return f"{self.caller} -> {self.callee} #{self.call_id} {self.label}"

    @property
    def complete(self) -> bool:
        """Whether all four of send, serve start, serve end and complete were recorded."""
        return None not in (self.send_ns, self.serve_start_ns, self.serve_end_ns,
                            self.complete_ns)


def _worker_names(traces: Sequence[WorkerTrace]) -> dict[int, str]:
    return {t.rank: t.worker for t in traces}


def match_calls(traces: Sequence[WorkerTrace]) -> list[Call]:
    """Join each call's events across workers by ``(caller rank, call id)``."""
    names = _worker_names(traces)
    # key -> kind -> (reference ns, thread, peer, label); the first of a kind wins, since a
    # repeat (a retransmitted frame, say) does not move when the call happened.
    parts: dict[tuple[int, int], dict[str, tuple[int, int, int, str]]] = {}
    for trace in traces:
        clock = ClockMap(trace.clock)
        for ev in trace.events:
            if ev.kind in CALLER_KINDS:
                key = (trace.rank, ev.call_id)
                peer = ev.peer  # the callee
            elif ev.kind in CALLEE_KINDS:
                key = (ev.peer, ev.call_id)
                peer = trace.rank  # the callee is this worker
            else:
                continue
            parts.setdefault(key, {}).setdefault(
                ev.kind, (clock.to_reference(ev.t_ns), ev.thread, peer, ev.label))
    calls: list[Call] = []
    for (caller_rank, call_id), kinds in parts.items():

        def t(kind: str, kinds: dict[str, tuple[int, int, int, str]] = kinds) -> int | None:
            return kinds[kind][0] if kind in kinds else None

        first = kinds.get("send") or kinds.get("complete")
        callee_rank = first[2] if first else next(iter(kinds.values()))[2]
        label = next((kinds[k][3] for k in ("send", "serve_start") if k in kinds), "?")
        serve = kinds.get("serve_start") or kinds.get("serve_end")
        calls.append(Call(
            caller=names.get(caller_rank, f"rank {caller_rank}"),
            callee=names.get(callee_rank, f"rank {callee_rank}"),
            caller_rank=caller_rank, callee_rank=callee_rank, call_id=call_id, label=label,
            send_ns=t("send"), arrive_ns=t("arrive"), serve_start_ns=t("serve_start"),
            serve_end_ns=t("serve_end"), reply_ns=t("reply"), complete_ns=t("complete"),
            caller_thread=first[1] if first else None,
            callee_thread=serve[1] if serve else None,
            outcome=kinds["complete"][3] if "complete" in kinds else None,
            reply_label=kinds["reply"][3] if "reply" in kinds else None,
        ))
    calls.sort(key=lambda c: (min(x for x in (c.send_ns, c.arrive_ns, c.serve_start_ns,
                                              c.serve_end_ns, c.reply_ns, c.complete_ns)
                                  if x is not None), c.caller_rank, c.call_id))
    return calls


def _us(ns: float) -> str:
    return f"{round(ns / 1000, 1):g}"


# (attribute, its role in the call, what it says happening, how it is named as earlier)
_CHAIN = (
    ("send_ns", "caller", "sent", "its send"),
    ("serve_start_ns", "callee", "serve started", "its serve start"),
    ("serve_end_ns", "callee", "serve ended", "its serve end"),
    ("complete_ns", "caller", "completed", "its completion"),
)


def causality_violations(calls: Iterable[Call],
                         errors: Mapping[int, int | None] | None = None) -> list[str]:
    """One line per call whose times break send <= serve start <= serve end <= complete.

    ``errors`` maps a rank to its clock error bound (ns; None or absent counts as 0);
    two times from different workers may be out of order by the sum of their bounds.
    A missing time is skipped (the check goes on to the next recorded one).
    """
    errors = errors or {}
    out: list[str] = []
    for call in calls:
        present = [(getattr(call, attr), role, verb, noun) for attr, role, verb, noun in _CHAIN
                   if getattr(call, attr) is not None]
        for (t0, role0, _, noun0), (t1, role1, verb1, _) in itertools.pairwise(present):
            rank0 = call.caller_rank if role0 == "caller" else call.callee_rank
            rank1 = call.caller_rank if role1 == "caller" else call.callee_rank
            slack = 0 if rank0 == rank1 else (errors.get(rank0) or 0) + (errors.get(rank1) or 0)
            if t1 < t0 - slack:
                allowed = f" (clock error bound {_us(slack)} us)" if slack else ""
                out.append(f"{call.name}: {verb1} {_us(t0 - t1)} us before {noun0}{allowed}")
    return out


# -- the merged trace ---------------------------------------------------------------------


# Extra lanes' thread ids are taken downwards from here, skipping every recorded thread id:
# the largest a viewer takes (Perfetto reads a tid as an unsigned 32-bit number).
LANE_TID_TOP = 0xFFFF_FFFF


def _assign_lanes(spans: Sequence[tuple[int, int]]) -> list[int]:
    """The lane of each ``(start, end)`` span of one thread, so a lane's spans nest.

    Greedy, by start and then longer first: a span goes to the first lane where it starts
    after the lane's last span ended or lies wholly inside the lane's innermost open span
    (a stack per lane); a new lane when none takes it. Touching spans count as disjoint.
    """
    order = sorted(range(len(spans)), key=lambda i: (spans[i][0], spans[i][0] - spans[i][1]))
    stacks: list[list[int]] = []  # per lane, the ends of its open spans, innermost last
    lanes = [0] * len(spans)
    for i in order:
        start, end = spans[i][0], max(spans[i])  # a negative duration counts as none
        lane = 0
        while lane < len(stacks):
            stack = stacks[lane]
            while stack and stack[-1] <= start:  # ended: later spans start later still
                stack.pop()
            if not stack or end <= stack[-1]:
                break
            lane += 1
        else:
            stacks.append([])
        stacks[lane].append(end)
        lanes[i] = lane
    return lanes


def _lane_tids(lanes: Iterable[tuple[int, int, int]],
               taken: Set[int]) -> dict[tuple[int, int, int], int]:
    """A thread id for each ``(pid, thread, lane)`` of ``lanes`` (lane 1 and up), from
    :data:`LANE_TID_TOP` downwards in the order given, skipping the ids in ``taken`` (every
    recorded thread id, of any worker): so one cannot collide with a thread's own."""
    out: dict[tuple[int, int, int], int] = {}
    tid = LANE_TID_TOP
    for key in lanes:
        while tid in taken:
            tid -= 1
        out[key] = tid
        tid -= 1
    return out


@dataclass(frozen=True)
class Summary:
    """What :func:`write_merged` wrote."""

    path: pathlib.Path
    workers: int
    calls: int
    incomplete_calls: int
    spans: int
    flows: int
    instants: int
    dropped: int
    violations: tuple[str, ...]
    worst_clock_error_ns: int | None  # None when a worker has no clock samples
    unaligned: tuple[str, ...]  # the workers without clock samples


def merge_traces(traces: Sequence[WorkerTrace]) -> dict[str, Any]:
    """The Chrome trace (JSON object format) of ``traces`` on the reference clock."""
    clocks = {t.rank: ClockMap(t.clock) for t in traces}
    errors = {rank: c.error_ns for rank, c in clocks.items()}
    names = _worker_names(traces)
    calls = match_calls(traces)
    refs = [clocks[t.rank].to_reference(ev.t_ns) for t in traces for ev in t.events]
    origin = min(refs, default=0)

    def us(ref_ns: int) -> float:
        return (ref_ns - origin) / 1000

    # The spans first: a thread's spans go to lanes (their own thread ids) so that each
    # thread track holds properly nested slices, as the viewers require; a caller's
    # rpc_async calls in flight together overlap without nesting.
    events: list[dict[str, Any]] = []
    spans: list[tuple[int, int, int, int, dict[str, Any]]] = []  # pid, thread, start, end
    call_span: dict[int, dict[str, Any]] = {}  # index in calls -> the caller's span
    serve_span: dict[int, dict[str, Any]] = {}  # index in calls -> the callee's span
    for i, c in enumerate(calls):
        if c.send_ns is not None and c.complete_ns is not None and c.caller_thread is not None:
            span = {"ph": "X", "name": c.label, "cat": "call", "pid": c.caller_rank,
                    "tid": c.caller_thread, "ts": us(c.send_ns),
                    "dur": (c.complete_ns - c.send_ns) / 1000,
                    "args": {"call_id": c.call_id, "callee": c.callee, "outcome": c.outcome}}
            spans.append((c.caller_rank, c.caller_thread, c.send_ns, c.complete_ns, span))
            call_span[i] = span
        if (c.callee_thread is not None and c.serve_start_ns is not None
                and c.serve_end_ns is not None):
            args: dict[str, object] = {"call_id": c.call_id, "caller": c.caller,
                                       "reply": c.reply_label}
            if c.arrive_ns is not None:
                args["queued_us"] = (c.serve_start_ns - c.arrive_ns) / 1000
            span = {"ph": "X", "name": c.label, "cat": "serve", "pid": c.callee_rank,
                    "tid": c.callee_thread, "ts": us(c.serve_start_ns),
                    "dur": (c.serve_end_ns - c.serve_start_ns) / 1000, "args": args}
            spans.append((c.callee_rank, c.callee_thread, c.serve_start_ns, c.serve_end_ns,
                          span))
            serve_span[i] = span
    by_thread: dict[tuple[int, int], list[int]] = {}  # (pid, thread) -> indices in spans
    for k, (pid, thread, *_) in enumerate(spans):
        by_thread.setdefault((pid, thread), []).append(k)
    span_lane = [0] * len(spans)
    lane_count: dict[tuple[int, int], int] = {}
    for key, ks in by_thread.items():
        lanes = _assign_lanes([(spans[k][2], spans[k][3]) for k in ks])
        lane_count[key] = max(lanes) + 1
        for k, lane in zip(ks, lanes, strict=True):
            span_lane[k] = lane
    thread_order = {t.rank: list(dict.fromkeys([*t.threads, *(ev.thread for ev in t.events)]))
                    for t in traces}
    tracks = [(t.rank, tid) for t in traces for tid in thread_order[t.rank]]
    tracks += sorted(set(lane_count) - set(tracks))  # a span on a thread of no file
    lane_tid = _lane_tids([(pid, tid, lane) for pid, tid in tracks
                           for lane in range(1, lane_count.get((pid, tid), 1))],
                          {tid for _, tid in tracks})
    for k, (pid, thread, _, _, span) in enumerate(spans):
        if span_lane[k]:
            span["tid"] = lane_tid[(pid, thread, span_lane[k])]
        events.append(span)

    meta: list[dict[str, Any]] = []
    lanes_meta: list[dict[str, Any]] = []
    for t in traces:
        meta.append({"ph": "M", "name": "process_name", "pid": t.rank, "tid": 0,
                     "args": {"name": t.worker}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": t.rank, "tid": 0,
                     "args": {"sort_index": t.rank}})
        meta.append({"ph": "M", "name": "process_labels", "pid": t.rank, "tid": 0,
                     "args": {"labels": f"{t.host} pid {t.pid} {t.backend}"}})
        sort_index = 0  # a worker's threads in the order they first recorded, lanes after
        for tid in thread_order[t.rank]:
            meta.append({"ph": "M", "name": "thread_name", "pid": t.rank, "tid": tid,
                         "args": {"name": t.thread_name(tid)}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": t.rank, "tid": tid,
                         "args": {"sort_index": sort_index}})
            sort_index += 1
            for lane in range(1, lane_count.get((t.rank, tid), 1)):
                extra = lane_tid[(t.rank, tid, lane)]
                name = f"{t.thread_name(tid)} (calls in flight, lane {lane})"
                meta.append({"ph": "M", "name": "thread_name", "pid": t.rank, "tid": extra,
                             "args": {"name": name}})
                meta.append({"ph": "M", "name": "thread_sort_index", "pid": t.rank,
                             "tid": extra, "args": {"sort_index": sort_index}})
                sort_index += 1
                lanes_meta.append({"worker": t.worker, "pid": t.rank, "tid": extra,
                                   "thread": tid, "lane": lane})
        for ev in t.events:
            if ev.kind == "instant":
                peer = {} if ev.peer < 0 else {"peer": names.get(ev.peer, f"rank {ev.peer}")}
                events.append({"ph": "i", "s": "t", "name": ev.label, "cat": "rpcx",
                               "pid": t.rank, "tid": ev.thread,
                               "ts": us(clocks[t.rank].to_reference(ev.t_ns)), "args": peer})
    flow_id = 0

    def flow(name: str, src: tuple[int, int, int], dst: tuple[int, int, int]) -> None:
        nonlocal flow_id
        flow_id += 1
        events.append({"ph": "s", "id": flow_id, "cat": "rpc", "name": name,
                       "pid": src[0], "tid": src[1], "ts": us(src[2])})
        events.append({"ph": "f", "bp": "e", "id": flow_id, "cat": "rpc", "name": name,
                       "pid": dst[0], "tid": dst[1], "ts": us(dst[2])})

    for i, c in enumerate(calls):
        if c.caller_thread is None or c.callee_thread is None:
            continue
        # A flow's ends go on the track (lane) of the span they bind to, if it was drawn.
        caller_tid = call_span[i]["tid"] if i in call_span else c.caller_thread
        callee_tid = serve_span[i]["tid"] if i in serve_span else c.callee_thread
        if c.send_ns is not None and c.serve_start_ns is not None:
            flow(c.label, (c.caller_rank, caller_tid, c.send_ns),
                 (c.callee_rank, callee_tid, c.serve_start_ns))
        if c.serve_end_ns is not None and c.complete_ns is not None:
            flow(c.label, (c.callee_rank, callee_tid, c.serve_end_ns),
                 (c.caller_rank, caller_tid, c.complete_ns))
    events.sort(key=lambda e: float(e["ts"]))

    ref_trace = next((t for t in traces if t.worker == t.reference),
                     traces[0] if traces else None)
    origin_unix = None
    if ref_trace is not None:
        wall_ref = clocks[ref_trace.rank].to_reference(ref_trace.wall_monotonic_ns)
        origin_unix = ref_trace.wall_unix_ns + (origin - wall_ref)
    clock_meta: dict[str, Any] = {}
    for t in traces:
        clock = clocks[t.rank]
        if t.events:  # the offset in effect mid-trace; samples give the rest
            mid = (min(ev.t_ns for ev in t.events) + max(ev.t_ns for ev in t.events)) // 2
        else:
            mid = t.wall_monotonic_ns
        clock_meta[t.worker] = {"offset_ns": clock.offset_at(mid), "error_ns": clock.error_ns,
                                "samples": len(clock.samples)}
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "metadata": {
            "format": f"{FORMAT} merged",
            "reference": ref_trace.reference if ref_trace else None,
            "origin_ns": origin,
            "origin_unix_ns": origin_unix,
            "workers": {t.worker: {"rank": t.rank, "host": t.host, "pid": t.pid,
                                   "backend": t.backend} for t in traces},
            "clock": clock_meta,
            "dropped": {t.worker: t.dropped for t in traces},
            "calls": len(calls),
            "incomplete_calls": sum(not c.complete for c in calls),
            "violations": causality_violations(calls, errors),
            "lanes": lanes_meta,
        },
    }


def merge(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The merged Chrome trace of every worker's trace file in ``directory``."""
    return merge_traces(load_traces(directory))


def summarize(merged: Mapping[str, Any], path: str | os.PathLike[str]) -> Summary:
    """Counts of a merged trace (as :func:`merge` returns it)."""
    meta = merged["metadata"]
    phases = [e["ph"] for e in merged["traceEvents"]]
    clock = meta["clock"]
    unaligned = tuple(w for w, c in clock.items() if c["error_ns"] is None)
    errors = [c["error_ns"] for c in clock.values() if c["error_ns"] is not None]
    return Summary(
        path=pathlib.Path(path),
        workers=len(clock),
        calls=meta["calls"],
        incomplete_calls=meta["incomplete_calls"],
        spans=phases.count("X"),
        flows=phases.count("s"),
        instants=phases.count("i"),
        dropped=sum(meta["dropped"].values()),
        violations=tuple(meta["violations"]),
        worst_clock_error_ns=None if unaligned else max(errors, default=0),
        unaligned=unaligned,
    )


def write_merged(directory: str | os.PathLike[str],
                 out_path: str | os.PathLike[str]) -> Summary:
    """Merge ``directory``'s trace files into the Chrome trace ``out_path``."""
    merged = merge(directory)
    out = pathlib.Path(out_path)
    try:
        out.write_text(json.dumps(merged, separators=(",", ":")), encoding="utf-8")
    except OSError as e:
        raise TraceError(f"{out}: cannot write: {e}") from None
    return summarize(merged, out)
