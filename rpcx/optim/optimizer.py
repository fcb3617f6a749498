"""One local optimizer per parameter owner, stepped with a context's gradients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rpcx._core import context as _context
from rpcx._services.calls import rpc_async
from rpcx._util.pool import holding
from rpcx.autograd.service import service as autograd_service
from rpcx.futures import wait_all
from rpcx.rref import RRef
from rpcx.worker import WorkerInfo

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    """Lives on a parameter owner: a ``torch.optim`` optimizer over its parameters."""

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params: list[RRef[torch.Tensor]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.params = [rref.local_value() for rref in params]
        self.optimizer = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        """Apply the gradients of ``context_id`` held on this worker."""
        agent = _context.current_agent()
        agent.trace.instant("optimizer step")
        svc = autograd_service(agent)
        grads = svc.get(context_id).grads
        # The optimizer reads .grad: lend it the context's gradients for the step. The
        # worker's gradient lock serializes this with every other step on this worker
        # (other trainers' optimizers over the same parameters included) and keeps
        # backward passes, which also borrow .grad, out meanwhile.
        with holding(svc.grad_lock):
            saved = [p.grad for p in self.params]
            try:
                for param in self.params:
                    param.grad = grads.get(param)
                self.optimizer.step()
            finally:
                for param, old in zip(self.params, saved, strict=True):
                    param.grad = old


def _new_local_optimizer(
    optimizer_class: type[torch.optim.Optimizer],
    params: list[RRef[torch.Tensor]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> RRef[_LocalOptimizer]:
    return RRef(_LocalOptimizer(optimizer_class, params, args, kwargs))


def _step(local: RRef[_LocalOptimizer], context_id: int) -> None:
    local.local_value().step(context_id)


class DistributedOptimizer:
    """Optimizes parameters spread over workers, given as RRefs.

    Creates one ``optimizer_class(params, *args, **kwargs)`` on each worker that owns
    some of ``params_rref``; ``step(context_id)`` steps them all at once, each with the
    gradients that ``context_id`` holds on that worker. Concurrent steps (several
    trainers) are serialized per owner.
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params_rref: Sequence[RRef[torch.Tensor]],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        by_owner: dict[WorkerInfo, list[RRef[torch.Tensor]]] = {}
        for rref in params_rref:
            by_owner.setdefault(rref.owner(), []).append(rref)
        pending = [
            rpc_async(owner, _new_local_optimizer, args=(optimizer_class, rrefs, args, kwargs))
            for owner, rrefs in by_owner.items()
        ]
        self._optimizers: list[RRef[_LocalOptimizer]] = wait_all(pending)

    def step(self, context_id: int) -> None:
        """Step every owner's optimizer with the gradients of ``context_id``, in parallel."""
        local = [o for o in self._optimizers if o.is_owner()]
        futures = [
            rpc_async(optimizer.owner(), _step, args=(optimizer, context_id))
            for optimizer in self._optimizers
            if not optimizer.is_owner()
        ]
        error: BaseException | None = None
        for optimizer in local:  # this worker's own share, meanwhile, without a call
            try:
                optimizer.local_value().step(context_id)
            except Exception as exc:
                error = error or exc
        wait_all(futures)
        if error is not None:
            raise error
