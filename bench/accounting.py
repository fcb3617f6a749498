"""Per-step accounting of a training step: what each process does for one step.

For one training step of the RPC tutorial's distributed RNN (``rnn``: a trainer and a
parameter server; see ``rnn_model.py``) and of the DDP + RPC hybrid (``hybrid``: two
DDP trainers, the master and the parameter server; see ``hybrid.py``), on torch and on
each rpcx backend, per process and per step:

* **frames sent, bytes sent** (rpcx only): every frame rpcx's agent hands to its
  transport (the ``transmit_frame`` its ``CallPath`` is built with, wrapped in each
  worker process, as ``profile_rtt.py`` wraps the call path; nothing in the library
  changes), its size (header and tensors) and its message kind. torch's agent counts no messages:
  ``_get_current_rpc_agent().get_debug_info()`` gives thread and active-call gauges
  only (kept in the JSON), so its column shows ``n/a`` and the transport-neutral rows
  below are the comparison;
* **write / read calls and bytes** (``/proc/<pid>/io``: ``syscw``, ``syscr``, ``wchar``,
  ``rchar``). These count ``write``/``read``-type calls (eventfd and pipe writes
  included) but not ``sendmsg``/``recvmsg``, and not bytes moved through shared
  memory: read them as what each transport does through those calls, not as its
  messages (see ``procstat.py``);
* **thread wake-ups**: the sum over the process's threads of voluntary and involuntary
  context switches (``/proc/<pid>/task/*/status``);
* **CPU time**: ``utime + stime`` from ``/proc/<pid>/stat`` (10 ms ticks: over N steps,
  a resolution of 10/N ms), and the threads' nanosecond clock (``schedstat``) beside it;
* **wall time** per step, on the process that drives the steps.

Counters are read at the two ends of N steps after ``--warmup`` steps, by the process
that drives them (the RNN's trainer; in the hybrid, ``trainer0`` after a ``dist.barrier``
with ``trainer1``, whose gloo traffic is in the window once) reading every process's
/proc files and counter file; nothing is sent to read them. Figures are the deltas
divided by N (medians over ``--rounds``). Workers whose processes are one (loopback)
cannot be told apart and are refused. Output: the table on stdout (markdown),
``bench/results/<stamp>-accounting.json``. Usage::

    python bench/accounting.py [--systems torch,shm] [--steps 50] [--warmup 10]
                               [--only rnn,hybrid] [--rounds 1]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import inspect
import mmap
import os
import pathlib
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import hybrid
import machine
import placement
import procstat
import report
import rnn_model
import systems
import torch
import torch.distributed as dist
from world import Recorder, WorldSpec, run_world

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
WORKLOADS = ("rnn", "hybrid")
BUDGET_S = 240.0
ROLES = {
    "rnn": ("trainer", "ps"),
    "hybrid": ("trainer0", "trainer1", "master", "ps"),
}

# ----------------------------------------------------------------- rpcx frame counter

N_KINDS = 32  # rpcx.messages.MessageKind values are small; larger ones go to slot 0
_SLOTS = 2 + 2 * N_KINDS  # frames, bytes, frames by kind, bytes by kind
_LAYOUT = struct.Struct(f"<{_SLOTS}q")


def _counter_path(directory: str, rank: int) -> pathlib.Path:
    return pathlib.Path(directory) / f"frames{rank}.bin"


class FrameCounter:
    """Counts the frames this process's rpcx agent sends, in a file others can read.

    The counts live in a small memory-mapped file in the world's temporary directory,
    rewritten after every frame, so the driving process reads them without a message.
    """

    def __init__(self, path: pathlib.Path) -> None:
        path.write_bytes(bytes(_LAYOUT.size))
        self._file = path.open("r+b")
        self._map = mmap.mmap(self._file.fileno(), _LAYOUT.size)
        self._counts = [0] * _SLOTS
        self._lock = threading.Lock()

    def add(self, kind: int, nbytes: int) -> None:
        slot = kind if 0 < kind < N_KINDS else 0
        with self._lock:
            counts = self._counts
            counts[0] += 1
            counts[1] += nbytes
            counts[2 + slot] += 1
            counts[2 + N_KINDS + slot] += nbytes
            _LAYOUT.pack_into(self._map, 0, *counts)

    def install(self) -> bool:
        """Count what rpcx's call path hands its transport; False if this rpcx has no
        ``CallPath`` taking a ``transmit_frame``.

        ``CallPath.__init__`` is wrapped so that the ``transmit_frame`` it is given (the
        transport's ``send``, sealed first with a world key) counts each frame: every
        frame to another worker passes there, whichever of the call path's routes sent
        it (requests, replies, one-way messages).
        """
        try:
            from rpcx._core.call_path import CallPath
            from rpcx._wire.codec import decode_envelope
        except ImportError:
            return False
        original_init = CallPath.__init__
        if "transmit_frame" not in inspect.signature(original_init).parameters:
            return False
        counter = self

        def counting(transmit: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
            def transmit_frame(dst: int, frame: Any) -> None:
                counter.add(decode_envelope(frame)[0], frame.nbytes)
                transmit(dst, frame)
            return transmit_frame

        @functools.wraps(original_init)
        def __init__(path: Any, *args: Any, **kwargs: Any) -> None:
            bound = inspect.signature(original_init).bind(path, *args, **kwargs)
            bound.arguments["transmit_frame"] = counting(bound.arguments["transmit_frame"])
            original_init(*bound.args, **bound.kwargs)

        CallPath.__init__ = __init__  # type: ignore[method-assign]
        return True


def read_counts(path: pathlib.Path) -> dict[str, Any] | None:
    """A counter file's counts, or ``None`` where the process keeps none (torch)."""
    try:
        values = _LAYOUT.unpack(path.read_bytes()[:_LAYOUT.size])
    except (OSError, struct.error):
        return None
    return {"frames": values[0], "bytes": values[1],
            "frames_by_kind": list(values[2:2 + N_KINDS]),
            "bytes_by_kind": list(values[2 + N_KINDS:])}


def _count_delta(before: dict[str, Any] | None, after: dict[str, Any] | None
                 ) -> dict[str, Any] | None:
    if before is None or after is None:
        return None
    return {
        "frames": after["frames"] - before["frames"],
        "bytes": after["bytes"] - before["bytes"],
        "frames_by_kind": [a - b for a, b in zip(after["frames_by_kind"],
                                                 before["frames_by_kind"], strict=True)],
        "bytes_by_kind": [a - b for a, b in zip(after["bytes_by_kind"],
                                                before["bytes_by_kind"], strict=True)],
    }


def world_dir(init_method: str) -> str:
    """The world's temporary directory (its rendezvous is ``file://<dir>/rendezvous``)."""
    return os.path.dirname(init_method.removeprefix("file://"))


def start_counting(system: str, init_method: str, rank: int) -> bool:
    """In a worker, before ``init_rpc``: count its frames (rpcx systems only)."""
    if system == systems.BASELINE:
        return False
    return FrameCounter(_counter_path(world_dir(init_method), rank)).install()


# ------------------------------------------------------------------------ the window


class Window:
    """The counters of every process of a world, read at the two ends of N steps."""

    def __init__(self, ns: SimpleNamespace, pids: dict[str, int], ranks: dict[str, int],
                 directory: str) -> None:
        self.ns = ns
        self.pids = pids
        self.files = {role: _counter_path(directory, rank) for role, rank in ranks.items()}
        self.me = next(role for role, pid in pids.items() if pid == os.getpid())
        self._before: dict[str, Any] = {}
        self._after: dict[str, Any] = {}
        self._t0 = self._t1 = 0.0
        self.debug: dict[str, Any] = {}

    def _read(self, start: bool) -> dict[str, Any]:
        # Our own process last on the way in, first on the way out, so that reading the
        # others' files falls outside our own window.
        others = [r for r in self.pids if r != self.me]
        order = [*others, self.me] if start else [self.me, *others]
        out = {}
        for role in order:
            if start:  # the counter file first: reading it is a read too
                frames = read_counts(self.files[role])
                proc = procstat.snapshot(self.pids[role], io_last=True)
            else:
                proc = procstat.snapshot(self.pids[role], io_last=False)
                frames = read_counts(self.files[role])
            out[role] = {"proc": proc, "frames": frames}
        return out

    def _debug_info(self) -> dict[str, Any]:
        if self.ns.system == systems.BASELINE:
            from torch.distributed.rpc import api as torch_api

            return dict(torch_api._get_current_rpc_agent().get_debug_info())
        return dict(self.ns.rpc.debug_info())

    def mark(self, where: str) -> None:
        """``"start"``: read everything, then start the clock; ``"end"``: the reverse."""
        if where == "start":
            self.debug["start"] = self._debug_info()
            self._before = self._read(start=True)
            self._t0 = time.perf_counter()
        else:
            self._t1 = time.perf_counter()
            self._after = self._read(start=False)
            self.debug["end"] = self._debug_info()

    def result(self, steps: int) -> dict[str, Any]:
        """Per role, the deltas over the window divided by ``steps``; the wall time."""
        wall = self._t1 - self._t0
        roles: dict[str, Any] = {}
        for role in self.pids:
            proc = procstat.delta(self._before[role]["proc"], self._after[role]["proc"])
            frames = _count_delta(self._before[role]["frames"], self._after[role]["frames"])
            per_step = {k: v / steps for k, v in proc.items()
                        if k not in ("threads", "threads_started", "threads_ended",
                                     "per_thread")}
            if frames is not None:
                per_step["frames"] = frames["frames"] / steps
                per_step["frame_bytes"] = frames["bytes"] / steps
                per_step["frames_by_kind"] = {
                    _kind_name(k): n / steps for k, n in enumerate(frames["frames_by_kind"])
                    if n}
            roles[role] = {"per_step": per_step, "window": {**proc, "frames": frames},
                           "pid": self.pids[role]}
        return {"value": wall / steps * 1e3, "samples": [wall / steps * 1e3],
                "steps": steps, "wall_s": wall, "roles": roles, "debug_info": self.debug}


def _kind_name(kind: int) -> str:
    try:
        from rpcx.messages import MessageKind

        return MessageKind(kind).name if kind else "other"
    except (ImportError, ValueError):
        return str(kind)


def _refuse_in_process(system: str) -> None:
    if systems.in_process(system):
        raise RuntimeError(f"{system}'s workers are threads of one process: per-process "
                           "accounting cannot tell them apart")


# ------------------------------------------------------------------------ the worlds


def account_rnn(ns: SimpleNamespace, init_method: str, steps: int, warmup: int
                ) -> dict[str, Any]:
    """On the trainer: N tutorial iterations after ``warmup``, every process counted."""
    pids = {"trainer": os.getpid(), "ps": int(ns.rpc.rpc_sync("w1", os.getpid))}
    window = Window(ns, pids, {"trainer": 0, "ps": 1}, world_dir(init_method))
    rnn_model.run_trainer("w1", steps, warmup, mark=window.mark)
    return window.result(steps)


def rnn_world(rank: int, spec: WorldSpec, init_method: str, recorder: Recorder) -> None:
    """Entry point of the RNN's world: ``w0`` trains against ``w1``, its parameter server."""
    ns = systems.api(spec.system)
    rnn_model.set_api(ns)
    counting = start_counting(spec.system, init_method, rank)
    systems.init_worker(ns, f"w{rank}", rank, 2, init_method)
    if rank == 0:
        if counting or spec.system == systems.BASELINE:
            recorder.run("rnn", account_rnn, ns, init_method, spec.params["steps"],
                         spec.params["warmup"])
        else:
            recorder.run("rnn", _no_counter)
        recorder.done()
    ns.rpc.shutdown()


def _no_counter() -> dict[str, Any]:
    raise RuntimeError("this rpcx has no CallPath(transmit_frame=...) to count frames at")


HYBRID_RANKS = {"trainer0": 0, "trainer1": 1, "master": 2, "ps": 3}


def _batches(rank: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    while True:
        yield from hybrid.get_next_batch(rank)


def _account_trainer(emb_rref: Any, rank: int, port: int, steps: int, warmup: int,
                     pids: dict[str, int], directory: str) -> dict[str, Any] | None:
    """On each trainer: warm up, meet at a barrier, N batches, meet again. trainer0
    reads every process's counters at the two barriers."""
    trainer = hybrid.Trainer(emb_rref, rank, port)
    batches = _batches(rank)
    for _ in range(warmup):
        trainer.step(*next(batches))
    window = Window(hybrid.API, pids, HYBRID_RANKS, directory) if rank == 0 else None
    dist.barrier()
    if window:
        window.mark("start")
    for _ in range(steps):
        trainer.step(*next(batches))
    dist.barrier()
    if window:
        window.mark("end")
    dist.barrier()  # trainer1's reply to the master waits until trainer0 has read
    return window.result(steps) if window else None


def account_hybrid(ns: SimpleNamespace, init_method: str, port: int, steps: int, warmup: int
                   ) -> dict[str, Any]:
    """On the master: run both trainers' accounted batches; trainer0's figures."""
    pids = {role: int(ns.rpc.rpc_sync(role, os.getpid)) for role in HYBRID_RANKS
            if role != "master"}
    pids["master"] = os.getpid()
    emb_rref = ns.rpc.remote("ps", torch.nn.EmbeddingBag,
                             args=(hybrid.NUM_EMBEDDINGS, hybrid.EMBEDDING_DIM),
                             kwargs={"mode": "sum"})
    futs = [ns.rpc.rpc_async(f"trainer{r}", _account_trainer,
                             args=(emb_rref, r, port, steps, warmup, pids,
                                   world_dir(init_method)))
            for r in (0, 1)]
    results = [fut.wait() for fut in futs]
    out: dict[str, Any] = results[0]
    return out


def hybrid_world(rank: int, spec: WorldSpec, init_method: str, recorder: Recorder) -> None:
    """Entry point of the hybrid's world (ranks: trainer0, trainer1, master, ps)."""
    ns = hybrid.API = systems.api(spec.system)
    port = spec.params["ddp_port"]
    name = {v: k for k, v in HYBRID_RANKS.items()}[rank]
    counting = start_counting(spec.system, init_method, rank)
    if rank <= 1 and not systems.in_process(spec.system):
        dist.init_process_group(backend="gloo", rank=rank, world_size=2,
                                init_method=f"tcp://127.0.0.1:{port}",
                                timeout=hybrid.DDP_TIMEOUT)
    systems.init_worker(ns, name, rank, len(HYBRID_RANKS), init_method)
    if name == "master":
        if counting or spec.system == systems.BASELINE:
            recorder.run("hybrid", account_hybrid, ns, init_method, port,
                         spec.params["steps"], spec.params["warmup"])
        else:
            recorder.run("hybrid", _no_counter)
        recorder.done()
    ns.rpc.shutdown()
    if rank <= 1 and dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- report

# (key in per_step, label, scale, format)
METRICS = [
    ("frames", "frames sent (rpcx agent)", 1.0, "{:.2f}"),
    ("frame_bytes", "bytes sent (rpcx agent)", 1.0, "{:,.0f}"),
    ("syscw", "write calls (syscw)", 1.0, "{:.1f}"),
    ("wchar", "bytes written (wchar)", 1.0, "{:,.0f}"),
    ("syscr", "read calls (syscr)", 1.0, "{:.1f}"),
    ("rchar", "bytes read (rchar)", 1.0, "{:,.0f}"),
    ("wakeups", "thread wake-ups (ctx switches)", 1.0, "{:,.1f}"),
    ("cpu_s", "CPU ms (utime+stime)", 1e3, "{:.2f}"),
    ("cpu_sched_s", "CPU ms (threads' schedstat)", 1e3, "{:.2f}"),
]


def summarize(runs: list[dict[str, Any]], system_names: list[str], names: list[str]
              ) -> dict[str, Any]:
    """Per workload and system: the median over rounds of each per-step figure."""
    out: dict[str, Any] = {}
    for name in names:
        out[name] = {}
        for system in system_names:
            entries = [r[name][system] for r in runs if name in r and system in r[name]]
            good = [e for e in entries if "error" not in e]
            cell: dict[str, Any] = {"errors": [e["error"] for e in entries if "error" in e]}
            if good:
                cell["wall_ms"] = statistics.median(e["value"] for e in good)
                cell["roles"] = {}
                for role in ROLES[name]:
                    steps = [e["roles"][role]["per_step"] for e in good]
                    keys = {k for s in steps for k, v in s.items() if not isinstance(v, dict)}
                    median = {k: statistics.median(s[k] for s in steps if k in s) for k in keys}
                    kinds = {k for s in steps for k in s.get("frames_by_kind", {})}
                    median["frames_by_kind"] = {
                        k: statistics.median(s.get("frames_by_kind", {}).get(k, 0.0)
                                             for s in steps) for k in sorted(kinds)}
                    cell["roles"][role] = median
                cell["threads"] = {
                    role: [e["roles"][role]["window"]["threads"] for e in good]
                    for role in ROLES[name]}
                cell["threads_changed"] = {
                    role: sum(e["roles"][role]["window"]["threads_started"]
                              + e["roles"][role]["window"]["threads_ended"] for e in good)
                    for role in ROLES[name]}
            out[name][system] = cell
    return out


def table(summary: dict[str, Any], system_names: list[str], names: list[str], steps: int,
          rounds: int, default: str | None) -> str:
    """Markdown: rows are metrics per role, columns the systems; then frames by kind."""
    notes = report._Notes()
    columns = report.column_names(system_names, default)
    out = ["| per process, per step | " + " | ".join(columns) + " |",
           "|---|" + "---:|" * len(system_names)]
    for name in names:
        cells = []
        for system in system_names:
            cell = summary[name][system]
            if "wall_ms" in cell:
                cells.append(f"{cell['wall_ms']:.2f}")
            else:
                reason = f"{system} {name}: " + "; ".join(cell["errors"])
                cells.append(f"error[{notes.add(reason)}]")
        title = {"rnn": "**RNN (tutorial)**", "hybrid": "**DDP + RPC hybrid**"}[name]
        out.append(f"| {title}: wall ms per step | " + " | ".join(cells) + " |")
        for role in ROLES[name]:
            for key, label, scale, fmt in METRICS:
                row = []
                for system in system_names:
                    values = summary[name][system].get("roles", {}).get(role)
                    if values is None:
                        row.append("-")
                    elif key not in values:
                        row.append("n/a")
                    else:
                        row.append(fmt.format(values[key] * scale))
                out.append(f"| {name} {role}: {label} | " + " | ".join(row) + " |")
    out.append("")
    out.append(f"Deltas over {steps} steps after warm-up, divided by {steps}; medians over "
               f"{rounds} round(s). n/a: torch's agent counts no messages (its debug info "
               "has gauges only). write/read calls and bytes are /proc/<pid>/io: "
               "read/write-type calls only (not sendmsg/recvmsg, not shared memory).")
    changed = [f"{system} {name} {role}"
               for name in names for system in system_names
               for role, n in summary[name][system].get("threads_changed", {}).items() if n]
    if changed:
        out.append("Threads started or ended inside the window (their wake-ups and "
                   "schedstat CPU may be partly missing; utime+stime is whole): "
                   + ", ".join(changed) + ".")
    out.extend(f"[{i}] {line}" for i, line in enumerate(notes.lines, 1))
    kinds = _kinds_table(summary, system_names, names)
    if kinds:
        out += ["", "rpcx frames sent per step, by message kind:", "", *kinds]
    return "\n".join(out)


def _kinds_table(summary: dict[str, Any], system_names: list[str], names: list[str]
                 ) -> list[str]:
    rpcx_systems = [s for s in system_names if s != systems.BASELINE]
    rows = []
    for name in names:
        for role in ROLES[name]:
            kinds: set[str] = set()
            for system in rpcx_systems:
                values = summary[name][system].get("roles", {}).get(role, {})
                kinds |= {k for k, v in values.get("frames_by_kind", {}).items() if v}
            for kind in sorted(kinds):
                cells = []
                for system in rpcx_systems:
                    values = summary[name][system].get("roles", {}).get(role, {})
                    n = values.get("frames_by_kind", {}).get(kind)
                    cells.append("-" if n is None else f"{n:.2f}")
                rows.append(f"| {name} {role}: {kind} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return ["| frames per step | " + " | ".join(rpcx_systems) + " |",
            "|---|" + "---:|" * len(rpcx_systems), *rows]


# ----------------------------------------------------------------------------- main


def default_systems() -> str:
    """torch and the default backend."""
    default = systems.default_backend()
    return ",".join([systems.BASELINE, *([default] if default else [])])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--systems", default=default_systems(),
                        help="comma-separated: torch and rpcx backends (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=50,
                        help="steps counted per run (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=10,
                        help="steps run before counting (default: %(default)s)")
    parser.add_argument("--only", default=",".join(WORKLOADS),
                        help="comma-separated: rnn, hybrid (default: both)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="interleave the systems this many times; report medians")
    parser.add_argument("--out-dir", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    args.only = [w for w in WORKLOADS if w in only]
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--steps and --rounds must be at least 1, --warmup at least 0")
    return args


def spec_for(name: str, system: str, args: argparse.Namespace, label: str) -> WorldSpec:
    """The world that accounts for ``name`` on ``system``."""
    params: dict[str, Any] = {"steps": args.steps, "warmup": args.warmup}
    if name == "rnn":
        return WorldSpec("accounting:rnn_world", system, 2, ("rnn",), False, label,
                         {"rnn": BUDGET_S}, params)
    params["ddp_port"] = placement.Layout(placement.ONE_HOST).free_port()
    return WorldSpec("accounting:hybrid_world", system, 4, ("hybrid",), False, label,
                     {"hybrid": BUDGET_S}, params)


def main(argv: list[str] | None = None) -> int:
    """Account for each workload on every system, ``--rounds`` times; report."""
    args = parse_args(argv)
    machine.set_worker_environment()
    started = datetime.datetime.now()
    t0 = time.monotonic()
    unavailable = {s: r for s in args.systems if (r := systems.missing_requirement(s))}
    runs: list[dict[str, Any]] = []
    notes: list[str] = []
    for index in range(args.rounds):
        record: dict[str, Any] = {name: {} for name in args.only}
        for name in args.only:
            for system in args.systems:
                if system in unavailable:
                    record[name][system] = {"error": unavailable[system]}
                    continue
                if system != systems.BASELINE and systems.in_process(system):
                    record[name][system] = {"error": "workers are threads of one process"}
                    continue
                label = f"round {index + 1}/{args.rounds}: {system}"
                print(f"{label} accounting {name} ...", file=sys.stderr, flush=True)
                outcome = run_world(spec_for(name, system, args, label))
                notes.extend(outcome.notes)
                if name in outcome.results:
                    record[name][system] = outcome.results[name]
                else:
                    record[name][system] = {"error": outcome.errors.get(name, "no result"),
                                            "traceback": outcome.tracebacks.get(name)}
        runs.append(record)
    summary = summarize(runs, args.systems, args.only)
    default = systems.default_backend()
    meta = {
        "started": started.isoformat(timespec="seconds"),
        "duration_s": time.monotonic() - t0, "argv": sys.argv, "systems": args.systems,
        "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "only": args.only, "default_backend": default, **machine.machine_facts(),
        "load_average": os.getloadavg(),
    }
    json_path = args.out_dir / f"{started.strftime('%Y%m%d-%H%M%S')}-accounting.json"
    report.write_json(json_path, {"meta": meta, "median": summary, "rounds": runs,
                                  "notes": notes})
    print(table(summary, args.systems, args.only, args.steps, args.rounds, default))
    for line in notes:
        print(f"note: {line}")
    print(f"\n{meta['duration_s'] / 60:.1f} min; results: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
