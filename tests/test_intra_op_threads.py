"""rpcx's threads run torch operators with the process's intra-op thread count.

A worker process that calls ``torch.set_num_threads(1)`` without ``OMP_NUM_THREADS`` set
must not run handlers and backward passes on rpcx's threads with OpenMP's default (every
core): that is what a thread gets until torch initialises it (rpcx._intra_op). Checked in
a fresh interpreter with ``OMP_NUM_THREADS`` removed, reading OpenMP's setting of each
thread straight from the OpenMP runtime torch loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import ctypes, json, os, threading
    import torch
    import rpcx
    from rpcx._intra_op import adopt_intra_op_threads
    from rpcx.testing.world import world

    def _openmp():
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libgomp" in path or "libiomp" in path:
                    return ctypes.CDLL(path)
        return None

    OMP = _openmp()

    def openmp_threads():
        return OMP.omp_get_max_threads()

    def on_a_thread(adopt):
        out = []
        def run():
            if adopt:
                adopt_intra_op_threads()
            out.append(openmp_threads())
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(30)
        return out[0]

    torch.set_num_threads(1)
    result = {"openmp": OMP is not None}
    if OMP is not None:
        result["plain"] = on_a_thread(False)
        result["adopted"] = on_a_thread(True)
        with world("loopback", size=2):
            result["handler"] = rpcx.rpc_sync("worker1", openmp_threads, timeout=30)
    print(json.dumps(result))
""")


@pytest.mark.skipif((os.cpu_count() or 1) < 2,
                    reason="OpenMP's default is one thread on one core: nothing to tell apart")
def test_rpcx_threads_take_torch_set_num_threads() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    import json

    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["openmp"]:
        pytest.skip("this torch loaded no OpenMP runtime")
    # The control: a plain thread has OpenMP's default, every core.
    assert result["plain"] == os.cpu_count(), result
    assert result["adopted"] == 1, result
    assert result["handler"] == 1, result  # served on a thread rpcx started
