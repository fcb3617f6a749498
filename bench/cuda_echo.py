"""CUDA tensor echoes along device maps: torch.distributed.rpc and rpcx, side by side.

Needs a GPU (one is enough: both workers then use ``cuda:0``; with two, ``w0`` uses
``cuda:0`` and ``w1`` ``cuda:1``). Each round starts one two-worker world per system, in
the same order every round, and ``w0`` times ``rpc_sync(w1, echo, (t,))`` of a CUDA tensor
``t``, synchronised before and after, so a time covers the request's and the reply's
trip. The report is each system's median GB/s over the rounds (bytes both ways) and its
ratio to torch's in the same run::

    python bench/cuda_echo.py [--systems torch,tensorpipe,auto] [--rounds 3] [--out F]
                              [--profile DIR]

``--profile DIR`` runs each worker under cProfile (one round is enough) and prints where
each worker of each system spent its time; the stats stay in DIR.

torch and rpcx's ``tensorpipe`` move device memory directly (TensorPipe's CUDA
channels); rpcx's other backends stage it through host memory.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_module
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from calls import echo  # (bench/ is the script's folder: on sys.path, also when spawned)

SIZES = {"echo_1m_cuda": 1 << 20, "echo_64m_cuda": 64 << 20}
ITERATIONS = {"echo_1m_cuda": 100, "echo_64m_cuda": 10}
WORLD_BUDGET_S = 180.0


def _device_of(rank: int) -> int:
    return rank % torch.cuda.device_count()


def _worker(rank: int, system: str, init_file: str, results: Any, profile: str) -> None:
    if not profile:
        _measure(rank, system, init_file, results)
        return
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    try:
        profiler.runcall(_measure, rank, system, init_file, results)
    finally:
        path = os.path.join(profile, f"{system}-w{rank}.pstats")
        profiler.dump_stats(path)
        stats = pstats.Stats(path, stream=sys.stdout)
        print(f"\n### {system}, w{rank}: most time of its own", flush=True)
        stats.sort_stats("tottime").print_stats(12)
        sys.stdout.flush()


def _measure(rank: int, system: str, init_file: str, results: Any) -> None:
    if system == "torch":
        import torch.distributed.rpc as rpc

        backend: dict[str, Any] = {}
    else:
        import rpcx as rpc  # type: ignore[no-redef]

        backend = {"backend": system}
    mine, peer = _device_of(rank), f"w{1 - rank}"
    torch.cuda.set_device(mine)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{init_file}",
                                              rpc_timeout=120)
    options.set_device_map(peer, {mine: _device_of(1 - rank)})
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options, **backend)
    try:
        if rank == 0:
            measured = {}
            for name, nbytes in SIZES.items():
                tensor = torch.ones(nbytes // 4, device=f"cuda:{mine}")
                for _ in range(5):
                    rpc.rpc_sync(peer, echo, args=(tensor,))
                times = []
                for _ in range(ITERATIONS[name]):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    back = rpc.rpc_sync(peer, echo, args=(tensor,))
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                if back.device != tensor.device or not torch.equal(back, tensor):
                    raise AssertionError(f"{system}: the echo came back as {back.device}")
                measured[name] = 2 * nbytes / statistics.median(times) / 1e9
            results.put((system, measured))
    except BaseException as exc:
        results.put((system, {"error": repr(exc)}))
        raise
    finally:
        rpc.shutdown()


def _world(system: str, profile: str) -> dict[str, Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        workers = [context.Process(target=_worker, args=(rank, system, init_file, results, profile))
                   for rank in range(2)]
        for worker in workers:
            worker.start()
        try:
            _, measured = results.get(timeout=WORLD_BUDGET_S)
        except queue_module.Empty:
            measured = {"error": f"no result within {WORLD_BUDGET_S:g} s"}
        for worker in workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()
    return dict(measured)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="torch,tensorpipe,auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="")
    parser.add_argument("--profile", default="", metavar="DIR")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_echo: torch sees no CUDA device; nothing to measure", file=sys.stderr)
        return 2
    systems = args.systems.split(",")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    rounds: list[dict[str, dict[str, Any]]] = []
    for number in range(1, args.rounds + 1):
        rounds.append({system: _world(system, args.profile) for system in systems})
        print(f"round {number}/{args.rounds}: " + "; ".join(
            f"{s} " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in m.items()) for s, m in rounds[-1].items()),
              flush=True)
    median: dict[str, dict[str, float]] = {}
    for system in systems:
        for name in SIZES:
            values = [r[system][name] for r in rounds if name in r[system]]
            if values:
                median.setdefault(system, {})[name] = statistics.median(values)
    print(f"\nCUDA echo, GB/s (both ways), median of {args.rounds} rounds, "
          f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
    for system in systems:
        cells = []
        for name in SIZES:
            value = median.get(system, {}).get(name)
            base = median.get("torch", {}).get(name)
            ratio = f" ({value / base:.2f}x torch)" if value and base and system != "torch" else ""
            cells.append(f"{name} {value:.2f}{ratio}" if value else f"{name} -")
        print(f"  {system:12s} " + "   ".join(cells))
    if args.out:
        with open(args.out, "w") as file:
            json.dump({"rounds": rounds, "median": median,
                       "device": torch.cuda.get_device_name(0),
                       "devices": torch.cuda.device_count(), "torch": torch.__version__},
                      file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
