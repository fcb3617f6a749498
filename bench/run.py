"""rpcx's benchmark suite: every rpcx backend against torch.distributed.rpc, in one run.

Workloads (``--only`` takes these names, comma-separated):

==============  ===============================================================  ========
rpc_sync        small ``rpc_sync`` round trip                                     us
rpc_async       small ``rpc_async`` throughput, many in flight                    calls/s
echo_1m         1 MiB tensor sent and returned (both directions counted)          GB/s
echo_64m        64 MiB tensor sent and returned                                   GB/s
remote          ``remote(...).to_here()``                                         us
rref_proxy      ``rref.rpc_sync().m()``, the object owned by the other worker     us
rnn             the RPC tutorial's distributed RNN, per iteration                 ms
hybrid          DDP + RPC hybrid (master, ps, 2 DDP trainers), per epoch          ms
idle            an idle worker's CPU over 5 s after init_rpc, two rows (idle.py)    % core
size_sweep      echo latency and GB/s, 64 B .. 256 MiB                           plot
clients_sweep   1..7 clients calling one server, aggregate calls/s                plot
floors          Unix socket and TCP ping-pong, memcpy: the machine's own floors
==============  ===============================================================  ========

Worlds: the first seven workloads and the size sweep share one two-worker world per
system and round; ``hybrid`` runs in a four-worker world, ``idle`` in a two-worker
world of its own, ``clients_sweep`` in an eight-worker one. Systems are interleaved
round by round: in every round each world runs once per system, in ``--systems`` order,
so slow drifts of the machine hit all systems alike; figures are medians over rounds.
Ratios are rpcx vs torch, >1 is better.

``--conditions quiet,busy`` runs the whole table once per condition (see
conditions.py): ``busy`` with one CPU-bound process per core running beside the
benchmark, started before its first round and stopped after its last. With more than
one condition a drift table follows: per rpcx system and workload, the ratio vs torch in
each condition and busy ÷ quiet. The default backend's column is marked ``(default)``.

Every world rendezvous through a file in a fresh temporary directory (the transports
and DDP's store listen on ports from the OS), every wait is bounded, and a system or
workload that fails or hangs is reported as ``error`` with its reason (see world.py).

Output: the table on stdout, progress on stderr, ``bench/results/<stamp>.json`` (every
round's raw results and the medians) and, for the sweeps,
``bench/results/<stamp>-sizes.png`` and ``<stamp>-clients.png`` (also copied to
``latest-sizes.png`` / ``latest-clients.png``). Usage::

    python bench/run.py [--systems torch,gloo,tensorpipe,loopback] [--rounds 3]
                        [--quick] [--only rpc_sync,echo_64m,size_sweep]
                        [--conditions quiet,busy]
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import socket
import sys
import time
from typing import Any

import conditions
import floors
import machine
import report
import sweeps
import systems
from workloads import IDLE_ROWS, PAIR_ORDER, WORKLOADS
from world import WorldSpec, one_line, run_world

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
FLOORS = "floors"
ALL_NAMES = [*WORKLOADS, FLOORS]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS just handed out (for DDP's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def world_specs(system: str, selected: list[str], quick: bool, label: str,
                params: dict[str, Any]) -> list[WorldSpec]:
    """The worlds that measure ``selected`` on ``system``, in the order they run."""
    budgets = {name: w.budget_s for name, w in WORKLOADS.items()}
    specs = []
    pair = tuple(name for name in PAIR_ORDER if name in selected)
    if pair:
        specs.append(WorldSpec("workloads:pair_world", system, 2, pair, quick, label, budgets,
                               {"rnn_iterations": params.get("rnn_iterations")}))
    if "hybrid" in selected:
        specs.append(WorldSpec("hybrid:hybrid_world", system, 4, ("hybrid",), quick, label,
                               budgets, {"ddp_port": free_port(),
                                         "epochs": params.get("hybrid_epochs")
                                         or (3 if quick else 10)}))
    idle = tuple(name for name in IDLE_ROWS if name in selected)
    if idle:
        specs.append(WorldSpec("idle:idle_world", system, 2, idle, quick, label, budgets))
    if "clients_sweep" in selected:
        specs.append(WorldSpec("sweeps:clients_world", system, 1 + sweeps.MAX_CLIENTS,
                               ("clients_sweep",), quick, label, budgets,
                               {"duration_s": 1.5 if quick else 3.0}))
    return specs


def run_floors(quick: bool, label: str) -> dict[str, Any]:
    """Every floor once; an error becomes ``{"error": reason}``."""
    out: dict[str, Any] = {}
    for name, (_, _, measure) in floors.FLOORS.items():
        print(f"{label} floor {name} ...", file=sys.stderr, flush=True)
        try:
            out[name] = measure(quick)
        except Exception as exc:
            out[name] = {"error": one_line(exc)}
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0],
        epilog="workloads: " + ", ".join(ALL_NAMES),
    )
    parser.add_argument("--systems", default=systems.default_systems(),
                        help="comma-separated: torch and rpcx backends (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleave the systems this many times; report medians "
                             "(default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer iterations and no 256 MiB point: about 5 minutes")
    parser.add_argument("--only", default="",
                        help="comma-separated workloads to run (default: all)")
    parser.add_argument("--conditions", default=conditions.QUIET,
                        help="comma-separated machine conditions, each running the whole "
                             "table: quiet, busy (one CPU-bound process per core beside "
                             "the benchmark) (default: %(default)s)")
    parser.add_argument("--out-dir", type=pathlib.Path, default=RESULTS,
                        help="where the JSON and PNGs go (default: bench/results)")
    parser.add_argument("--rnn-iterations", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hybrid-epochs", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json-prefix", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    if args.only:
        only = [s for s in args.only.split(",") if s]
        unknown = [s for s in only if s not in ALL_NAMES]
        if unknown:
            parser.error(f"unknown workload(s) {unknown}; known: {', '.join(ALL_NAMES)}")
        if set(only) & set(IDLE_ROWS):
            only += IDLE_ROWS  # one world measures both rows
        args.only = [name for name in ALL_NAMES if name in only]  # the table's order
    else:
        args.only = list(ALL_NAMES)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    try:
        args.conditions = conditions.parse(args.conditions)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def run_rounds(args: argparse.Namespace, workload_names: list[str],
               unavailable: dict[str, str], tag: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Every round of one condition: each world once per system, systems interleaved."""
    selected: list[str] = args.only
    params = {"rnn_iterations": args.rnn_iterations, "hybrid_epochs": args.hybrid_epochs}
    rounds: list[dict[str, Any]] = []
    notes: list[str] = []
    for index in range(args.rounds):
        prefix = f"{tag}round {index + 1}/{args.rounds}:"
        record: dict[str, Any] = {"floors": {}, "systems": {s: {} for s in args.systems},
                                  "worlds": []}
        if FLOORS in selected:
            record["floors"] = run_floors(args.quick, prefix)
        # Topology by topology, each running every system in turn: the systems' worlds
        # of the same kind run back to back, minutes apart at most.
        per_system = {
            s: world_specs(s, workload_names, args.quick, f"{prefix} {s}", params)
            for s in args.systems
        }
        for position in range(max((len(v) for v in per_system.values()), default=0)):
            for system in args.systems:
                if position >= len(per_system[system]):
                    continue
                spec = per_system[system][position]
                if system in unavailable:
                    for name in spec.workloads:
                        record["systems"][system][name] = {"error": unavailable[system]}
                    continue
                print(f"{spec.label} starting a {spec.world_size}-worker world for "
                      f"{', '.join(spec.workloads)} ...", file=sys.stderr, flush=True)
                outcome = run_world(spec)
                print(f"{spec.label} world done in {outcome.wall_s:.1f} s", file=sys.stderr,
                      flush=True)
                for name, result in outcome.results.items():
                    record["systems"][system][name] = result
                for name, reason in outcome.errors.items():
                    record["systems"][system][name] = {
                        "error": reason, "traceback": outcome.tracebacks.get(name)
                    }
                fatal = {k: v for k, v in outcome.tracebacks.items() if k.startswith("<fatal")}
                record["worlds"].append({
                    "system": system, "workloads": list(spec.workloads),
                    "wall_s": outcome.wall_s, "notes": outcome.notes, "fatal": fatal,
                })
                notes.extend(outcome.notes)
        rounds.append(record)
    return rounds, notes


def main(argv: list[str] | None = None) -> int:
    """Run the selected workloads for every system, ``--rounds`` times per condition;
    report."""
    args = parse_args(argv)
    machine.set_worker_environment()

    started = datetime.datetime.now()
    t0 = time.monotonic()
    selected: list[str] = args.only
    workload_names = [n for n in selected if n in WORKLOADS]
    unavailable = {s: r for s in args.systems if (r := systems.missing_requirement(s))}
    for system, reason in unavailable.items():
        print(f"{system}: cannot run: {reason}", file=sys.stderr, flush=True)
    default = systems.default_backend()
    several = len(args.conditions) > 1

    per_condition: dict[str, dict[str, Any]] = {}
    for condition in args.conditions:
        tag = f"{condition}: " if several else ""
        with conditions.condition(condition) as facts:
            rounds, notes = run_rounds(args, workload_names, unavailable, tag)
        summary = report.summarize(rounds, args.systems, workload_names)
        per_condition[condition] = {"facts": facts, "rounds": rounds, "notes": notes,
                                    "median": summary}

    duration = time.monotonic() - t0
    meta = {
        "started": started.isoformat(timespec="seconds"), "duration_s": duration,
        "argv": sys.argv, "systems": args.systems, "rounds": args.rounds,
        "quick": args.quick, "only": selected, "default_backend": default,
        "conditions": args.conditions,
        **({} if several else {"condition": args.conditions[0]}),
        **machine.machine_facts(),
        "ratio_convention": ">1 is better: rpcx/torch for rates, torch/rpcx for times",
    }
    stamp = args.json_prefix + started.strftime("%Y%m%d-%H%M%S")
    out_dir: pathlib.Path = args.out_dir
    plots: list[pathlib.Path] = []
    for condition, data in per_condition.items():
        # The first condition's plots are <stamp>-sizes.png (and latest-*); the others'
        # carry the condition's name.
        first = condition == args.conditions[0]
        infix = "" if first else f"-{condition}"
        made = []
        try:
            for name, plot in (("sizes", report.plot_sizes), ("clients", report.plot_clients)):
                path = out_dir / f"{stamp}{infix}-{name}.png"
                if plot(path, data["median"], args.systems, {**meta, "condition": condition}):
                    made.append(path)
            if first:
                report.copy_latest(made, out_dir)
        except Exception as exc:  # a plotting problem must not lose the measurements
            data["notes"].append(f"plots failed: {one_line(exc)}")
        plots.extend(made)
    json_path = out_dir / f"{stamp}.json"
    workloads = {n: vars(WORKLOADS[n]) for n in workload_names}
    if several:
        ratios = {c: report.ratios(d["median"], args.systems, workload_names)
                  for c, d in per_condition.items()}
        record: dict[str, Any] = {
            "meta": meta, "workloads": workloads, "conditions": per_condition,
            "ratios": ratios, "plots": [str(p) for p in plots],
        }
    else:
        only = per_condition[args.conditions[0]]
        record = {
            "meta": {**meta, "condition_facts": only["facts"]}, "workloads": workloads,
            "median": only["median"], "rounds": only["rounds"],
            "plots": [str(p) for p in plots], "notes": only["notes"],
        }
    report.write_json(json_path, record)
    for index, (condition, data) in enumerate(per_condition.items()):
        if index:
            print()
        print(report.table(data["median"], args.systems, selected, data["notes"],
                           condition=conditions.DESCRIPTION[condition], default=default))
    if several:
        rows = [(n, WORKLOADS[n].label) for n in workload_names
                if WORKLOADS[n].kind == "scalar"]
        print()
        print("drift under load (busy ratio / quiet ratio)")
        print()
        print(conditions.drift_table(rows, args.systems, record["ratios"], args.conditions,
                                     default))
    print(f"\n{duration / 60:.1f} min; results: {json_path}"
          + "".join(f"\nplot: {p}" for p in plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
