"""A stand-in for OpenAI Gym's ``CartPole-v1`` with gym's old API, for the seed tests.

The RPC tutorial's reinforcement-learning program (seed 003) was written against gym
0.x: ``env.seed(n)``, ``reset()`` returning the state, ``step()`` returning
``(state, reward, done, info)``. Current gym and gymnasium changed all three, and
neither is installed here, so the seed test puts this module first on ``PYTHONPATH``.
The dynamics are the classic cart-pole's (Barto, Sutton and Anderson, as in gym), Euler
integration, 500 steps at most. ``RPCX_SEED_REWARD_THRESHOLD`` lowers the reward
threshold so that a test run "solves" it in a few episodes.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace
from typing import Any

import numpy as np

__all__ = ["make"]

_GRAVITY, _MASS_CART, _MASS_POLE, _HALF_LENGTH = 9.8, 1.0, 0.1, 0.5
_FORCE, _TAU, _MAX_STEPS = 10.0, 0.02, 500
_THETA_LIMIT, _X_LIMIT = 12 * 2 * math.pi / 360, 2.4


class CartPole:
    """CartPole-v1: push the cart left (0) or right (1); reward 1 per step upright."""

    def __init__(self) -> None:
        threshold = float(os.environ.get("RPCX_SEED_REWARD_THRESHOLD", "475.0"))
        self.spec = SimpleNamespace(id="CartPole-v1", reward_threshold=threshold)
        self._max_episode_steps = _MAX_STEPS
        self._rng = np.random.default_rng()
        self._state = np.zeros(4)
        self._steps = 0

    def seed(self, seed: int | None = None) -> list[int | None]:
        self._rng = np.random.default_rng(seed)
        return [seed]

    def reset(self) -> np.ndarray:
        self._state = self._rng.uniform(-0.05, 0.05, size=4)
        self._steps = 0
        return self._state.astype(np.float32)

    def step(self, action: int) -> tuple[np.ndarray, float, bool, dict[str, Any]]:
        x, x_dot, theta, theta_dot = self._state
        force = _FORCE if action == 1 else -_FORCE
        cos, sin = math.cos(theta), math.sin(theta)
        total = _MASS_CART + _MASS_POLE
        pole_moment = _MASS_POLE * _HALF_LENGTH
        temp = (force + pole_moment * theta_dot**2 * sin) / total
        theta_acc = (_GRAVITY * sin - cos * temp) / (
            _HALF_LENGTH * (4.0 / 3.0 - _MASS_POLE * cos**2 / total)
        )
        x_acc = temp - pole_moment * theta_acc * cos / total
        x, x_dot = x + _TAU * x_dot, x_dot + _TAU * x_acc
        theta, theta_dot = theta + _TAU * theta_dot, theta_dot + _TAU * theta_acc
        self._state = np.array([x, x_dot, theta, theta_dot])
        self._steps += 1
        done = bool(abs(x) > _X_LIMIT or abs(theta) > _THETA_LIMIT
                    or self._steps >= _MAX_STEPS)
        return self._state.astype(np.float32), 1.0, done, {}


def make(name: str) -> CartPole:
    """``gym.make``: only ``CartPole-v1`` is here."""
    if name != "CartPole-v1":
        raise ValueError(f"this stand-in for gym only has CartPole-v1, not {name!r}")
    return CartPole()
