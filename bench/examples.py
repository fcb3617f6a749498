"""The example programs on every rpcx backend and on torch.distributed.rpc, side by side.

Each of ``examples/<name>/main.py`` (ddp_rpc, rl, rnn, parameter_server, batch_rpc) runs
unchanged, once per system and round, as a program of its own: on an rpcx backend with
``--backend NAME``; on "torch" with ``--backend gloo`` (so that ``rpcx.launch`` starts
processes) and ``bench/as_torch`` first on ``PYTHONPATH`` with ``RPCX_BENCH_AS_TORCH=1``,
whose ``sitecustomize`` swaps rpcx's RPC API for torch.distributed.rpc's in every process
of the run (see that file for the list). A torch run that does not print "on the 'torch'
backend" is an error, and so is an rpcx run that names another backend.

The figure is the example's own timing, parsed from its progress lines: ms per epoch
(ddp_rpc), per episode (rl), per iteration (rnn), per batch (parameter_server), per
round (batch_rpc). Where several trainers print, an epoch's figure is their mean; rl
and batch_rpc print a running average since the start every 10 episodes or rounds, from
which the time of each 10 is recovered. A run's figure is the median of its epochs,
the first dropped as warm-up when there are more; the table shows the median over
rounds and each backend's ratio torch/rpcx (>1: rpcx is faster), plus each program's
whole wall time, start to exit. Rounds interleave the systems: in every round each
example runs on every system in ``--systems`` order, so drifts of a shared machine hit
them alike.

``--conditions quiet,busy`` runs everything once per condition, ``busy`` with one
CPU-bound process per core beside the programs (see conditions.py), and adds a drift
table: per backend and example, the ratio vs torch in each condition and busy ÷ quiet.
The default backend's column is marked ``(default)``.

Every run has a timeout (``--timeout`` overrides the examples' own); a run that times
out, exits nonzero (the example's check failed, or it crashed) or prints no timings
shows as ``error[n]`` with the reason in footnote n. Output: the markdown table on
stdout, one progress line per run on stderr, ``bench/results/<stamp>-examples.json``
with every run's per-epoch numbers, output and the medians. Usage::

    python bench/examples.py [--systems torch,gloo,shm] [--rounds 3]
                             [--quick] [--only ddp_rpc,rnn] [--timeout 300]
                             [--conditions quiet,busy]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import conditions
import machine
import report
import systems

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
AS_TORCH_DIR = HERE / "as_torch"
AS_TORCH_ENV = "RPCX_BENCH_AS_TORCH"  # read by as_torch/sitecustomize.py
TORCH_LAUNCH_BACKEND = "gloo"  # any multi-process rpcx backend: it only picks rpcx.spawn
QUICK_TIMEOUT_S = 180.0
TAIL_LINES = 40  # of stderr kept in the JSON


@dataclasses.dataclass(frozen=True)
class Example:
    """One example program: how to run it and how to read its timings."""

    name: str
    unit: str
    epoch: str  # what one "epoch" of the table is, for the footer
    pattern: str  # a progress line: groups ``n`` (epoch, episode or round), ``ms``, maybe ``who``
    cumulative: bool  # ``ms`` is the running average since the start, not the epoch's own
    full_args: tuple[str, ...]
    quick_args: tuple[str, ...]
    timeout_s: float

    def args(self, quick: bool) -> tuple[str, ...]:
        return self.quick_args if quick else self.full_args


_NUMBER = r"(?P<ms>[0-9.]+)"
EXAMPLES: dict[str, Example] = {e.name: e for e in (
    Example("ddp_rpc", "ms/epoch", "an epoch of 10 batches, both trainers' mean",
            rf"(?P<who>trainer\d+): epoch (?P<n>\d+)/\d+ .*? {_NUMBER} ms",
            False, ("--epochs", "11"), ("--epochs", "3"), 300.0),
    Example("rl", "ms/episode", "10 episodes (from the agent's running average); "
            "episodes lengthen as the policy learns",
            rf"episode\s+(?P<n>\d+) .*? {_NUMBER} ms/episode",
            True, (), ("--target", "60"), 600.0),
    Example("rnn", "ms/iteration", "an epoch of 25 iterations",
            rf"epoch\s+(?P<n>\d+) .*? {_NUMBER} ms/iteration",
            False, (), ("--epochs", "3"), 300.0),
    Example("parameter_server", "ms/batch", "an epoch of 20 batches, the trainers' mean",
            rf"(?P<who>trainer\d+): epoch (?P<n>\d+)/\d+ .*? {_NUMBER} ms/batch",
            False, ("--epochs", "8"), ("--epochs", "3"), 300.0),
    Example("batch_rpc", "ms/round", "10 rounds (from each trainer's running average), "
            "the trainers' mean",
            rf"(?P<who>trainer\d+): round (?P<n>\d+)/\d+ .*? {_NUMBER} ms/round",
            True, ("--rounds", "100"), ("--rounds", "30"), 300.0),
)}


# ------------------------------------------------------------------------- parsing


def parse_epochs(example: Example, stdout: str) -> dict[str, list[tuple[int, float]]]:
    """Each printing worker's ``(n, ms)`` per epoch; running averages turned into epochs."""
    series: dict[str, list[tuple[int, float]]] = {}
    # Over the whole text, not line by line: workers share the pipe and print() writes
    # the newline separately, so two workers' lines can come out glued together.
    for match in re.finditer(example.pattern, stdout):
        who = match.groupdict().get("who") or "main"
        series.setdefault(who, []).append((int(match["n"]), float(match["ms"])))
    if example.cumulative:
        series = {who: decumulate(points) for who, points in series.items()}
    return series


def decumulate(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Running averages at ``n`` -> the average over each stretch since the previous one."""
    out, done, total = [], 0, 0.0
    for n, average in sorted(points):
        if n <= done:
            continue
        out.append((n, round((average * n - total) / (n - done), 4)))
        done, total = n, average * n
    return out


def across_workers(series: dict[str, list[tuple[int, float]]]) -> list[float]:
    """Per epoch that every worker printed, the workers' mean, in epoch order."""
    if not series:
        return []
    by_worker = [dict(points) for points in series.values()]
    common = sorted(set.intersection(*(set(points) for points in by_worker)))
    return [statistics.fmean(points[n] for points in by_worker) for n in common]


def measured(epochs: list[float]) -> list[float]:
    """The epochs that count: all but the first (warm-up) when there are several."""
    return epochs[1:] if len(epochs) > 1 else epochs


# ------------------------------------------------------------------------- running


def program_env(system: str) -> dict[str, str]:
    """The environment of one run: the swap to torch only for the torch system."""
    env = dict(os.environ)
    env.pop(AS_TORCH_ENV, None)  # an rpcx run must stay rpcx even if the caller set it
    if system == systems.BASELINE:
        env[AS_TORCH_ENV] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            [str(AS_TORCH_DIR), *filter(None, [env.get("PYTHONPATH")])])
    return env


def command(example: Example, system: str, quick: bool) -> list[str]:
    """The example's command line on ``system``."""
    backend = TORCH_LAUNCH_BACKEND if system == systems.BASELINE else system
    script = ROOT / "examples" / example.name / "main.py"
    return [sys.executable, str(script), "--backend", backend, *example.args(quick)]


def _kill_group(pid: int) -> None:
    """Kill the run's process group: the example and the workers it spawned."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pid, signal.SIGKILL)


def execute(cmd: list[str], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run ``cmd`` to its end or ``timeout_s``; its status, output and wall time."""
    started = time.monotonic()
    # A session of its own, so that a hung run's spawned workers die with it.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid)
        out, err = _drain(proc)
    except BaseException:  # Ctrl-C: leave nothing running
        _kill_group(proc.pid)
        raise
    if proc.returncode != 0:
        _kill_group(proc.pid)  # workers a crashed launcher left behind
    return {"returncode": None if timed_out else proc.returncode, "timed_out": timed_out,
            "wall_s": time.monotonic() - started, "stdout": out, "stderr": err}


def _drain(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """What a killed run had printed; bounded, should a process outside its group hold
    the pipes open."""
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        return "", ""


_BACKEND_LINE = re.compile(r"on the '([^']+)' backend")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= 160 else line[:157] + "..."


def failure(example: Example, system: str, proc: dict[str, Any], timeout_s: float,
            epochs: list[float]) -> str | None:
    """Why the run does not count, in one line, or ``None``."""
    if proc["timed_out"]:
        return f"timed out after {timeout_s:.0f} s (killed)"
    stdout: str = proc["stdout"]
    if proc["returncode"] != 0:
        lines = stdout.rstrip().splitlines()
        if lines and lines[-1].strip() == "FAILED" and len(lines) > 1:
            return f"exit status {proc['returncode']}, check failed: {_last_line(lines[-2])}"
        why = _last_line(proc["stderr"]) or _last_line(stdout)
        return f"exit status {proc['returncode']}: {why}"
    found = _BACKEND_LINE.search(stdout)
    if found is None or found.group(1) != system:
        said = f"'{found.group(1)}'" if found else "no backend"
        hint = " (the as_torch swap did not happen)" if system == systems.BASELINE else ""
        return f"printed {said}, not '{system}' as its backend{hint}"
    if not epochs:
        return f"no {example.unit} progress lines in its output"
    return None


def run_example(example: Example, system: str, quick: bool,
                timeout_s: float | None) -> dict[str, Any]:
    """One run: its raw output, per-epoch figures, median and error if any."""
    limit = timeout_s or (QUICK_TIMEOUT_S if quick else example.timeout_s)
    cmd = command(example, system, quick)
    proc = execute(cmd, program_env(system), limit)
    per_worker = parse_epochs(example, proc["stdout"])
    epochs = across_workers(per_worker)
    record: dict[str, Any] = {
        "command": cmd[1:], "returncode": proc["returncode"], "wall_s": proc["wall_s"],
        "epochs": epochs, "per_worker": per_worker, "stdout": proc["stdout"],
        "stderr_tail": proc["stderr"].splitlines()[-TAIL_LINES:],
    }
    reason = failure(example, system, proc, limit, epochs)
    if reason is None:
        record["value"] = statistics.median(measured(epochs))
    else:
        record["error"] = reason
    return record


def progress(prefix: str, example: Example, system: str, record: dict[str, Any]) -> None:
    """One stderr line per run."""
    if "error" in record:
        what = f"error: {record['error']}"
    else:
        n = len(measured(record["epochs"]))
        what = f"{report._fmt(record['value'])} {example.unit} (median of {n} epoch(s))"
    print(f"{prefix} {system} {example.name}: {what}; {record['wall_s']:.1f} s",
          file=sys.stderr, flush=True)


# ------------------------------------------------------------------------- summary


def summarize(rounds: list[dict[str, Any]], names: list[str],
              system_names: list[str]) -> dict[str, Any]:
    """Per example and system: the median over rounds, per epoch and of the wall time."""
    out: dict[str, Any] = {}
    for name in names:
        out[name] = {}
        for system in system_names:
            entries = [r[name][system] for r in rounds]
            failures = [(i + 1, e["error"]) for i, e in enumerate(entries) if "error" in e]
            good = [e for e in entries if "error" not in e]
            cell: dict[str, Any] = {"failures": failures}
            if good:
                cell["value"] = statistics.median(e["value"] for e in good)
                cell["rounds"] = [e["value"] for e in good]
                cell["wall_s"] = statistics.median(e["wall_s"] for e in good)
            out[name][system] = cell
    return out


def _md(text: str) -> str:
    """A table cell as markdown shows it literally (``*`` marks a partial failure)."""
    return text.replace("*", r"\*").replace("|", r"\|")


def _rows(summary: dict[str, Any], names: list[str], system_names: list[str],
          notes: report._Notes, field: str) -> list[str]:
    """One markdown row per example: ``field`` (value or wall_s) with ratios vs torch."""
    rows = []
    for name in names:
        base = summary[name].get(systems.BASELINE, {}).get(field)
        cells = []
        for system in system_names:
            cell = dict(summary[name][system])
            cell["value"] = cell.get(field)
            cells.append(_md(report._cell(cell, base, False, system, name, notes)))
        unit = EXAMPLES[name].unit if field == "value" else "s"
        rows.append(f"| {name} | {unit} | " + " | ".join(cells) + " |")
    return rows


def ratios(summary: dict[str, Any], names: list[str], system_names: list[str]
           ) -> dict[str, dict[str, float | None]]:
    """``{system: {example: torch/rpcx per-epoch ratio or None}}``."""
    out: dict[str, dict[str, float | None]] = {}
    for system in system_names:
        out[system] = {}
        for name in names:
            base = summary[name].get(systems.BASELINE, {}).get("value")
            value = summary[name].get(system, {}).get("value")
            out[system][name] = (None if base is None or value is None
                                 else report.ratio(value, base, False))
    return out


def table(summary: dict[str, Any], names: list[str], system_names: list[str],
          quick: bool, condition: str | None = None, default: str | None = None) -> str:
    """The markdown report: per-epoch times, whole-run wall times, the footer.

    ``condition`` heads it; ``default``'s column is marked ``(default)``.
    """
    notes = report._Notes()
    head = "| example | unit | " + " | ".join(report.column_names(system_names, default)) + " |"
    rule = "|---|---|" + "---:|" * len(system_names)
    out = [f"condition: {condition}", ""] if condition else []
    out += ["### Time per epoch (the example's own timing)", "", head, rule,
           *_rows(summary, names, system_names, notes, "value"),
           "", "### Whole program, start to exit (spawn, init_rpc, work, shutdown)", "",
           head, rule, *_rows(summary, names, system_names, notes, "wall_s"), ""]
    out.append("Ratios (in parentheses): rpcx backend vs torch.distributed.rpc, >1 is "
               "better (torch/rpcx: these are times); medians over rounds.")
    out.append("A run's figure is the median over its epochs, the first epoch dropped as "
               "warm-up when the run has more than one.")
    out.append("torch: the same program with rpcx's RPC API swapped for "
               "torch.distributed.rpc's (bench/as_torch); rpcx.launch starts its processes.")
    if "loopback" in system_names:
        out.append("loopback's workers are threads of one process; the other systems' are "
                   "processes.")
    out.append("")
    for name in names:
        example = EXAMPLES[name]
        args = " ".join(example.args(quick)) or "(defaults)"
        out.append(f"- {name}: {example.unit}, one epoch = {example.epoch}; run with {args}")
    if notes.lines:
        out.append("")
    out.extend(f"- [{i}] {line}" for i, line in enumerate(notes.lines, 1))
    return "\n".join(out)


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0],
                                     epilog="examples: " + ", ".join(EXAMPLES))
    parser.add_argument("--systems", default=systems.default_systems(),
                        help="comma-separated: torch and rpcx backends (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleave the systems this many times; report medians "
                             "(default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer epochs, episodes and rounds per run")
    parser.add_argument("--only", default="", help="comma-separated examples (default: all)")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds per run (default: each example's own, "
                             f"{QUICK_TIMEOUT_S:.0f} with --quick)")
    parser.add_argument("--conditions", default=conditions.QUIET,
                        help="comma-separated machine conditions, each running everything: "
                             "quiet, busy (one CPU-bound process per core beside the "
                             "programs) (default: %(default)s)")
    parser.add_argument("--out-dir", type=pathlib.Path, default=RESULTS,
                        help="where the JSON goes (default: bench/results)")
    args = parser.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    only = [s for s in args.only.split(",") if s] or list(EXAMPLES)
    unknown = [s for s in only if s not in EXAMPLES]
    if unknown:
        parser.error(f"unknown example(s) {unknown}; known: {', '.join(EXAMPLES)}")
    args.only = [name for name in EXAMPLES if name in only]  # the table's order
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    try:
        args.conditions = conditions.parse(args.conditions)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def run_rounds(args: argparse.Namespace, tag: str = "") -> list[dict[str, Any]]:
    """Every round: each example on every system in turn; ``{example: {system: run}}``."""
    unavailable = {s: r for s in args.systems if (r := systems.missing_requirement(s))}
    for system, reason in unavailable.items():
        print(f"{system}: cannot run: {reason}", file=sys.stderr, flush=True)
    rounds = []
    for index in range(args.rounds):
        prefix = f"{tag}round {index + 1}/{args.rounds}:"
        record: dict[str, Any] = {name: {} for name in args.only}
        for name in args.only:
            for system in args.systems:
                if system in unavailable:
                    record[name][system] = {"error": unavailable[system]}
                    continue
                run = run_example(EXAMPLES[name], system, args.quick, args.timeout)
                progress(prefix, EXAMPLES[name], system, run)
                record[name][system] = run
        rounds.append(record)
    return rounds


def main(argv: list[str] | None = None) -> int:
    """Run the selected examples on every system, ``--rounds`` times per condition;
    report."""
    args = parse_args(argv)
    machine.set_worker_environment()

    started = datetime.datetime.now()
    t0 = time.monotonic()
    default = systems.default_backend()
    several = len(args.conditions) > 1
    per_condition: dict[str, dict[str, Any]] = {}
    for condition in args.conditions:
        with conditions.condition(condition) as facts:
            rounds = run_rounds(args, f"{condition}: " if several else "")
        per_condition[condition] = {"facts": facts, "rounds": rounds,
                                    "median": summarize(rounds, args.only, args.systems)}
    meta = {
        "started": started.isoformat(timespec="seconds"),
        "duration_s": time.monotonic() - t0, "argv": sys.argv, "systems": args.systems,
        "rounds": args.rounds, "quick": args.quick, "only": args.only,
        "default_backend": default, "conditions": args.conditions,
        **({} if several else {"condition": args.conditions[0]}),
        **machine.machine_facts(),
        "ratio_convention": ">1 is better: torch/rpcx (times)",
        "warm_up": "the first epoch of each run is dropped when it has more than one",
    }
    json_path = args.out_dir / f"{started.strftime('%Y%m%d-%H%M%S')}-examples.json"
    examples = {n: dataclasses.asdict(EXAMPLES[n]) for n in args.only}
    if several:
        all_ratios = {c: ratios(d["median"], args.only, args.systems)
                      for c, d in per_condition.items()}
        record: dict[str, Any] = {"meta": meta, "examples": examples,
                                  "conditions": per_condition, "ratios": all_ratios}
    else:
        only = per_condition[args.conditions[0]]
        record = {"meta": {**meta, "condition_facts": only["facts"]}, "examples": examples,
                  "median": only["median"], "rounds": only["rounds"]}
    report.write_json(json_path, record)
    for index, (condition, data) in enumerate(per_condition.items()):
        if index:
            print()
        print(table(data["median"], args.only, args.systems, args.quick,
                    condition=conditions.DESCRIPTION[condition], default=default))
    if several:
        print()
        print("### Drift under load (busy ratio / quiet ratio), time per epoch")
        print()
        print(conditions.drift_table([(n, n) for n in args.only], args.systems,
                                     record["ratios"], args.conditions, default,
                                     what="example"))
    print(f"\n{meta['duration_s'] / 60:.1f} min; results: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
