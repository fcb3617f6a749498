"""How a call is named in errors, traces and profiles: one value, :class:`CallLabel`,
made where the call is made and carried with it (``rpc_sync(mod.f)``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["CallLabel", "describe_callable"]


def describe_callable(func: Any) -> str:
    """``module.qualname`` of a callable, for messages."""
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if qualname is None:
        return repr(func)
    module = getattr(func, "__module__", None)
    if module is None:
        self_obj = getattr(func, "__self__", None)
        module = getattr(self_obj, "__module__", None) or getattr(
            type(self_obj), "__module__", None
        )
    return f"{module}.{qualname}" if module else qualname


class CallLabel(NamedTuple):
    """How a call is named in errors, traces and profiles: ``api(target)``, e.g.
    ``rpc_sync(mod.f)``. ``describe`` turns the target into words only when something
    asks (a qualified name costs microseconds; most calls never need one)."""

    api: str
    target: Any
    describe: Callable[[Any], str] = describe_callable

    @property
    def call(self) -> str:
        """``api(target)``, as messages name the call."""
        return f"{self.api}({self.describe(self.target)})"
