"""TorchRL's RemoteTensorDictReplayBuffer, used over RPC as TorchRL documents it.

Three workers: ``ReplayBuffer`` owns the buffer, ``Collector`` extends it through an
RRef, ``Trainer`` samples it through the same RRef. TorchRL's
``accept_remote_rref_invocation`` finds the RRef passed as ``self`` with
``isinstance(self, torch._C._distributed_rpc.PyRRef)``: the check rpcx's switch must
satisfy. Prints ``RESULT <json>``: which RPC ran it, the buffer's size, three sampled
batches' sums (the owner's sampler is seeded, so they match across runs).

``python torchrl_replay_buffer.py OUT`` starts a world of fixed size (``world_size=3``).
On rpcx the result also says how many peers the trainer encrypts with
(``encrypted_peers``: ``RPCX_AUTH_KEY`` and ``RPCX_ENCRYPT`` in the environment).
``python torchrl_replay_buffer.py OUT dynamic`` starts a dynamic one, as TorchRL's own
replay-buffer example does: ``init_rpc`` without ``world_size``, the workers joining in
whatever order their processes get there, the trainer looking the others up by name
until they are in (TorchRL's example retries ``get_worker_info``), and the others
serving until the trainer is done with them (a dynamic world's ``shutdown`` waits for
nobody). The ``ReplayBuffer`` leaves last: on torch, rank 0 hosts the store through which
every leaving worker takes its turn, and a worker still waiting for its turn when rank 0
has gone fails with "Connection was likely closed".
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from multiprocessing.synchronize import Barrier

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from tensordict import TensorDict
from torchrl.data.replay_buffers import (
    LazyTensorStorage,
    RandomSampler,
    RemoteTensorDictReplayBuffer,
)

NAMES = ["ReplayBuffer", "Collector", "Trainer"]


def make_buffer() -> RemoteTensorDictReplayBuffer:
    torch.manual_seed(0)
    return RemoteTensorDictReplayBuffer(storage=LazyTensorStorage(100), sampler=RandomSampler(),
                                        batch_size=8)


def length(buffer: rpc.RRef) -> int:
    return len(buffer.local_value())


def collect(buffer: rpc.RRef) -> None:
    for i in range(4):
        data = TensorDict({"x": torch.arange(10.0) + 10 * i}, batch_size=[10])
        rpc.rpc_sync(buffer.owner(), RemoteTensorDictReplayBuffer.extend, args=(buffer, data))


_done = threading.Event()


def finish() -> None:
    """The trainer is done with this worker (dynamic mode): it may leave."""
    _done.set()


def wait_for(name: str, timeout: float = 60.0) -> rpc.WorkerInfo:
    """Look ``name`` up until it has joined, as TorchRL's example does (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return rpc.get_worker_info(name)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def run(rank: int, port: int, out: str, dynamic: bool, others_left: Barrier) -> None:
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=60)
    if dynamic:
        options.init_method = f"tcp://127.0.0.1:{port}"
        rpc.init_rpc(NAMES[rank], rank=rank, rpc_backend_options=options)
        if NAMES[rank] == "ReplayBuffer":  # rank 0, the store's host: it leaves last
            others_left.wait(120)
            rpc.shutdown()
            return
        if NAMES[rank] == "Collector":
            _done.wait(120)  # serve the trainer until it is done with this worker
            rpc.shutdown()
            others_left.wait(120)
            return
        for name in NAMES[:2]:
            wait_for(name)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        rpc.init_rpc(NAMES[rank], rank=rank, world_size=3, rpc_backend_options=options)
    if NAMES[rank] == "Trainer":
        buffer = rpc.remote("ReplayBuffer", make_buffer)
        rpc.rpc_sync("Collector", collect, args=(buffer,))
        samples = [
            rpc.rpc_sync(buffer.owner(), RemoteTensorDictReplayBuffer.sample,
                         args=(buffer,))["x"].sum().item()
            for _ in range(3)
        ]
        size = rpc.rpc_sync(buffer.owner(), length, args=(buffer,))
        result = {"rpc": rpc.rpc_sync.__module__, "size": size, "samples": samples}
        if result["rpc"].startswith("rpcx"):  # (how many peers the trainer encrypts with)
            import rpcx

            result["encrypted_peers"] = rpcx.debug_info()["encrypted_peers"]
        with open(out, "w") as f:
            json.dump(result, f)
        if dynamic:
            del buffer
            rpc.rpc_sync("Collector", finish)
    rpc.shutdown()
    if dynamic:
        others_left.wait(120)


def main() -> None:
    out = sys.argv[1]
    dynamic = sys.argv[2:] == ["dynamic"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: the workers are copies of this process, which imported torch and the library
    # once and has started no thread yet (a forkserver imports them again in its server).
    others_left = mp.get_context("fork").Barrier(3)
    mp.start_processes(run, args=(port, out, dynamic, others_left), nprocs=3,
                       start_method="fork")
    with open(out) as f:
        print("RESULT " + f.read(), flush=True)


if __name__ == "__main__":
    main()
