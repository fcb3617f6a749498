"""The future type rpcx returns: a ``torch.futures.Future`` that knows about the pool.

It is a real ``torch.futures.Future``, so ``then``, ``add_done_callback``, ``collect_all``
and ``wait_all`` work unchanged. The one difference: waiting on it from a request-pool
thread tells the pool that the thread is blocked, so the pool can add a thread and nested
calls cannot exhaust it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from rpcx._pool import current_pool

__all__ = ["RpcFuture", "wait"]

T = TypeVar("T")


class RpcFuture(torch.futures.Future[T]):
    """``torch.futures.Future`` returned by ``rpc_async`` and friends."""

    def wait(self) -> T:
        """Block until the value is ready and return it, or raise the call's error."""
        pool = current_pool()
        if pool is None or self.done():
            return super().wait()
        with pool.blocking():
            return super().wait()


def wait(future: torch.futures.Future[Any]) -> Any:
    """Wait on any torch future, telling the pool when this is a pool thread."""
    pool = current_pool()
    if pool is None or future.done():
        return future.wait()
    with pool.blocking():
        return future.wait()
