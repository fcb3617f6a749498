"""TorchRL's RPCCollector, unchanged, collecting from two workers it starts itself.

Run as written for torch.distributed.rpc; with ``RPCX_FOR_TORCH=1`` (and the backend in
``RPCX_BACKEND``) every process of it, the collectors TorchRL spawns included, runs on
rpcx. ``python torchrl_collector.py sync|async`` prints one line, ``RESULT <json>``: which
RPC ran it, the number of batches, the weight each remote collector's policy holds at
the end (the weight is changed and sent to the collectors after the third batch), and
per batch the sum of the observations collected. The policy is deterministic, so in
``sync`` mode the sums are too; in ``async`` mode the order in which the two
collectors' batches arrive, and the batch in which each sees the new weight, depend on
timing, on torch as on rpcx: only the first batch is compared there.
"""

from __future__ import annotations

import json
import socket
import sys
from typing import Any

import torch
from tensordict.nn import TensorDictModule
from torchrl.collectors.distributed import RPCCollector
from torchrl.testing.mocking_classes import CountingEnv


class Increment(torch.nn.Module):
    """action = 1 + round(weight): deterministic, and changed by a weight update."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        step = torch.ones_like(observation) + self.weight.detach().round()
        return step.to(observation.dtype)


def make_env() -> CountingEnv:
    return CountingEnv(max_steps=7)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    policy = TensorDictModule(Increment(), in_keys=["observation"], out_keys=["action"])
    collector = RPCCollector(
        [make_env, make_env], policy, frames_per_batch=10, total_frames=60, launcher="mp",
        tcp_port=free_port(), sync=sys.argv[1] == "sync", collector_class="single",
        update_after_each_batch=True,
    )
    sums: list[int] = []
    for batch, data in enumerate(collector):
        sums.append(int(data["next", "observation"].sum()))
        if batch == 2:
            with torch.no_grad():
                policy.module.weight.fill_(1.0)
            collector.update_policy_weights_()
    import torch.distributed.rpc as rpc

    weights = [rpc.rpc_sync(rref.owner(), remote_weight, args=(rref,))
               for rref in collector.collector_rrefs]
    collector.shutdown()
    sync = sys.argv[1] == "sync"
    print("RESULT " + json.dumps({
        "rpc": rpc.rpc_sync.__module__, "batches": len(sums), "weights": weights,
        "sums": sums if sync else sums[:1],
    }), flush=True)


def remote_weight(collector: Any) -> float:
    """The policy weight a remote collector holds (runs where it lives)."""
    policy = collector.local_value().policy
    return float(next(p for p in policy.parameters()).item())


if __name__ == "__main__":
    # TorchRL starts its collectors with the start method the program set (spawn when it
    # set none). fork, as the other programs here: the workers are copies of this
    # process, which imported torch and TorchRL once, and has started no thread yet (a
    # forkserver would import them a second time, in its server: 4 s of CPU a run).
    torch.multiprocessing.set_start_method("fork", force=True)  # (TorchRL set spawn)
    main()
