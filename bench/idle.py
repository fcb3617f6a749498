"""What an idle worker costs: CPU of a worker process that has nothing to do.

A two-worker world (``w0``, ``w1``): after ``init_rpc``, ``w0`` makes a few small calls
to ``w1`` (so every connection is up and both sides have served a call), asks ``w1``
for its process id, waits ``SETTLE_S`` and then reads ``/proc`` of ``w1`` and of
itself over ``WINDOW_S`` seconds while both sit idle (``w0`` sleeps; it reads /proc only
at the window's two ends). The figure is ``w1``'s CPU time in the window as a percent of
one core: ``utime + stime`` from ``/proc/<pid>/stat`` (10 ms ticks: 0.2% of a core over
5 s), with the nanosecond clock of its live threads (``/proc/<pid>/task/*/schedstat``)
and its thread wake-ups beside it in the JSON. torch.distributed.rpc's TensorPipe agent
is measured the same way.

This is ``bench/run.py --only idle``; run alone::

    python bench/idle.py [--systems torch,shm] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

import calls
import procstat
import systems
from world import Recorder, WorldSpec

WINDOW_S = 5.0
SETTLE_S = 1.0
WARM_CALLS = 10


def measure_idle(ns: SimpleNamespace, peer: str) -> dict[str, Any]:
    """Percent of one core that ``peer`` (and this worker) used while both were idle."""
    rpc = ns.rpc
    for _ in range(WARM_CALLS):
        rpc.rpc_sync(peer, calls.small_add, args=(1, 2))
    peer_pid = int(rpc.rpc_sync(peer, os.getpid))
    time.sleep(SETTLE_S)
    pids = {"peer": peer_pid, "self": os.getpid()}
    before = {role: procstat.snapshot(pid) for role, pid in pids.items()}
    start = time.monotonic()
    time.sleep(WINDOW_S)
    window = time.monotonic() - start
    after = {role: procstat.snapshot(pid) for role, pid in pids.items()}
    deltas = {role: procstat.delta(before[role], after[role]) for role in pids}
    percent = {role: 100.0 * d["cpu_s"] / window for role, d in deltas.items()}
    sched = {role: 100.0 * d["cpu_sched_s"] / window for role, d in deltas.items()}
    return {
        "value": percent["peer"], "samples": [percent["peer"]], "window_s": window,
        "percent_of_core": percent, "percent_of_core_schedstat": sched,
        "wakeups_per_s": {role: d["wakeups"] / window for role, d in deltas.items()},
        "deltas": deltas,
    }


def idle_world(rank: int, spec: WorldSpec, init_method: str, recorder: Recorder) -> None:
    """Entry point of the idle world: ``w0`` measures ``w1`` (and itself) doing nothing."""
    ns = systems.api(spec.system)
    systems.init_worker(ns, f"w{rank}", rank, 2, init_method)
    if rank == 0:
        if systems.in_process(spec.system):
            recorder.run("idle", _in_process_error, spec.system)
        else:
            recorder.run("idle", measure_idle, ns, "w1")
        recorder.done()
    ns.rpc.shutdown()


def _in_process_error(system: str) -> dict[str, Any]:
    raise RuntimeError(f"{system}'s workers are threads of one process: no worker process "
                       "of its own to measure")


def main(argv: list[str] | None = None) -> int:
    """``run.py --only idle`` with this script's options."""
    import run

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--systems", default=systems.default_systems())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conditions", default="quiet")
    args = parser.parse_args(argv)
    return run.main(["--only", "idle", "--systems", args.systems, "--rounds",
                     str(args.rounds), "--conditions", args.conditions,
                     "--json-prefix", "idle-"])


if __name__ == "__main__":
    sys.exit(main())
