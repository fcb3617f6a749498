"""CartPole-v1 for the RL example: gymnasium's when it is installed, else this one.

The built-in environment has gymnasium's API (``reset(seed=...) -> (state, info)``,
``step(action) -> (state, reward, terminated, truncated, info)``) and the classic
cart-pole dynamics (Barto, Sutton and Anderson 1983, as gym and gymnasium implement
them: Euler steps of 20 ms, failure past 12 degrees or 2.4 units, 500 steps at most),
so the example runs with no extra install and learns the same way.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["CartPole", "make"]

GRAVITY, MASS_CART, MASS_POLE, HALF_LENGTH = 9.8, 1.0, 0.1, 0.5
FORCE, TAU, MAX_STEPS = 10.0, 0.02, 500
THETA_LIMIT, X_LIMIT = 12 * 2 * math.pi / 360, 2.4
REWARD_THRESHOLD = 475.0  # gym's "solved" mark for CartPole-v1


class CartPole:
    """Push the cart left (0) or right (1); reward 1 for every step the pole stays up."""

    def __init__(self) -> None:
        self._generator = torch.Generator()
        self._state = [0.0, 0.0, 0.0, 0.0]
        self._steps = 0

    def reset(self, seed: int | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """Start an episode near upright; ``seed`` makes the start reproducible."""
        if seed is not None:
            self._generator.manual_seed(seed)
        start = torch.rand(4, generator=self._generator, dtype=torch.float64) * 0.1 - 0.05
        self._state = start.tolist()
        self._steps = 0
        return self.observation(), {}

    def step(self, action: int) -> tuple[torch.Tensor, float, bool, bool, dict[str, Any]]:
        """Apply ``action`` for one time step."""
        x, x_dot, theta, theta_dot = self._state
        force = FORCE if action == 1 else -FORCE
        cos, sin = math.cos(theta), math.sin(theta)
        total = MASS_CART + MASS_POLE
        pole_moment = MASS_POLE * HALF_LENGTH
        temp = (force + pole_moment * theta_dot**2 * sin) / total
        theta_acc = (GRAVITY * sin - cos * temp) / (
            HALF_LENGTH * (4.0 / 3.0 - MASS_POLE * cos**2 / total)
        )
        x_acc = temp - pole_moment * theta_acc * cos / total
        self._state = [x + TAU * x_dot, x_dot + TAU * x_acc,
                       theta + TAU * theta_dot, theta_dot + TAU * theta_acc]
        self._steps += 1
        x, theta = self._state[0], self._state[2]
        terminated = abs(x) > X_LIMIT or abs(theta) > THETA_LIMIT
        truncated = not terminated and self._steps >= MAX_STEPS
        return self.observation(), 1.0, terminated, truncated, {}

    def observation(self) -> torch.Tensor:
        """The state: cart position and velocity, pole angle and angular velocity."""
        return torch.tensor(self._state, dtype=torch.float32)


def make() -> Any:
    """gymnasium's ``CartPole-v1`` if gymnasium is installed, else :class:`CartPole`."""
    try:
        import gymnasium
    except ImportError:
        return CartPole()
    return gymnasium.make("CartPole-v1")
