"""rpcx's threads run torch operators with the process's intra-op thread count.

A worker process that calls ``torch.set_num_threads(1)`` without ``OMP_NUM_THREADS`` set
must not run handlers and backward passes on rpcx's threads with OpenMP's default (every
usable core): that is what a thread gets until torch initialises it (rpcx._util.intra_op).
Checked in fresh interpreters with ``OMP_NUM_THREADS`` removed, reading OpenMP's setting
of each thread straight from the OpenMP runtime torch loaded: on a plain thread (the
control), on a pool thread (loopback serves there) and on a receiving thread of a worker
process (tcp serves on its receive lanes; ``rpcx.spawn`` sets one intra-op thread in
each worker process).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import pytest

PROBE = textwrap.dedent("""
    import ctypes, threading


    def _openmp():
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libgomp" in path or "libiomp" in path:
                    return ctypes.CDLL(path)
        return None


    def openmp_threads():
        omp = _openmp()
        return None if omp is None else omp.omp_get_max_threads()


    def on_a_thread(adopt):
        from rpcx._util.intra_op import adopt_intra_op_threads
        out = []

        def run():
            if adopt:
                adopt_intra_op_threads()
            out.append(openmp_threads())

        thread = threading.Thread(target=run)
        thread.start()
        thread.join(30)
        return out[0]


    def spawned(rank, out):
        import json, rpcx
        rpcx.init_rpc(f"worker{rank}", rank=rank, world_size=2)
        if rank == 0:
            with open(out, "w") as file:
                json.dump({"handler": rpcx.rpc_sync("worker1", openmp_threads, timeout=60)},
                          file)
        rpcx.shutdown()
""")

IN_PROCESS = textwrap.dedent("""
    import json
    import torch
    import rpcx
    from rpcx.testing.world import world
    from intra_op_probe import on_a_thread, openmp_threads

    torch.set_num_threads(1)
    result = {"plain": on_a_thread(False), "adopted": on_a_thread(True)}
    with world("loopback", size=2):
        result["handler"] = rpcx.rpc_sync("worker1", openmp_threads, timeout=30)
    print(json.dumps(result))
""")

WORKER_PROCESSES = textwrap.dedent("""
    import os, tempfile
    import rpcx
    from intra_op_probe import spawned

    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "result.json")
        rpcx.spawn(spawned, args=(out,), nprocs=2, backend="tcp")
        with open(out) as file:
            print(file.read())
""")


def _run(script: str, probe_dir: pathlib.Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(probe_dir),
                                                      env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture
def probe_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "intra_op_probe.py").write_text(PROBE)
    return tmp_path


def test_rpcx_threads_take_torch_set_num_threads(probe_dir: pathlib.Path) -> None:
    result = _run(IN_PROCESS, probe_dir)
    if result["plain"] is None:
        pytest.skip("this torch loaded no OpenMP runtime")
    if result["plain"] == 1:
        pytest.skip("OpenMP's default is one thread here (one usable core): nothing to "
                    "tell apart")
    assert result["adopted"] == 1, result
    assert result["handler"] == 1, result  # served on a pool thread rpcx started


def test_a_receiving_thread_takes_it_in_a_worker_process(probe_dir: pathlib.Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("OpenMP's default is one thread on one usable core: nothing to tell "
                    "apart")
    result = _run(WORKER_PROCESSES, probe_dir)
    if result["handler"] is None:
        pytest.skip("this torch loaded no OpenMP runtime")
    assert result["handler"] == 1, result
