"""The graph node rpcx adds to torch's autograd graph, and how to tell nodes apart.

A tensor that requires grad and arrives in a call made inside a context becomes the
output of a :class:`RecvBackward` node, which knows where the tensor came from (the
collector to report to, peer, context, send tag, position, device at the sender). When
torch's engine runs the node, its gradient goes to the collector, which adds it to the
running pass's outbox; when a pass captures the node's gradient instead (see
:mod:`rpcx.autograd.schedule`), the pass reports it the same way.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["Collector", "RecvBackward", "is_leaf", "is_recv", "is_user_function", "origin_of",
           "report"]


class Collector(Protocol):
    """Where a recv node's gradient goes (the autograd service): it checks the gradient
    against the running pass and adds it to that pass's outbox."""

    def collect(self, peer: int, context_id: int, tag: int, index: int,
                grad: torch.Tensor | None, source: torch.device | None = None) -> None:
        """A recv node's gradient, owed to ``peer`` for send ``tag``, position ``index``
        (``None``: the node ran, and no gradient reached it)."""


class RecvBackward(torch.autograd.Function):
    """The graph node of a tensor received over RPC; backward returns its gradient to
    the sender, through the pass that is running."""

    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, received: torch.Tensor, origin: tuple[Any, ...]
    ) -> torch.Tensor:
        ctx.origin = origin
        ctx.set_materialize_grads(False)
        if received.layout is not torch.strided:
            # autograd views an input returned as is, and sparse tensors have no views:
            # return another tensor object over the same data.
            return received.detach()
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, None, None]:
        report(ctx, grad)  # (also None: the sender counts on hearing from it)
        return None, None, None


def report(node: Any, grad: torch.Tensor | None) -> None:
    """Give the collector of recv node ``node`` its gradient ``grad``."""
    collector, peer, context_id, tag, index, source = node.origin
    collector.collect(peer, context_id, tag, index, grad, source)


def is_leaf(node: Any) -> bool:
    """Whether ``node`` is the ``AccumulateGrad`` of a leaf tensor."""
    return getattr(node, "variable", None) is not None


def is_recv(node: Any) -> bool:
    """Whether ``node`` is a recv node (a tensor received over RPC)."""
    return getattr(node, "_forward_cls", None) is RecvBackward


def is_user_function(node: Any) -> bool:
    """Whether ``node`` runs Python code of a ``torch.autograd.Function`` other than
    rpcx's own: such code may start a backward pass of its own (a reentrant checkpoint)."""
    cls = getattr(node, "_forward_cls", None)
    return cls is not None and cls is not RecvBackward


def origin_of(node: Any) -> tuple[int, int]:
    """The message a recv node's tensor came in: ``(peer, send tag)``."""
    _collector, peer, _context_id, tag, _index, _source = node.origin
    return peer, tag
