"""Decorators that change how a function runs on the callee: :func:`async_execution`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["async_execution", "is_async_execution"]

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "_rpcx_async_execution"
_TORCH_MARK = "_wrapped_async_rpc_function"  # set by torch.distributed.rpc.functions


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a ``torch.futures.Future`` whose value is the reply.

    The callee's request thread is released as soon as ``fn`` returns its future; the
    reply goes out when the future completes. Works with ``rpc_sync``, ``rpc_async``,
    ``remote`` and the RRef proxies. Under ``@staticmethod``, put ``@staticmethod``
    outermost::

        class Batcher:
            @staticmethod
            @rpcx.functions.async_execution
            def add(x):
                ...
                return future
    """
    if isinstance(fn, (staticmethod, classmethod)):  # decorator placed outside the wrapper
        setattr(fn.__func__, _MARK, True)
    try:
        setattr(fn, _MARK, True)
    except AttributeError:  # a bound method or builtin: mark a thin wrapper instead
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        setattr(wrapper, _MARK, True)
        return wrapper  # type: ignore[return-value]
    return fn


def is_async_execution(fn: Any) -> bool:
    """True for functions marked by :func:`async_execution` (rpcx's or torch's)."""
    return bool(getattr(fn, _MARK, False)) or hasattr(fn, _TORCH_MARK)
