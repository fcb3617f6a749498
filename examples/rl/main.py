"""REINFORCE on CartPole with an agent and observers on other workers (RPC and RRefs).

The pattern of torch's RPC tutorial, "Distributed Reinforcement Learning using RPC and
RRef": rank 0 is the agent, which owns the policy and trains it; every other rank is
an observer with its own CartPole. For each episode the agent asks every observer to
play one, sending a proxy's method as the function of ``rpc_async``; the observers ask
the agent for each action and report each reward through RRef proxies on the agent;
then the agent updates the policy from all the observers' episodes at once.

    python examples/rl/main.py                              # default backend, 1 agent + 2 observers
    python examples/rl/main.py --backend loopback --world-size 4 --target 100
    torchrun --nproc-per-node 3 examples/rl/main.py --backend gloo

CartPole comes from gymnasium when it is installed, else from ``cartpole.py`` here
(same dynamics). The exit status is 0 when the running reward (an average over recent
episodes of the worst observer's reward) passes ``--target`` within ``--episodes``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import cartpole
import torch
from torch import nn

import rpcx

AGENT = "agent"
GAMMA = 0.99


def observer_name(rank: int) -> str:
    return f"observer{rank}"


class Policy(nn.Module):
    """State -> probabilities of pushing left and right."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 2))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # weights from our own generator: the same on every backend
            for param in self.net.parameters():
                param.copy_((torch.rand(param.shape, generator=generator) - 0.5) * 0.2)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        probs: torch.Tensor = torch.softmax(self.net(state), dim=-1)
        return probs


class Observer:
    """Lives on an observer worker; plays episodes when the agent asks."""

    def __init__(self, seed: int) -> None:
        self.id = rpcx.get_worker_info().id
        self.seed = seed
        self.env = cartpole.make()

    def run_episode(self, agent: rpcx.RRef[Agent], episode: int) -> float:
        """Play one episode, asking ``agent`` for every action; returns the reward."""
        state, _ = self.env.reset(seed=self.seed * 100_003 + episode)
        total = 0.0
        while True:
            action = agent.rpc_sync().select_action(self.id, state)
            state, reward, terminated, truncated, _ = self.env.step(action)
            agent.rpc_sync().report_reward(self.id, float(reward))
            total += float(reward)
            if terminated or truncated:
                return total


class Agent:
    """Owns the policy; observers call it through an RRef while they play."""

    def __init__(self, world_size: int, seed: int) -> None:
        self.policy = Policy(seed)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=1e-2)
        self.rref = rpcx.RRef(self)
        ranks = range(1, world_size)
        self.observers = [rpcx.remote(observer_name(r), Observer, args=(seed + r,)) for r in ranks]
        ids = [rpcx.get_worker_info(observer_name(r)).id for r in ranks]
        # One sampler per observer: its actions do not depend on how the observers'
        # calls interleave, so a run gives the same numbers every time.
        self.samplers = {i: torch.Generator().manual_seed(seed * 7 + i) for i in ids}
        self.states: dict[int, list[torch.Tensor]] = {i: [] for i in ids}
        self.actions: dict[int, list[int]] = {i: [] for i in ids}
        self.rewards: dict[int, list[float]] = {i: [] for i in ids}
        self.lock = threading.Lock()  # observers call concurrently

    def select_action(self, observer: int, state: Any) -> int:
        """Sample an action for ``observer``; remember the state and the action."""
        state = torch.as_tensor(state, dtype=torch.float32)
        with self.lock, torch.no_grad():
            probs = self.policy(state)
            action = int(torch.multinomial(probs, 1, generator=self.samplers[observer]))
        self.states[observer].append(state)
        self.actions[observer].append(action)
        return action

    def report_reward(self, observer: int, reward: float) -> None:
        """The reward ``observer`` got for its last action."""
        self.rewards[observer].append(reward)

    def run_episode(self, episode: int) -> list[float]:
        """Every observer plays one episode; returns their rewards."""
        futures = [
            rpcx.rpc_async(ob.owner(), ob.rpc_sync().run_episode, args=(self.rref, episode))
            for ob in self.observers
        ]
        return [float(f.wait()) for f in futures]

    def finish_episode(self) -> None:
        """One REINFORCE step from every observer's episode."""
        # The log-probabilities are computed here, in one batch per observer, not kept
        # from select_action: a graph built there would grow in whatever order the
        # observers' calls happened to interleave, and the order gradients accumulate in
        # changes their last bits, which is enough to send a run another way.
        losses = []
        for observer, rewards in self.rewards.items():
            returns, acc = [], 0.0
            for reward in reversed(rewards):
                acc = reward + GAMMA * acc
                returns.append(acc)
            scaled = torch.tensor(returns[::-1])
            scaled = (scaled - scaled.mean()) / (scaled.std() + 1e-6)
            probs = self.policy(torch.stack(self.states[observer]))
            taken = torch.tensor(self.actions[observer]).unsqueeze(1)
            log_probs = torch.log(probs.gather(1, taken).squeeze(1))
            losses.append(-(log_probs * scaled).sum())
            self.states[observer], self.actions[observer], self.rewards[observer] = [], [], []
        self.optimizer.zero_grad()
        torch.stack(losses).sum().backward()
        self.optimizer.step()


def train(args: argparse.Namespace, world_size: int) -> bool:
    """The agent's loop; True when the running reward passed the target."""
    agent = Agent(world_size, args.seed)
    running, started = 0.0, time.perf_counter()
    for episode in range(1, args.episodes + 1):
        rewards = agent.run_episode(episode)
        agent.finish_episode()
        running = 0.05 * min(rewards) + 0.95 * running
        if episode % args.log_every == 0 or running > args.target:
            elapsed = time.perf_counter() - started
            print(f"episode {episode:4d}  rewards {[int(r) for r in rewards]}  "
                  f"running {running:6.2f}  {elapsed * 1e3 / episode:6.1f} ms/episode",
                  flush=True)
        if running > args.target:
            print(f"solved: running reward {running:.2f} > {args.target} "
                  f"after {episode} episodes")
            return True
    print(f"not solved: running reward {running:.2f} after {args.episodes} episodes")
    return False


def run_worker(worker: rpcx.LaunchedWorker, args: argparse.Namespace) -> bool:
    """One worker: the agent trains, the observers serve; True unless training failed."""
    options = rpcx.TensorPipeRpcBackendOptions(init_method=worker.init_method(), rpc_timeout=120)
    name = AGENT if worker.rank == 0 else observer_name(worker.rank)
    rpcx.init_rpc(name, rank=worker.rank, world_size=worker.world_size, backend=args.backend,
                  rpc_backend_options=options)
    passed = True
    if worker.rank == 0:
        backend = rpcx.debug_info()["backend"]  # the one init_rpc chose
        print(f"REINFORCE on CartPole, 1 agent and {worker.world_size - 1} observers on the "
              f"{backend!r} backend; target running reward {args.target}", flush=True)
        passed = train(args, worker.world_size)
    rpcx.shutdown()
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None,
                        help="rpcx backend (default: $RPCX_BACKEND, else rpcx's default)")
    parser.add_argument("--world-size", type=int, default=3,
                        help="the agent + observers (under torchrun: its world size)")
    parser.add_argument("--episodes", type=int, default=500, help="at most this many")
    parser.add_argument("--target", type=float, default=195.0,
                        help=f"running reward that counts as solved "
                             f"(gym's mark is {cartpole.REWARD_THRESHOLD:g})")
    parser.add_argument("--log-every", type=int, default=10, help="episodes per progress line")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    torchrun = rpcx.under_torchrun()
    if not torchrun and args.world_size < 2:
        parser.error("--world-size must be at least 2 (the agent and an observer)")
    # rpcx.spawn starts the workers, or torchrun did: see rpcx.launch.
    passed = rpcx.launch(run_worker, args=(args,), nprocs=None if torchrun else args.world_size,
                         backend=args.backend)
    if not torchrun:
        print("done" if passed else "FAILED")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
