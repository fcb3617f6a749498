"""A stand-in for OpenAI Gym's ``CartPole-v1`` with gym's old API, for the seed tests.

The RPC tutorial's reinforcement-learning program (seed 003) was written against gym
0.x: ``env.seed(n)``, ``reset()`` returning the state as a numpy array, ``step()``
returning ``(state, reward, done, info)``. Current gym and gymnasium changed all three,
and neither is installed here, so the seed test puts this package first on
``PYTHONPATH``, with ``examples/rl`` (whose ``cartpole.CartPole`` has the dynamics and
gymnasium's API) after it. ``RPCX_SEED_REWARD_THRESHOLD`` lowers the reward threshold
so that a test run "solves" it in a few episodes.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

from cartpole import MAX_STEPS, REWARD_THRESHOLD
from cartpole import CartPole as _CartPole

__all__ = ["make"]


class CartPole:
    """gym 0.x's interface over the example's CartPole."""

    def __init__(self) -> None:
        threshold = float(os.environ.get("RPCX_SEED_REWARD_THRESHOLD", REWARD_THRESHOLD))
        self.spec = SimpleNamespace(id="CartPole-v1", reward_threshold=threshold)
        self._max_episode_steps = MAX_STEPS
        self._env = _CartPole()
        self._seed: int | None = None

    def seed(self, seed: int | None = None) -> list[int | None]:
        self._seed = seed  # used by the next reset only, as gym's seeded generator
        return [seed]

    def reset(self) -> Any:
        state, _ = self._env.reset(seed=self._seed)
        self._seed = None
        return state.numpy()

    def step(self, action: int) -> tuple[Any, float, bool, dict[str, Any]]:
        state, reward, terminated, truncated, info = self._env.step(action)
        return state.numpy(), reward, terminated or truncated, info


def make(name: str) -> CartPole:
    """``gym.make``: only ``CartPole-v1`` is here."""
    if name != "CartPole-v1":
        raise ValueError(f"this stand-in for gym only has CartPole-v1, not {name!r}")
    return CartPole()
