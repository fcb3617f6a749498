"""``env://``: rank and world size come from the environment, as torchrun sets them.

Two separate processes, each started with only ``MASTER_ADDR``, ``MASTER_PORT`` (a port
from the OS), ``RANK`` and ``WORLD_SIZE`` set, call ``init_rpc(name, backend=...)`` with
neither ``rank`` nor ``world_size``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rpcx.registry import resolve_backend
from rpcx.testing.world import free_port

WORKER = '''\
import os
import sys

import rpcx

backend = sys.argv[1]
rank = int(os.environ["RANK"])
rpcx.init_rpc(f"env{rank}", backend=backend,
              rpc_backend_options=rpcx.TensorPipeRpcBackendOptions(
                  init_method="env://", rpc_timeout=60))
me = rpcx.get_worker_info()
names = [(w.name, w.id) for w in rpcx.get_worker_infos()]
other = f"env{1 - me.id}"
print("me", me.name, me.id, "world", names, "peer says", rpcx.rpc_sync(other, os.getpid) > 0,
      flush=True)
rpcx.shutdown()
'''



def test_rank_and_world_size_from_the_environment(rpcx_backend: str, tmp_path: Path) -> None:
    caps = resolve_backend(rpcx_backend).capabilities
    if caps.in_process or not caps.multi_process:
        pytest.skip("an in-process backend runs every worker in one process (one environment)")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs = []
    for rank in (1, 0):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   RANK=str(rank), WORLD_SIZE="2")
        env.pop("RPCX_BACKEND", None)
        procs.append((rank, subprocess.Popen(
            [sys.executable, str(script), rpcx_backend], env=env, cwd=tmp_path,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )))
    outputs = {}
    try:
        for rank, proc in procs:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, f"rank {rank} failed:\n{out}\n{err[-3000:]}"
            outputs[rank] = out.strip()
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    world = "[('env0', 0), ('env1', 1)]"
    assert outputs[0] == f"me env0 0 world {world} peer says True"
    assert outputs[1] == f"me env1 1 world {world} peer says True"


SOLO = '''\
import rpcx

rpcx.init_rpc("solo", rank=0, world_size=1)  # env://, the default, with nothing set
print("answer", rpcx.rpc_sync("solo", max, args=(1, 2)), flush=True)
rpcx.shutdown()
rpcx.shutdown()  # again: nothing to do, no error
print("shut down twice")
try:
    rpcx.init_rpc("w0", rank=0, world_size=2)
except rpcx.RpcError as exc:
    print("error:", exc)
'''


def test_a_world_of_one_needs_no_master_addr_and_a_larger_one_says_what_to_set(
    tmp_path: Path,
) -> None:
    script = tmp_path / "solo.py"
    script.write_text(SOLO)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["answer 2", "shut down twice"], out.stdout
    assert "MASTER_ADDR and MASTER_PORT not set" in lines[2]
    assert "MASTER_ADDR=127.0.0.1" in lines[2] and "backend='loopback' needs none" in lines[2]
