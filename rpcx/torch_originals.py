"""torch's own RPC objects, kept here while :func:`rpcx.use_for_torch` replaces them.

A leaf module, so that rpcx's tensorpipe backend, which drives torch's agent and sits
below the switch, still reaches torch's functions where the switch has put rpcx's.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

__all__ = ["original", "saved"]

saved: dict[tuple[str, str], object] = {}
"""``(module name, attribute) -> torch's object``, for every name the switch replaced."""


def original(module: ModuleType, name: str) -> Any:
    """torch's ``module.name``, whether or not the switch has replaced it."""
    return saved.get((module.__name__, name), getattr(module, name))
