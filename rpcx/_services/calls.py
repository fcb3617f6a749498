"""The call service: calls to another worker's function (``CALL`` messages), both ends.

The caller's side (:func:`call`, and :func:`rpc_sync` / :func:`rpc_async` for services
such as ``RemoteModule`` and the optimizer; :mod:`rpcx.api` gives users the same) and the
callee's (:func:`install`: run the function, or hand back its future).
"""

from __future__ import annotations

from typing import Any

import torch

from rpcx._core import context as _context
from rpcx._core.service_host import CallLabel, Deferred, ServiceHost, describe_callable
from rpcx.functions import is_async_execution
from rpcx.futures import RpcFuture
from rpcx.messages import MessageKind
from rpcx.worker import WorkerInfo

__all__ = [
    "UNSET_RPC_TIMEOUT",
    "call",
    "check_callable",
    "install",
    "rpc_async",
    "rpc_sync",
    "run_user_function",
]

UNSET_RPC_TIMEOUT = -1.0
"""A call's ``timeout`` when not given: the worker's default (``rpc_timeout``) applies."""


def call(
    api: str,
    to: str | int | WorkerInfo,
    func: Any,
    args: tuple[Any, ...] | list[Any] | None,
    kwargs: dict[str, Any] | None,
    timeout: float,
) -> RpcFuture[Any]:
    """Call ``func(*args, **kwargs)`` on worker ``to`` as the calling thread's worker;
    ``api`` names the call in errors (``"rpc_sync"``)."""
    agent = _context.current_agent()
    check_callable(func)
    dst = agent.resolve(to)
    payload = (func, tuple(args or ()), dict(kwargs or {}))
    return agent.request(
        dst, MessageKind.CALL, payload, timeout=agent.timeout_for(timeout),
        label=CallLabel(api, func),
    )


def rpc_async(
    to: str | int | WorkerInfo,
    func: Any,
    args: tuple[Any, ...] | list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RpcFuture[Any]:
    """Run ``func(*args, **kwargs)`` on worker ``to``; return a future of the result.

    ``to`` is a name, a rank or a ``WorkerInfo``; ``func`` any importable callable.
    ``timeout`` in seconds: unset uses the default (``rpc_timeout``), ``0`` means none.
    Arguments and results are copied (pickled, tensors out of band), never shared.
    """
    return call("rpc_async", to, func, args, kwargs, timeout)


def rpc_sync(
    to: str | int | WorkerInfo,
    func: Any,
    args: tuple[Any, ...] | list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Like :func:`rpc_async`, but wait for and return the result (or raise its error).

    A remote exception is re-raised with its original type and message when it can be
    rebuilt here (else as :class:`rpcx.RemoteException`); its ``__cause__`` holds the
    remote traceback and a note names the worker.
    """
    return call("rpc_sync", to, func, args, kwargs, timeout).wait()


def check_callable(func: Any) -> None:
    """Raise ``TypeError`` unless ``func`` is callable."""
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__}")


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
