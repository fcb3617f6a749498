"""The call service: running a caller's function on this worker (``CALL`` messages)."""

from __future__ import annotations

from typing import Any

import torch

from rpcx.functions import is_async_execution
from rpcx.messages import MessageKind
from rpcx.service_host import Deferred, ServiceHost, describe_callable
from rpcx.worker import WorkerInfo

__all__ = ["install", "run_user_function"]


def run_user_function(func: Any, args: Any, kwargs: Any) -> Any:
    """Call ``func``; for an ``@async_execution`` function, return a :class:`Deferred`."""
    result = func(*args, **kwargs)
    if is_async_execution(func):
        if not isinstance(result, torch._C.Future):
            raise TypeError(
                f"@async_execution function {describe_callable(func)} must return a "
                f"torch.futures.Future, but returned {type(result).__name__}"
            )
        return Deferred(result)
    return result


def _handle_call(caller: WorkerInfo, payload: Any) -> Any:
    func, args, kwargs = payload
    return run_user_function(func, args, kwargs)


def install(agent: ServiceHost) -> None:
    """Serve ``CALL`` requests on ``agent``."""
    agent.register_handler(MessageKind.CALL, _handle_call)
