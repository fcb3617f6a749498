"""Distributed autograd with the API of ``torch.distributed.autograd``.

Inside ``with rpcx.autograd.context() as context_id:``, every tensor that requires grad
and crosses a call (arguments, results, ``remote()`` values fetched with ``to_here``,
RRef proxy calls) is recorded on both sides. ``backward(context_id, roots)`` then runs
the backward pass on every worker that took part, and each worker's leaf gradients land
in the context (``get_gradients``), not in ``.grad``. Leaving the ``with`` block releases
the context on every worker that took part. See ``docs/design/autograd.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch

from rpcx._core import context as _context
from rpcx.autograd.service import _current, current_context_id
from rpcx.autograd.service import service as _service_of

__all__ = ["backward", "context", "current_context_id", "get_gradients"]


class context:  # lower case: torch's name
    """``with context() as context_id:`` opens a distributed autograd context.

    The id is unique across the world. One context per thread at a time; on exit the
    context is released here and, in the background, on every worker that took part.
    """

    def __init__(self) -> None:
        self._context_id: int | None = None
        self._token: Any = None

    def __enter__(self) -> int:
        if _current.get() is not None:
            raise RuntimeError(
                f"Already have an autograd context id for this thread "
                f"({_current.get()}); distributed autograd contexts do not nest"
            )
        svc = _service_of(_context.current_agent())
        self._context_id = svc.open().id
        self._token = _current.set(self._context_id)
        return self._context_id

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _current.reset(self._token)
        agent = _context.maybe_current_agent()
        if agent is not None and self._context_id is not None:
            _service_of(agent).release_from_user(self._context_id)


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from ``roots`` (scalars) in ``context_id``.

    Returns once every worker that took part has finished its share; leaf gradients are
    then in each worker's context (:func:`get_gradients`). ``retain_graph=False`` means
    the same roots cannot be run again in this context.
    """
    agent = _context.current_agent()
    svc = _service_of(agent)
    ctx = svc.get(context_id)
    roots = list(roots)
    if not roots:
        raise RuntimeError("backward() needs at least one root tensor")
    for root in roots:
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"backward() roots must be tensors, got {type(root).__name__}")
        if not root.requires_grad:
            raise RuntimeError(
                "backward() root does not require grad and has no grad_fn: nothing to do"
            )
        if root.numel() != 1:
            raise RuntimeError(
                f"backward() roots must be scalars, got a tensor of shape {tuple(root.shape)}"
            )
        if root.grad_fn is not None and root.grad_fn in ctx.finished_roots:
            raise RuntimeError(
                "Trying to backward through the graph a second time in distributed autograd "
                f"context {context_id}; pass retain_graph=True to the first backward()"
            )
    grads = [torch.ones_like(root) for root in roots]
    svc.rounds.start(ctx, roots, grads)
    if not retain_graph:
        ctx.finished_roots.update(r.grad_fn for r in roots if r.grad_fn is not None)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's leaf gradients in ``context_id``: ``{tensor: gradient}``."""
    ctx = _service_of(_context.current_agent()).get(context_id)
    with ctx.lock:
        return dict(ctx.grads)


# Not part of torch's API; used by tests and rpcx.debug_info.
def _wait_released(timeout: float = 60.0) -> int:
    """Wait until the releases this worker started have reached every peer."""
    return _service_of(_context.current_agent()).wait_released(timeout)

