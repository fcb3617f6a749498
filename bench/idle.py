"""What an idle worker costs: CPU of a worker process that has nothing to do.

A two-worker world (``w0``, ``w1``): after ``init_rpc``, ``w0`` makes a few small calls
to ``w1`` (so every connection is up and both sides have served a call), asks ``w1``
for its process id, waits ``SETTLE_S`` and then reads ``/proc`` of ``w1`` and of
itself over ``WINDOW_S`` seconds while both sit idle. Two rows:

* ``idle``: ``w1``, waiting in ``shutdown()`` for ``w0`` to finish, which is how the
  tutorials' servers (a parameter server, an observer) spend a run;
* ``idle_sleep``: ``w0`` itself, sleeping in its own code with RPC up (it reads /proc
  only at the window's two ends).

Each figure is the process's CPU time in the window as a percent of one core:
``utime + stime`` from ``/proc/<pid>/stat`` (10 ms ticks: 0.2% of a core over 5 s).
The JSON has the nanosecond clock of the live threads (``/proc/<pid>/task/*/schedstat``)
and the wake-ups beside it, per thread too, with the Python thread names each process
reports after the window. torch.distributed.rpc's TensorPipe agent is measured the same
way.

This is ``bench/run.py --only idle``; run alone::

    python bench/idle.py [--systems torch,shm] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
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
    """Percent of one core that ``peer`` (in ``shutdown()``) and this worker (asleep)
    used while both were idle; ``value`` is the peer's."""
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
    # Which threads woke: their names, by native id, from each process itself.
    names = {"peer": rpc.rpc_sync(peer, thread_names), "self": thread_names()}
    for role, delta in deltas.items():
        for tid, figures in delta["per_thread"].items():
            figures["name"] = names[role].get(int(tid), "(not a Python thread)")
    percent = {role: 100.0 * d["cpu_s"] / window for role, d in deltas.items()}
    sched = {role: 100.0 * d["cpu_sched_s"] / window for role, d in deltas.items()}
    return {
        "value": percent["peer"], "samples": [percent["peer"]], "window_s": window,
        "percent_of_core": percent, "percent_of_core_schedstat": sched,
        "wakeups_per_s": {role: d["wakeups"] / window for role, d in deltas.items()},
        "deltas": deltas,
    }


def thread_names() -> dict[int, str]:
    """This process's Python threads' names by native thread id."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def idle_world(rank: int, spec: WorldSpec, init_method: str, recorder: Recorder) -> None:
    """Entry point of the idle world: ``w0`` measures ``w1`` (and itself) doing nothing."""
    ns = systems.api(spec.system)
    systems.init_worker(ns, f"w{rank}", rank, 2, init_method)
    if rank == 0:
        if systems.in_process(spec.system):
            for name in spec.workloads:
                recorder.run(name, _in_process_error, spec.system)
        else:
            result: dict[str, Any] | BaseException
            try:
                result = measure_idle(ns, "w1")
            except Exception as exc:  # each row shows it
                result = exc
            for name in spec.workloads:
                recorder.run(name, _row, result, "peer" if name == "idle" else "self")
        recorder.done()
    ns.rpc.shutdown()


def _row(result: dict[str, Any] | BaseException, role: str) -> dict[str, Any]:
    """One row of the table from the one measurement: ``role``'s figure as its value."""
    if isinstance(result, BaseException):
        raise result
    percent = result["percent_of_core"][role]
    return {**result, "value": percent, "samples": [percent], "role": role}


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
