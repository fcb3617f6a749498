"""rpcx works where numpy cannot be imported (torch's own TensorPipe init_rpc does not).

Each test runs a small program in fresh processes whose ``sitecustomize`` makes
``import numpy`` fail (``sys.modules["numpy"] = None``), in every process the program
starts too. The program checks the blocker took effect (torch itself reports numpy as
unavailable), then runs init_rpc, calls, an RRef and shutdown on the backend under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rpcx.testing.world import free_port

# Fresh interpreters, on every backend: nox -s commands runs these (CI runs it), not
# nox -s tests.
pytestmark = pytest.mark.commands

BLOCKER = '''\
import sys
sys.modules["numpy"] = None  # "import numpy" now raises ImportError
'''

PROGRAM = '''\
import sys

import torch

import rpcx


def run(rank, world_size, init_method, backend):
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("numpy is importable: the blocker did not work")
    try:
        torch.ones(1).numpy()
    except RuntimeError as exc:
        assert "Numpy is not available" in str(exc), exc
    else:
        raise AssertionError("torch still sees numpy")
    rpcx.init_rpc(f"w{rank}", backend=backend, rank=rank, world_size=world_size,
                  rpc_backend_options=rpcx.TensorPipeRpcBackendOptions(
                      init_method=init_method, rpc_timeout=60))
    if rank == 0:
        out = rpcx.rpc_sync("w1", torch.add, args=(torch.ones(3), 1))
        assert torch.equal(out, torch.full((3,), 2.0)), out
        rref = rpcx.remote("w1", torch.arange, args=(4,))
        assert torch.equal(rref.to_here(), torch.arange(4))
        print("numpy-free OK on", backend, flush=True)
    rpcx.shutdown()


if __name__ == "__main__":
    backend, init_method = sys.argv[1], sys.argv[2]
    rpcx.spawn(run, args=(2, init_method, backend), nprocs=2, backend=backend)
'''



def _without_numpy(tmp_path: Path) -> dict[str, str]:
    """The environment of a process (and its children) where numpy cannot be imported."""
    blocker = tmp_path / "block"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(blocker), env.get("PYTHONPATH")) if p)
    env.pop("RPCX_BACKEND", None)
    return env


def test_importing_rpcx_first_prints_nothing_without_numpy(tmp_path: Path) -> None:
    env = _without_numpy(tmp_path)
    commands = {
        "import rpcx": [sys.executable, "-c", "import rpcx, torch; print('imported')"],
        "rpcx backends": [sys.executable, "-m", "rpcx", "backends"],
    }
    for what, command in commands.items():
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env,
                              cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stderr == "", f"{what} printed: {done.stderr}"
    # torch's own warning, when torch comes first (the blocker works: it is there)
    torch_first = subprocess.run([sys.executable, "-c", "import torch, rpcx"],
                                 capture_output=True, text=True, timeout=120, env=env,
                                 cwd=tmp_path)
    assert "Failed to initialize NumPy" in torch_first.stderr, torch_first.stderr


def test_init_rpc_works_without_numpy(rpcx_backend: str, tmp_path: Path) -> None:
    env = _without_numpy(tmp_path)
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, str(program), rpcx_backend, init_method],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"numpy-free OK on {rpcx_backend}" in done.stdout, done.stdout + done.stderr[-3000:]
