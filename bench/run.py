"""rpcx's benchmark suite: every rpcx backend against torch.distributed.rpc, in one run.

Workloads (``--only`` takes these names, comma-separated):

==============  ===============================================================  ========
start           ``init_rpc`` of a two-worker world, timed by ``w0``                  ms
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

``--placements one-host,two-hosts`` runs the whole table once per placement (see
placement.py): ``two-hosts`` puts rank r on host r % 2 of two network namespaces joined
by a veth pair (made with the conformance kit's helper; needs root and ``ip``),
rendezvous over ``tcp://`` on host a's address, gives torch ``TP_SOCKET_IFNAME`` and
``GLOO_SOCKET_IFNAME`` and rpcx none. The placements take turns within each round
(namespaces made once per run); ``idle`` and the floors run on one host only. With more
than one placement a comparison table follows: per rpcx system and workload, the ratio
vs torch in each placement and two-hosts ÷ one-host. A placement that cannot be made
(no root, no ``ip``) is reported with its reason, the others still run, and the exit
status is 2.

Every world on one host rendezvous through a file in a fresh temporary directory (the
transports and DDP's store listen on ports from the OS), every wait is bounded, and a
system or workload that fails or hangs is reported as ``error`` with its reason (see
world.py).

Output: the table on stdout, progress on stderr, ``bench/results/<stamp>.json`` (every
round's raw results and the medians) and, for the sweeps,
``bench/results/<stamp>-sizes.png`` and ``<stamp>-clients.png`` (also copied to
``latest-sizes.png`` / ``latest-clients.png``). Usage::

    python bench/run.py [--systems torch,gloo,tensorpipe,loopback] [--rounds 3]
                        [--quick] [--only rpc_sync,echo_64m,size_sweep]
                        [--conditions quiet,busy] [--placements one-host,two-hosts]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import pathlib
import signal
import sys
import time
from typing import Any

import conditions
import floors
import machine
import placement
import report
import sweeps
import systems
from placement import Layout
from workloads import IDLE_ROWS, PAIR_ORDER, WORKLOADS
from world import WorldOutcome, WorldSpec, one_line, run_world

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
FLOORS = "floors"
ALL_NAMES = [*WORKLOADS, FLOORS]


def world_specs(system: str, selected: list[str], quick: bool, label: str,
                params: dict[str, Any], layout: Layout | None = None) -> list[WorldSpec]:
    """The worlds that measure ``selected`` on ``system``, in the order they run, placed
    as ``layout`` says (one host by default)."""
    layout = layout or Layout(placement.ONE_HOST)
    budgets = {name: w.budget_s for name, w in WORKLOADS.items()}
    specs = []
    pair = tuple(name for name in PAIR_ORDER if name in selected)
    if pair:
        specs.append(WorldSpec("workloads:pair_world", system, 2, pair, quick, label, budgets,
                               {"rnn_iterations": params.get("rnn_iterations")}))
    if "hybrid" in selected:
        # DDP's store: on trainer0's host (host a across hosts), a port the OS gives there.
        specs.append(WorldSpec("hybrid:hybrid_world", system, 4, ("hybrid",), quick, label,
                               budgets, {"ddp_port": layout.free_port(0),
                                         "ddp_host": layout.address(0),
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
    parser.add_argument("--placements", default=placement.ONE_HOST,
                        help="comma-separated: where the workers run, each placement "
                             "running the whole table: one-host, two-hosts (two network "
                             "namespaces joined by a veth pair; needs root and ip) "
                             "(default: %(default)s)")
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
        args.placements = placement.parse(args.placements)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def placed_selection(selected: list[str], layout: Layout) -> tuple[list[str], list[str]]:
    """What ``layout`` measures of ``selected``, and a note per workload it leaves out."""
    if not layout.across:
        return selected, []
    left = [n for n in selected if n in placement.NOT_ACROSS_HOSTS]
    return ([n for n in selected if n not in left],
            [f"not measured across hosts: {n} ({placement.NOT_ACROSS_HOSTS[n]})"
             for n in left])


def _print_routes(label: str, outcome: WorldOutcome) -> None:
    """rpcx's routes as the world reported them (``debug_info()["routes"]``), one line."""
    for facts in outcome.facts.values():
        for worker, peers in (facts.get("routes") or {}).items():
            ways = "; ".join(f"{peer}: {how}" for peer, how in (peers or {}).items())
            print(f"{label} routes: {worker} -> {ways}", file=sys.stderr, flush=True)


def run_world_into(record: dict[str, Any], spec: WorldSpec, layout: Layout,
                   show_routes: bool) -> list[str]:
    """Run one world and file its results in the round's ``record``; its notes."""
    print(f"{spec.label} starting a {spec.world_size}-worker world for "
          f"{', '.join(spec.workloads)} ...", file=sys.stderr, flush=True)
    outcome = run_world(spec, layout)
    print(f"{spec.label} world done in {outcome.wall_s:.1f} s", file=sys.stderr, flush=True)
    if show_routes:
        _print_routes(spec.label, outcome)
    system = spec.system
    for name, result in outcome.results.items():
        record["systems"][system][name] = result
    for name, reason in outcome.errors.items():
        record["systems"][system][name] = {
            "error": reason, "traceback": outcome.tracebacks.get(name)
        }
    fatal = {k: v for k, v in outcome.tracebacks.items() if k.startswith("<fatal")}
    record["worlds"].append({
        "system": system, "workloads": list(spec.workloads), "wall_s": outcome.wall_s,
        "notes": outcome.notes, "fatal": fatal, "facts": outcome.facts,
    })
    return outcome.notes


def run_rounds(args: argparse.Namespace, layouts: dict[str, Layout],
               selections: dict[str, list[str]], unavailable: dict[str, dict[str, str]],
               tag: str) -> dict[str, tuple[list[dict[str, Any]], list[str]]]:
    """Every round of one condition: in each round every placement in turn, each world
    once per system, systems interleaved. Per placement: its rounds and notes."""
    params = {"rnn_iterations": args.rnn_iterations, "hybrid_epochs": args.hybrid_epochs}
    out: dict[str, tuple[list[dict[str, Any]], list[str]]] = {p: ([], []) for p in layouts}
    several = len(layouts) > 1
    for index in range(args.rounds):
        for where, layout in layouts.items():
            rounds, notes = out[where]
            selected = selections[where]
            workload_names = [n for n in selected if n in WORKLOADS]
            prefix = f"{tag}{where + ': ' if several else ''}round {index + 1}/{args.rounds}:"
            record: dict[str, Any] = {"floors": {}, "systems": {s: {} for s in args.systems},
                                      "worlds": []}
            if FLOORS in selected:
                record["floors"] = run_floors(args.quick, prefix)
            # Topology by topology, each running every system in turn: the systems'
            # worlds of the same kind run back to back, minutes apart at most.
            per_system = {
                s: world_specs(s, workload_names, args.quick, f"{prefix} {s}", params, layout)
                for s in args.systems
            }
            for position in range(max((len(v) for v in per_system.values()), default=0)):
                for system in args.systems:
                    if position >= len(per_system[system]):
                        continue
                    spec = per_system[system][position]
                    if system in unavailable[where]:
                        for name in spec.workloads:
                            record["systems"][system][name] = {
                                "error": unavailable[where][system]}
                        continue
                    notes.extend(run_world_into(record, spec, layout, show_routes=index == 0))
            rounds.append(record)
    return out


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM: unwind like Ctrl-C, so that worlds are killed and namespaces removed."""
    raise SystemExit(128 + signum)


def _run_label(where: str, condition: str, several_placements: bool,
               several_conditions: bool) -> str:
    """The key of one (placement, condition) run in the JSON: the condition alone when
    there is one placement (as before placements existed)."""
    if not several_placements:
        return condition
    return f"{where}, {condition}" if several_conditions else where


def main(argv: list[str] | None = None) -> int:
    """Run the selected workloads for every system, ``--rounds`` times per condition and
    placement; report."""
    args = parse_args(argv)
    machine.set_worker_environment()
    signal.signal(signal.SIGTERM, _terminate)

    started = datetime.datetime.now()
    t0 = time.monotonic()
    selected: list[str] = args.only
    base_unavailable = {s: r for s in args.systems if (r := systems.missing_requirement(s))}
    for system, reason in base_unavailable.items():
        print(f"{system}: cannot run: {reason}", file=sys.stderr, flush=True)
    default = systems.default_backend()
    several_conditions = len(args.conditions) > 1

    runs: dict[str, dict[str, Any]] = {}
    refused: dict[str, str] = {}  # placement -> why it could not be made
    with contextlib.ExitStack() as stack:
        layouts: dict[str, Layout] = {}
        for where in args.placements:
            try:
                layouts[where] = stack.enter_context(placement.placed(where))
            except placement.PlacementUnavailable as exc:
                refused[where] = str(exc)
                print(f"{where}: cannot run: {exc}", file=sys.stderr, flush=True)
        several_placements = len(layouts) > 1
        selections: dict[str, list[str]] = {}
        left_out: dict[str, list[str]] = {}
        unavailable: dict[str, dict[str, str]] = {}
        for where, layout in layouts.items():
            selections[where], left_out[where] = placed_selection(selected, layout)
            unavailable[where] = dict(base_unavailable)
            for system in args.systems:
                if system not in unavailable[where] and (
                        why := placement.unsupported(system, layout)):
                    unavailable[where][system] = why
                    print(f"{where}: {system}: cannot run: {why}", file=sys.stderr,
                          flush=True)
        for condition in args.conditions if layouts else []:
            tag = f"{condition}: " if several_conditions else ""
            with conditions.condition(condition) as facts:
                per_placement = run_rounds(args, layouts, selections, unavailable, tag)
            for where, (rounds, notes) in per_placement.items():
                names = [n for n in selections[where] if n in WORKLOADS]
                summary = report.summarize(rounds, args.systems, names)
                label = _run_label(where, condition, several_placements, several_conditions)
                runs[label] = {
                    "condition": condition, "placement": where, "facts": facts,
                    "placement_facts": layouts[where].facts(), "rounds": rounds,
                    "notes": left_out[where] + notes, "median": summary,
                    "selected": selections[where],
                }

    duration = time.monotonic() - t0
    placements = [p for p in args.placements if p not in refused]
    meta = {
        "started": started.isoformat(timespec="seconds"), "duration_s": duration,
        "argv": sys.argv, "systems": args.systems, "rounds": args.rounds,
        "quick": args.quick, "only": selected, "default_backend": default,
        "conditions": args.conditions,
        **({} if several_conditions else {"condition": args.conditions[0]}),
        "placements": placements,
        **({"placement": placements[0]} if len(placements) == 1 else {}),
        **({"placements_refused": refused} if refused else {}),
        **machine.machine_facts(),
        "ratio_convention": ">1 is better: rpcx/torch for rates, torch/rpcx for times",
    }
    if not runs:
        print("nothing ran: " + "; ".join(f"{p}: {r}" for p, r in refused.items()))
        return 2
    stamp = args.json_prefix + started.strftime("%Y%m%d-%H%M%S")
    out_dir: pathlib.Path = args.out_dir
    plots: list[pathlib.Path] = []
    first_run = next(iter(runs.values()))
    for data in runs.values():
        # The first run's plots are <stamp>-sizes.png (and latest-*); the others' carry
        # the placement and/or condition that differ from it, e.g. -busy, -two-hosts.
        parts = [data[k] for k in ("placement", "condition") if data[k] != first_run[k]]
        infix = "".join(f"-{part}" for part in parts)
        made = []
        try:
            for name, plot in (("sizes", report.plot_sizes), ("clients", report.plot_clients)):
                path = out_dir / f"{stamp}{infix}-{name}.png"
                if plot(path, data["median"], args.systems,
                        {**meta, "condition": data["condition"],
                         "placement": data["placement"]}):
                    made.append(path)
            if data is first_run:
                report.copy_latest(made, out_dir)
        except Exception as exc:  # a plotting problem must not lose the measurements
            data["notes"].append(f"plots failed: {one_line(exc)}")
        plots.extend(made)
    json_path = out_dir / f"{stamp}.json"
    scalar_names = [n for n in selected if n in WORKLOADS]
    workloads = {n: vars(WORKLOADS[n]) for n in scalar_names}
    ratios = {label: report.ratios(d["median"], args.systems,
                                   [n for n in d["selected"] if n in WORKLOADS])
              for label, d in runs.items()}
    if len(runs) > 1:
        # One placement: keyed by condition under "conditions" (the layout before
        # placements existed); several: keyed by placement (and condition) under "runs".
        key = "runs" if len(placements) > 1 else "conditions"
        record: dict[str, Any] = {
            "meta": meta, "workloads": workloads, key: runs, "ratios": ratios,
            "plots": [str(p) for p in plots],
        }
    else:
        only = first_run
        record = {
            "meta": {**meta, "condition_facts": only["facts"],
                     "placement_facts": only["placement_facts"]},
            "workloads": workloads, "median": only["median"], "rounds": only["rounds"],
            "plots": [str(p) for p in plots], "notes": only["notes"],
        }
    report.write_json(json_path, record)
    show_placement = placements != [placement.ONE_HOST]
    for index, data in enumerate(runs.values()):
        if index:
            print()
        print(report.table(data["median"], args.systems, data["selected"], data["notes"],
                           condition=conditions.DESCRIPTION[data["condition"]],
                           default=default,
                           placement=(placement.DESCRIPTION[data["placement"]]
                                      if show_placement else None)))
    if several_conditions:
        for where in placements:
            rows = [(n, WORKLOADS[n].label) for n in selections[where]
                    if n in WORKLOADS and WORKLOADS[n].kind == "scalar"]
            by_condition = {c: ratios[_run_label(where, c, len(placements) > 1, True)]
                            for c in args.conditions}
            print()
            print("drift under load (busy ratio / quiet ratio)"
                  + (f", {where}" if len(placements) > 1 else ""))
            print()
            print(conditions.drift_table(rows, args.systems, by_condition, args.conditions,
                                         default))
    if len(placements) > 1:
        common = [n for n in selections[placements[0]]
                  if all(n in selections[p] for p in placements)]
        rows = [(n, WORKLOADS[n].label) for n in common
                if n in WORKLOADS and WORKLOADS[n].kind == "scalar"]
        for condition in args.conditions:
            by_placement = {p: ratios[_run_label(p, condition, True, several_conditions)]
                            for p in placements}
            print()
            print(f"across hosts vs one host ({placements[-1]} ratio / {placements[0]} "
                  f"ratio)" + (f", {condition}" if several_conditions else ""))
            print()
            print(placement.comparison_table(rows, args.systems, by_placement, placements,
                                             default))
    for where, reason in refused.items():
        print(f"\n{where}: not run: {reason}")
    print(f"\n{duration / 60:.1f} min; results: {json_path}"
          + "".join(f"\nplot: {p}" for p in plots))
    return 2 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
