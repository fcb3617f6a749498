"""World-size sweep: N worker processes on this host start, call every other, shut down.

For each N (default 8, 16, 32, 64) and each system (torch.distributed.rpc and rpcx
backends), N processes are started as torchrun would (``env://``, ``RANK``,
``WORLD_SIZE``, ``OMP_NUM_THREADS=1``); each imports its RPC package, runs ``init_rpc``,
sends one ``rpc_async`` to every other worker and checks the replies, then
``shutdown()``. Systems alternate within each round, round after round, so a drift of
the machine hits them alike.

Reported per world (medians over rounds):

* ``init``: the slowest worker's ``init_rpc``, from its call to its return (on a small
  host this includes waiting for the last processes to import torch);
* ``ready``: from the moment the last worker finished importing to the moment the last
  ``init_rpc`` returned (the start-up that the RPC library itself adds);
* ``all_to_all``: from the last ``init_rpc`` return to the last worker's replies;
* ``shutdown``: from the last worker's all-to-all to the last ``shutdown()`` return;
* ``rss``: median resident memory of a worker after the all-to-all (MiB).

A world that fails (a worker exits non-zero, a reply is wrong, or the world outlives
its time limit) is recorded with each failed worker's last error line, the rarest
first (the cause, usually, before the echoes); the plot marks it with an x.

    python bench/world_sizes.py                         # torch, auto, gloo; 8-64; 3 rounds
    python bench/world_sizes.py --sizes 8,16 --rounds 1 --systems torch,auto
    python bench/world_sizes.py --sizes 64 --systems auto+eager,auto+on-demand
                                # the socket backends' two ways to connect (see
                                # SocketRpcBackendOptions.connect_on_demand)
    python bench/world_sizes.py --sizes 64 --pattern ring   # each calls two neighbours
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
WORLD_LIMIT_S = 400.0  # a world that has not finished by then counts as failed
RPC_TIMEOUT_S = 120.0


# ----------------------------------------------------------------- one worker


def _worker(system: str) -> None:
    started = time.monotonic()
    if system == "torch":
        import torch.distributed.rpc as rpc
        options = rpc.TensorPipeRpcBackendOptions(init_method="env://",
                                                  rpc_timeout=RPC_TIMEOUT_S)
        backend: dict[str, Any] = {}
    else:
        import rpcx as rpc  # type: ignore[no-redef]
        name, _, connect = system.partition("+")  # e.g. "auto+on-demand", "tcp+eager"
        if connect:
            from rpcx.backends.socket_options import SocketRpcBackendOptions
            options = SocketRpcBackendOptions(init_method="env://", rpc_timeout=RPC_TIMEOUT_S,
                                              connect_on_demand=connect == "on-demand")
        else:
            options = rpc.TensorPipeRpcBackendOptions(init_method="env://",
                                                      rpc_timeout=RPC_TIMEOUT_S)
        backend = {"backend": name}
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    imported = time.monotonic()
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=size, rpc_backend_options=options,
                 **backend)
    ready = time.monotonic()
    if os.environ.get(_PATTERN_ENV) == "ring":  # two neighbours each, as a pipeline's
        peers = sorted({(rank - 1) % size, (rank + 1) % size} - {rank})
    else:
        peers = [r for r in range(size) if r != rank]
    futures = [rpc.rpc_async(f"w{r}", _plus_one, args=(r,)) for r in peers]
    correct = all(f.wait() == r + 1 for f, r in zip(futures, peers, strict=True))
    called = time.monotonic()
    with open(f"/proc/{os.getpid()}/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    rpc.shutdown()
    done = time.monotonic()
    print("RESULT " + json.dumps({
        "rank": rank, "correct": correct, "started": started, "imported": imported,
        "ready": ready, "called": called, "done": done, "rss": rss}), flush=True)


_PATTERN_ENV = "RPCX_BENCH_PATTERN"  # (how main tells the workers --pattern)


def _plus_one(x: int) -> int:
    return x + 1


# ------------------------------------------------------------------ one world


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_world(system: str, size: int) -> dict[str, Any]:
    """Start ``size`` workers of ``system``; the world's figures, or its failure."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(size), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    # Output goes to files, not pipes: a worker that fills a pipe nobody reads yet
    # (64 of them, read one by one) would stall in a write and look starved or dead.
    with tempfile.TemporaryDirectory(prefix="rpcx-world-") as logs, \
            contextlib.ExitStack() as opened:
        files = [(opened.enter_context(open(f"{logs}/{rank}.out", "w+")),
                  opened.enter_context(open(f"{logs}/{rank}.err", "w+")))
                 for rank in range(size)]
        processes = [subprocess.Popen(
            [sys.executable, __file__, "--worker", system], env={**env, "RANK": str(rank)},
            stdout=out, stderr=err, text=True) for rank, (out, err) in enumerate(files)]
        deadline = time.monotonic() + WORLD_LIMIT_S
        outlived = False
        for process in processes:
            try:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                outlived = True
                for other in processes:
                    other.kill()
                process.wait()
        outputs = []
        for process, (out, err) in zip(processes, files, strict=True):
            out.seek(0)
            err.seek(0)
            text = err.read()
            if outlived:
                text = f"the world outlived {WORLD_LIMIT_S:g} s\n" + text
            outputs.append((process.returncode, out.read(), text))
    results = [json.loads(line.split("RESULT ", 1)[1]) for _, out, _ in outputs
               for line in out.splitlines() if line.startswith("RESULT ")]
    failed = [(code, err) for code, _, err in outputs if code != 0]
    if failed or len(results) != size or not all(r["correct"] for r in results):
        # Each failed worker's last error line, the rarest first: one worker's own
        # failure is the cause, the many "worker wN has shut down" that follow it are not.
        last_errors = collections.Counter(
            ([line for line in err.splitlines() if "Error" in line or "outlived" in line]
             or [f"exit status {code}"])[-1][:300] for code, err in failed)
        return {"ok": False, "workers_failed": len(failed), "reported": len(results),
                "errors": [f"{count}x {line}" for line, count in
                           sorted(last_errors.items(), key=lambda item: item[1])]
                or ["a reply was wrong"]}
    last_import = max(r["imported"] for r in results)
    last_ready = max(r["ready"] for r in results)
    last_called = max(r["called"] for r in results)
    return {
        "ok": True,
        "init": round(max(r["ready"] - r["imported"] for r in results), 2),
        "ready": round(last_ready - last_import, 2),
        "all_to_all": round(last_called - last_ready, 3),
        "shutdown": round(max(r["done"] for r in results) - last_called, 2),
        "rss": round(statistics.median(r["rss"] for r in results), 1),
    }


# ------------------------------------------------------------------ the sweep

METRICS = ("init", "ready", "all_to_all", "shutdown", "rss")


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Medians over the rounds of each (system, size) world that never failed; a world
    that failed in any round is reported failed, with its error."""
    summary: dict[str, dict[str, Any]] = {}
    for key in rounds[0]:
        runs = [r[key] for r in rounds if key in r]
        bad = [run for run in runs if not run["ok"]]
        if bad:
            summary[key] = {**bad[0], "failed_rounds": len(bad), "rounds": len(runs)}
        else:
            summary[key] = {"ok": True, **{m: statistics.median(run[m] for run in runs)
                                           for m in METRICS}}
    return summary


def table(summary: dict[str, dict[str, Any]], systems: list[str], sizes: list[int]) -> str:
    """The summary as a Markdown table: a row per N, a column group per system."""
    head = "| N | " + " | ".join(f"{s}: init / ready / all-to-all / shutdown (s), RSS MiB"
                                   for s in systems) + " |"
    rule = "|---|" + "---|" * len(systems)
    rows = [head, rule]
    for size in sizes:
        cells = []
        for system in systems:
            world = summary.get(f"{system}/{size}")
            if world is None:
                cells.append("-")
            elif not world["ok"]:
                cells.append(f"fails: {world['errors'][0][:80]}")
            else:
                cells.append(f"{world['init']:.1f} / {world['ready']:.1f} / "
                             f"{world['all_to_all']:.2f} / {world['shutdown']:.1f}, "
                             f"{world['rss']:.0f}")
        rows.append(f"| {size} | " + " | ".join(cells) + " |")
    others = [s for s in systems if s != "torch"]
    if "torch" not in systems or not others:
        return "\n".join(rows)
    rows += ["", "torch's time / rpcx's (>1: rpcx is faster; \"torch fails\": torch did not "
             "finish)", "",
             "| N | " + " | ".join(f"{s}: init / all-to-all / shutdown" for s in others) + " |",
             "|---|" + "---|" * len(others)]
    for size in sizes:
        torch_world = summary.get(f"torch/{size}")
        cells = []
        for system in others:
            world = summary.get(f"{system}/{size}")
            if world is None or torch_world is None or not world["ok"]:
                cells.append("-")
            elif not torch_world["ok"]:
                cells.append("torch fails")
            else:
                cells.append(" / ".join(
                    f"{torch_world[m] / max(world[m], 1e-3):.2f}x"
                    for m in ("init", "all_to_all", "shutdown")))
        rows.append(f"| {size} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(summary: dict[str, dict[str, Any]], systems: list[str], sizes: list[int],
         path: pathlib.Path) -> None:
    """Start-up, all-to-all and shutdown against N, one line per system (log scale);
    a failed world is an x at the top of its panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("init", "slowest init_rpc (s)"), ("all_to_all", "all-to-all (s)"),
              ("shutdown", "shutdown (s)"))
    figure, axes = plt.subplots(1, len(panels), figsize=(13, 4))
    for axis, (metric, title) in zip(axes, panels, strict=True):
        top = max([w[metric] for w in summary.values() if w["ok"]] + [1.0]) * 2
        for system in systems:
            points = [(n, summary[f"{system}/{n}"]) for n in sizes if f"{system}/{n}" in summary]
            good = [(n, w[metric]) for n, w in points if w["ok"]]
            line = axis.plot([n for n, _ in good], [v for _, v in good], marker="o",
                             label=system)[0]
            failed = [n for n, w in points if not w["ok"]]
            if failed:
                axis.scatter(failed, [top] * len(failed), marker="x", s=80,
                             color=line.get_color(), label=f"{system} failed")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xticks(sizes, [str(n) for n in sizes])
        axis.set_xlabel("workers on one 2-core host" if os.cpu_count() == 2
                        else f"workers on one {os.cpu_count()}-core host")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """``python bench/world_sizes.py``: run the sweep, print the table, write JSON+PNG."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--systems", default="torch,auto,gloo")
    parser.add_argument("--sizes", default="8,16,32,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--out-dir", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--pattern", choices=("all", "ring"), default="all",
                        help="who calls whom after init: every other worker (all-to-all, "
                        "the default) or its two neighbours (ring: a sparse pattern)")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    os.environ[_PATTERN_ENV] = args.pattern  # (inherited by the workers)
    systems, sizes = args.systems.split(","), [int(n) for n in args.sizes.split(",")]
    rounds: list[dict[str, dict[str, Any]]] = []
    for round_ in range(1 if args.quick else args.rounds):
        record: dict[str, dict[str, Any]] = {}
        for size in sizes:
            for system in systems:  # alternated: the same moment's machine for each
                started = time.monotonic()
                record[f"{system}/{size}"] = world = run_world(system, size)
                print(f"round {round_ + 1}, N={size}, {system}: "
                      f"{'ok' if world['ok'] else 'FAILED'} in "
                      f"{time.monotonic() - started:.0f} s {json.dumps(world)}",
                      file=sys.stderr, flush=True)
        rounds.append(record)
    summary = summarize(rounds)
    print(table(summary, systems, sizes))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with open(args.out_dir / f"{stamp}-world-sizes.json", "w") as out:
        json.dump({"systems": systems, "sizes": sizes, "rounds": rounds,
                   "summary": summary}, out, indent=1)
    plot(summary, systems, sizes, args.out_dir / f"{stamp}-world-sizes.png")
    print(f"wrote {args.out_dir}/{stamp}-world-sizes.{{json,png}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
