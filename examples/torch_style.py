"""A program written for torch.distributed.rpc, ported by changing its imports only.

Below the import block, this is torch's call API as the tutorials use it: workers
started with ``mp.spawn``, an ``Agent`` object held behind an RRef, observers calling it
with ``rpc_sync``/``rpc_async`` and RRef proxies, ``@rpc.functions.async_execution``
batching requests. Run it on any backend::

    RPCX_BACKEND=loopback python examples/torch_style.py
    RPCX_BACKEND=gloo python examples/torch_style.py
"""

import os
import tempfile
import threading

import torch

# --- the only lines that differ from the torch version -------------------------------
import rpcx as mp  # was: import torch.multiprocessing as mp
import rpcx as rpc  # was: import torch.distributed.rpc as rpc
from rpcx import RRef, TensorPipeRpcBackendOptions, remote, rpc_async, rpc_sync

# was: from torch.distributed.rpc import RRef, TensorPipeRpcBackendOptions, remote, ...
# --------------------------------------------------------------------------------------

OBSERVERS = 2
STEPS = 5


class Agent:
    """Collects one state from every observer per step, answers all of them at once."""

    def __init__(self, world_size):
        self.lock = threading.Lock()
        self.pending = torch.futures.Future()
        self.states = {}
        self.expected = world_size - 1
        self.rewards = {}

    @staticmethod
    @rpc.functions.async_execution
    def select_action(agent_rref, observer_id, state):
        self = agent_rref.local_value()
        with self.lock:
            self.states[observer_id] = state
            future = self.pending
            if len(self.states) == self.expected:
                batch = torch.stack([self.states[k] for k in sorted(self.states)])
                actions = batch.sum(dim=1)
                self.states = {}
                self.pending = torch.futures.Future()
                future.set_result(actions)
        return future.then(lambda f: f.wait()[observer_id - 1].item())

    def report(self, observer_id, reward):
        self.rewards[observer_id] = self.rewards.get(observer_id, 0.0) + reward
        return self.rewards[observer_id]

    def total(self):
        return sum(self.rewards.values())


class Observer:
    def __init__(self):
        self.id = rpc.get_worker_info().id

    def run_episode(self, agent_rref, steps):
        reward = 0.0
        for step in range(steps):
            state = torch.full((3,), float(self.id + step))
            action = rpc_sync(
                agent_rref.owner(), Agent.select_action, args=(agent_rref, self.id, state)
            )
            reward = agent_rref.rpc_sync().report(self.id, action)
        return reward


def run_worker(rank, world_size, init_method):
    options = TensorPipeRpcBackendOptions(num_worker_threads=8)
    options.init_method = init_method
    if rank == 0:
        rpc.init_rpc("agent", rank=rank, world_size=world_size, rpc_backend_options=options)
        agent_rref = RRef(Agent(world_size))
        observers = [remote(f"observer{r}", Observer) for r in range(1, world_size)]
        futures = [
            rpc_async(ob.owner(), _call_method, args=(Observer.run_episode, ob, agent_rref, STEPS))
            for ob in observers
        ]
        rewards = [f.wait() for f in futures]
        print(f"observer rewards: {rewards}; agent total: {agent_rref.local_value().total()}")
    else:
        rpc.init_rpc(f"observer{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=options)
    rpc.shutdown()


def _call_method(method, rref, *args):
    return method(rref.local_value(), *args)


if __name__ == "__main__":
    world_size = OBSERVERS + 1
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_worker, args=(world_size, "file://" + os.path.join(tmp, "rdzv")),
                 nprocs=world_size, join=True)
