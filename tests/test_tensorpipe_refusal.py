"""The tensorpipe backend refuses to start where torch's own RPC agent is already set.

torch has one RPC agent per process; rpcx's tensorpipe backend drives that agent, so a
process already running ``torch.distributed.rpc`` must get a clear RpcError from
``init_rpc``, not a crash or a hijacked agent. Run in a subprocess (torch's agent cannot
be unset), with torch's own init_rpc working without numpy as in test_examples.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from rpcx.registry import backend_names

PROGRAM = '''\
import io, os, sys
import torch.distributed.distributed_c10d as c10d
import torch.distributed.rpc as torch_rpc
import rpcx


def _tensor_to_object(tensor, tensor_size, group):  # torch's, without numpy
    return c10d._unpickler(io.BytesIO(bytes(tensor.cpu()[:tensor_size].tolist()))).load()


c10d._tensor_to_object = _tensor_to_object
torch_store, rpcx_store = sys.argv[1], sys.argv[2]
torch_rpc.init_rpc("torch0", rank=0, world_size=1,
                   rpc_backend_options=torch_rpc.TensorPipeRpcBackendOptions(
                       init_method=f"file://{torch_store}"))
try:
    rpcx.init_rpc("rpcx0", backend="tensorpipe", rank=0, world_size=1,
                  rpc_backend_options=rpcx.TensorPipeRpcBackendOptions(
                      init_method=f"file://{rpcx_store}", rpc_timeout=30))
except rpcx.RpcError as exc:
    print("REFUSED", type(exc).__name__, exc, flush=True)
else:
    print("STARTED", flush=True)
# torch's agent is untouched and still works
print("TORCH", torch_rpc.rpc_sync("torch0", max, args=([1, 5, 2],)), flush=True)
torch_rpc.shutdown()
'''


def test_refuses_when_torch_rpc_agent_is_set(tmp_path: pathlib.Path) -> None:
    if "tensorpipe" not in backend_names():
        pytest.skip("this torch build has no TensorPipe agent")
    env = dict(os.environ)
    env.pop("RPCX_BACKEND", None)
    done = subprocess.run(
        # (file stores: a port the OS called free may be taken before torch binds it)
        [sys.executable, "-c", PROGRAM, str(tmp_path / "torch"), str(tmp_path / "rpcx")],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("REFUSED RpcError "), done.stdout + done.stderr[-3000:]
    assert "already has one" in lines[0] and "one such worker per process" in lines[0]
    assert lines[1] == "TORCH 5"
