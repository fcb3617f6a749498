"""rpcx works on a torch built without distributed RPC; tensorpipe says it needs it.

Each test runs a program in fresh processes with tests/no_torch_rpc first on
``PYTHONPATH``: its ``sitecustomize`` makes torch look like a build without distributed
RPC, in every process the program starts too. The program checks that took effect, then
runs calls, an RRef, a ``RemoteModule`` trained with distributed autograd and
``DistributedOptimizer``, and shutdown on the backend under test. On tensorpipe, which
drives torch's own agent, ``init_rpc`` must refuse and say why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rpcx.testing.world import free_port

# nox -s no_torch_rpc runs these on every backend (CI runs it); nox -s tests leaves them out.
pytestmark = pytest.mark.no_torch_rpc

BLOCKER = Path(__file__).resolve().parent / "no_torch_rpc"

PROGRAM = '''\
import sys

import torch

import rpcx
import rpcx.autograd as dist_autograd
from rpcx.optim import DistributedOptimizer
from rpcx.nn import RemoteModule


def check_torch_has_no_rpc():
    import torch.distributed.autograd
    import torch.distributed.rpc
    assert not torch.distributed.rpc.is_available(), "the blocker did not work"
    assert not hasattr(torch.distributed.rpc, "rpc_sync")
    try:
        import torch._C._distributed_rpc  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("torch._C._distributed_rpc imports: the blocker did not work")


def run(rank, world_size, init_method, backend):
    check_torch_has_no_rpc()
    rpcx.init_rpc(f"w{rank}", backend=backend, rank=rank, world_size=world_size,
                  rpc_backend_options=rpcx.TensorPipeRpcBackendOptions(
                      init_method=init_method, rpc_timeout=60))
    if rank == 0:
        out = rpcx.rpc_sync("w1", torch.add, args=(torch.ones(2), 1))
        assert torch.equal(out, torch.full((2,), 2.0)), out
        rref = rpcx.remote("w1", torch.arange, args=(3,))
        assert torch.equal(rref.to_here(), torch.arange(3))
        torch.manual_seed(0)
        module = RemoteModule("w1/cpu", torch.nn.Linear, args=(2, 1))
        before = [p.to_here().clone() for p in module.remote_parameters()]
        optimizer = DistributedOptimizer(torch.optim.SGD, module.remote_parameters(), lr=0.1)
        with dist_autograd.context() as context_id:
            loss = module(torch.ones(1, 2)).sum()
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        after = [p.to_here() for p in module.remote_parameters()]
        # d(sum(W x + b))/dW = x = 1, /db = 1: every parameter moved by -0.1.
        for old, new in zip(before, after):
            assert torch.allclose(new, old - 0.1), (old, new)
        print("without torch RPC OK on", backend, flush=True)
    rpcx.shutdown()


if __name__ == "__main__":
    backend, init_method = sys.argv[1], sys.argv[2]
    check_torch_has_no_rpc()
    if backend == "tensorpipe":
        try:
            rpcx.init_rpc("w0", backend=backend, rank=0, world_size=1)
        except rpcx.BackendNotFoundError as exc:
            print("refused:", exc, flush=True)
        try:
            rpcx.use_for_torch()
        except RuntimeError as exc:
            print("switch refused:", exc, flush=True)
        sys.exit(0)
    rpcx.spawn(run, args=(2, init_method, backend), nprocs=2, backend=backend)
'''


def _run(backend: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BLOCKER), env.get("PYTHONPATH")) if p)
    for name in ("RPCX_BACKEND", "RPCX_FOR_TORCH"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, str(program), backend, f"tcp://127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )


def test_rpcx_works_on_a_torch_without_rpc(rpcx_backend: str, tmp_path: Path) -> None:
    done = _run(rpcx_backend, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    if rpcx_backend == "tensorpipe":
        assert ("refused: rpcx backend 'tensorpipe' cannot be used here (unavailable in "
                "this torch build: " in done.stdout), done.stdout + done.stderr[-3000:]
        assert "switch refused: rpcx.use_for_torch(): this torch" in done.stdout
        assert "was built without distributed RPC" in done.stdout
        return
    assert f"without torch RPC OK on {rpcx_backend}" in done.stdout, (
        done.stdout + done.stderr[-3000:])
