"""Side-by-side benchmark: rpcx backends against torch.distributed.rpc, in one run.

Each system runs a world of two workers (processes; loopback uses threads, as it must)
and rank 0 measures:

* ``rtt``: small ``rpc_sync`` round trip (two ints), microseconds per call, median of
  batches;
* ``async``: small ``rpc_async`` calls per second with many in flight;
* ``echo``: a 64 MiB tensor sent and returned, GB/s counting both directions;
* ``remote``: ``remote().to_here()``, microseconds.

Results print as a table with each figure's ratio to torch.distributed.rpc and are
written to ``bench/results/<date>.json``. Usage::

    python bench/bench_rpc.py [--systems torch,gloo,tensorpipe,loopback] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp

ECHO_BYTES = 64 << 20


def small_add(a: int, b: int) -> int:
    return a + b


def echo(x: Any) -> Any:
    return x


def _rpc_module(system: str) -> Any:
    if system == "torch":
        import torch.distributed.rpc as rpc

        return rpc
    import rpcx

    return rpcx


def _options(system: str, init_method: str) -> Any:
    rpc = _rpc_module(system)
    return rpc.TensorPipeRpcBackendOptions(init_method=init_method, num_worker_threads=16)


def _init(system: str, rank: int, init_method: str) -> Any:
    rpc = _rpc_module(system)
    kwargs: dict[str, Any] = {}
    if system != "torch":
        kwargs["backend"] = system
    rpc.init_rpc(
        f"w{rank}", rank=rank, world_size=2,
        rpc_backend_options=_options(system, init_method), **kwargs,
    )
    return rpc


def _measure(rpc: Any, quick: bool) -> dict[str, float]:
    scale = 0.2 if quick else 1.0
    results: dict[str, float] = {}

    for _ in range(300):
        rpc.rpc_sync("w1", small_add, args=(1, 2))
    batches = []
    for _ in range(max(3, int(15 * scale))):
        n = 200
        start = time.perf_counter()
        for _ in range(n):
            rpc.rpc_sync("w1", small_add, args=(1, 2))
        batches.append((time.perf_counter() - start) / n * 1e6)
    results["rtt_us"] = statistics.median(batches)

    n = int(5000 * scale)
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        futures = [rpc.rpc_async("w1", small_add, args=(i, 1)) for i in range(n)]
        torch.futures.wait_all(futures)
        rates.append(n / (time.perf_counter() - start))
    results["async_per_s"] = statistics.median(rates)

    tensor = torch.ones(ECHO_BYTES // 4, dtype=torch.float32)
    for _ in range(5):  # fresh connections need a few large transfers to reach full speed
        rpc.rpc_sync("w1", echo, args=(tensor,))
    times = []
    for _ in range(max(3, int(10 * scale))):
        start = time.perf_counter()
        out = rpc.rpc_sync("w1", echo, args=(tensor,))
        times.append(time.perf_counter() - start)
    assert out.shape == tensor.shape
    results["echo_GBps"] = 2 * ECHO_BYTES / statistics.median(times) / 1e9

    times = []
    for _ in range(max(50, int(300 * scale))):
        start = time.perf_counter()
        rpc.remote("w1", small_add, args=(1, 2)).to_here()
        times.append(time.perf_counter() - start)
    results["remote_us"] = statistics.median(times) * 1e6
    return results


def _worker(rank: int, system: str, init_method: str, quick: bool, out_path: str) -> None:
    rpc = _init(system, rank, init_method)
    if rank == 0:
        results = _measure(rpc, quick)
        pathlib.Path(out_path).write_text(json.dumps(results))
    rpc.shutdown()


def run_system(system: str, quick: bool) -> dict[str, float]:
    """Start a two-worker world of ``system`` and return rank 0's measurements."""
    with tempfile.TemporaryDirectory() as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        out_path = os.path.join(tmp, "results.json")
        if system == "loopback":
            import rpcx

            rpcx.spawn(_worker, args=(system, init_method, quick, out_path), nprocs=2,
                       backend="loopback")
        else:
            mp.start_processes(_worker, args=(system, init_method, quick, out_path),
                               nprocs=2, start_method="spawn")
        return dict(json.loads(pathlib.Path(out_path).read_text()))


def _table(all_results: dict[str, dict[str, float]]) -> str:
    metrics = [
        ("rtt_us", "rpc_sync rtt (us)", False),
        ("async_per_s", "rpc_async (calls/s)", True),
        ("echo_GBps", "64 MiB echo (GB/s)", True),
        ("remote_us", "remote+to_here (us)", False),
    ]
    base = all_results.get("torch")
    lines = [f"{'system':<10}" + "".join(f"{label:>28}" for _, label, _ in metrics)]
    for system, results in all_results.items():
        cells = []
        for key, _, higher_is_better in metrics:
            value = results[key]
            cell = f"{value:,.1f}"
            if base and system != "torch":
                ratio = value / base[key] if higher_is_better else base[key] / value
                cell += f" ({ratio:.2f}x)"
            cells.append(f"{cell:>28}")
        lines.append(f"{system:<10}" + "".join(cells))
    lines.append("ratios: how many times better than torch.distributed.rpc (>1 is faster)")
    return "\n".join(lines)


def _summarize(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per system and metric, the median over rounds."""
    systems = list(rounds[0])
    return {
        system: {
            key: statistics.median(r[system][key] for r in rounds) for key in rounds[0][system]
        }
        for system in systems
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", default="torch,gloo,tensorpipe,loopback")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternate the systems this many times (the machine's noise "
                             "affects them alike); figures are medians over rounds")
    parser.add_argument("--quick", action="store_true", help="fewer iterations per round")
    args = parser.parse_args()
    systems = args.systems.split(",")
    if "torch" in systems:
        try:
            import numpy  # noqa: F401
        except ImportError:
            print("torch.distributed.rpc needs numpy for init_rpc: pip install numpy",
                  file=sys.stderr)
            return 2
    rounds: list[dict[str, dict[str, float]]] = []
    for round_index in range(args.rounds):
        results: dict[str, dict[str, float]] = {}
        for system in systems:
            print(f"round {round_index + 1}/{args.rounds}: {system} ...", file=sys.stderr,
                  flush=True)
            results[system] = run_system(system, args.quick)
        rounds.append(results)
    summary = _summarize(rounds)
    print(_table(summary))
    out_dir = pathlib.Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    record = {"torch": torch.__version__, "cpus": os.cpu_count(), "median": summary,
              "rounds": rounds}
    (out_dir / f"{stamp}.json").write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
