"""How fast worker processes start: fresh interpreters (``spawn``) against forks of a
server that imported torch and rpcx (``forkserver``, rpcx.spawn's default and the test
worlds'), and torch's own ``torch.multiprocessing.spawn`` beside them.

Two workloads, alternated round by round so a drift of the machine hits every method
alike, each in a fresh interpreter of its own (a fork server lives as long as the
process that started it, so each measurement starts one, as a program would):

* ``program``: the README's first program (two workers on the default backend: one
  call each way, shutdown), from the interpreter's start to its exit, wall and CPU (the
  CPU of the program and all its children);
* ``world``: ``rpcx.testing.start_world`` with four workers on gloo, started three times
  in a row in one process and closed each time (the test suite's pattern): seconds per
  start and per close, the first start (which starts the server) apart.

Reported as medians over rounds, and the ratios of spawn to forkserver.

    python bench/start_methods.py                 # 3 rounds
    python bench/start_methods.py --rounds 5 --only program
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

PROGRAM = '''
import sys, rpcx, torch

def add(a, b):
    return a + b

def run(rank, world_size):
    rpcx.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        assert rpcx.rpc_sync("worker1", add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]
    rpcx.shutdown()

if __name__ == "__main__":
    method = sys.argv[1]
    if method == "torch.multiprocessing.spawn":
        import torch.multiprocessing as mp
        mp.spawn(run, args=(2,), nprocs=2)  # (the env:// address from the environment)
    else:
        rpcx.spawn(run, args=(2,), nprocs=2, start_method=method)
'''

WORLD = '''
import json, os, sys, time

def main():
    os.environ["RPCX_TEST_START_METHOD"] = sys.argv[1]
    import rpcx
    from rpcx.testing import remote
    from rpcx.testing.world import start_world
    starts, closes = [], []
    for _ in range(3):
        began = time.perf_counter()
        world = start_world("gloo", 4)
        started = time.perf_counter()
        assert rpcx.rpc_sync("worker3", remote.add, args=(1, 2)) == 3
        world.close()
        starts.append(started - began)
        closes.append(time.perf_counter() - started)
    print(json.dumps({"first_start": starts[0], "later_start": sum(starts[1:]) / 2,
                      "close": sum(closes) / 3}))

if __name__ == "__main__":
    main()
'''


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _program(method: str, script: str) -> dict[str, float]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    cpu, began = _children_cpu(), time.perf_counter()
    subprocess.run([sys.executable, script, method], check=True, env=env, timeout=600)
    return {"wall": time.perf_counter() - began, "cpu": _children_cpu() - cpu}


def _world(method: str, script: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, script, method], check=True, timeout=600,
                          capture_output=True, text=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("program", "world"))
    parser.add_argument("--json", help="write the rounds and medians here")
    args = parser.parse_args(argv)
    workloads = {
        "program": (_program, PROGRAM, ["forkserver", "spawn", "torch.multiprocessing.spawn"]),
        "world": (_world, WORLD, ["forkserver", "spawn"]),
    }
    if args.only:
        workloads = {args.only: workloads[args.only]}
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        scripts = {}
        for name, (_, source, _) in workloads.items():
            scripts[name] = os.path.join(scratch, f"{name}.py")
            with open(scripts[name], "w") as out:
                out.write(source)
        for round_ in range(1, args.rounds + 1):
            for name, (measure, _, methods) in workloads.items():
                for method in methods:
                    got = measure(method, scripts[name])
                    results.setdefault(name, {}).setdefault(method, []).append(got)
                    print(f"round {round_} {name:8} {method:28} "
                          + "  ".join(f"{k} {v:.2f} s" for k, v in got.items()), flush=True)
    medians = {name: {method: {key: statistics.median(r[key] for r in rounds)
                               for key in rounds[0]}
                      for method, rounds in by_method.items()}
               for name, by_method in results.items()}
    print("\nmedians (s), and spawn / forkserver:")
    for name, by_method in medians.items():
        for method, values in by_method.items():
            ratio = "  ".join(
                f"{key} x{values[key] / by_method['forkserver'][key]:.1f}"
                for key in values if method != "forkserver")
            print(f"  {name:8} {method:28} "
                  + "  ".join(f"{k} {v:.2f}" for k, v in values.items()) + f"   {ratio}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rounds": results, "medians": medians}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
