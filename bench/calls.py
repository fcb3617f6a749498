"""Functions and classes the benchmarks call remotely, and the timed echo loop.

They live in their own module so every worker (and the parent's pickles) refer to them
by the same importable name, whatever script started the benchmark.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch


def small_add(a: int, b: int) -> int:
    """The small call: two ints in, one out."""
    return a + b


def echo(x: Any) -> Any:
    """Return the argument (a tensor travels both ways)."""
    return x


class Counter:
    """An object owned by the callee, called through an RRef proxy."""

    def __init__(self) -> None:
        self.count = 0

    def m(self) -> int:
        """A small method call."""
        self.count += 1
        return self.count


def echo_seconds(
    ns: SimpleNamespace, peer: str, tensor: torch.Tensor, warmup: int, iterations: int
) -> list[float]:
    """Seconds of each of ``iterations`` echoes of ``tensor`` (after ``warmup`` more)."""
    rpc = ns.rpc
    for _ in range(warmup):
        rpc.rpc_sync(peer, echo, args=(tensor,))
    times = []
    out = tensor
    for _ in range(iterations):
        start = time.perf_counter()
        out = rpc.rpc_sync(peer, echo, args=(tensor,))
        times.append(time.perf_counter() - start)
    if out.shape != tensor.shape or out.dtype != tensor.dtype:
        raise AssertionError(f"echo returned {out.dtype}{tuple(out.shape)}")
    return times
