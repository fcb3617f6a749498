"""Hunt for hangs and flakes in rpcx's failure handling, on a busy machine.

Runs the kit's failure-handling classes (a stopped worker, a dead worker, back-pressure)
and the shutdown tests ``rounds`` times in a row on each multi-process backend, with one
CPU-bound process per core running beside them (training machines are busy), and prints
one line per run and a table at the end. Exit status 1 if any run failed or hung.

    python tools/hunt.py --rounds 20 --backends gloo,tensorpipe,shm,zmq

Each run is bounded (pytest-timeout, rpcx's backstop, and ``--run-limit`` around it).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from collections import defaultdict

CLASSES = "TestHungPeer or TestPeerDeath or TestBackPressure or shutdown"


def _burn() -> None:
    """A CPU-bound loop: one core's worth of someone else's work."""
    while True:
        pass


def _run(backend: str, run_limit: float) -> tuple[bool, float, str]:
    """One pytest run of the classes on ``backend``: (passed, seconds, summary line)."""
    command = [sys.executable, "-m", "pytest", "-p", "rpcx.testing.fixtures", "--pyargs",
               "rpcx.testing", f"--rpcx-backend={backend}", "-k", CLASSES, "-q",
               "-p", "no:cacheprovider", "-x"]
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=run_limit)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-2000:] if isinstance(exc.stdout, bytes) else ""
        return False, time.monotonic() - started, f"HUNG past {run_limit:.0f} s {tail!r}"
    took = time.monotonic() - started
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    summary = lines[-1] if lines else "(no output)"
    if done.returncode != 0:
        summary += "\n" + done.stdout[-4000:] + done.stderr[-2000:]
    return done.returncode == 0, took, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--backends", default="gloo,tensorpipe,shm,zmq")
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1,
                        help="CPU-bound processes beside the tests (default: one per core)")
    parser.add_argument("--run-limit", type=float, default=600.0)
    args = parser.parse_args()
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.load)]
    for burner in burners:
        burner.start()
    results: dict[str, list[tuple[bool, float]]] = defaultdict(list)
    try:
        for round_ in range(1, args.rounds + 1):
            for backend in args.backends.split(","):
                passed, took, summary = _run(backend, args.run_limit)
                results[backend].append((passed, took))
                print(f"round {round_:2d} {backend:10s} {'ok  ' if passed else 'FAIL'} "
                      f"{took:6.1f} s  {summary}", flush=True)
    finally:
        for burner in burners:
            burner.kill()
    print(f"\n{'backend':10s} runs failed  slowest (s)")
    failed = 0
    for backend, runs in results.items():
        bad = sum(not ok for ok, _ in runs)
        failed += bad
        print(f"{backend:10s} {len(runs):4d} {bad:6d}  {max(t for _, t in runs):8.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
