"""One distributed autograd context as one worker holds it: what it sent, who it met,
its leaves' gradients, and its part in each backward pass of the context."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rpcx.autograd.share import BackwardId, Share

__all__ = ["AutogradContext"]


@dataclass(eq=False)
class AutogradContext:
    """One distributed autograd context on one worker.

    Attributes:
        id: unique across the world.
        sends: per send tag, the tensors (requiring grad) sent in that message, in order.
        peers: ranks this worker exchanged messages with inside the context.
        grads: gradients accumulated for this worker's leaves, by tensor.
        finished_roots: graph nodes of roots already run without ``retain_graph``.
        shares: this worker's part in each backward pass of the context that reached it,
            by backward pass (rpcx.autograd.share).
        forwarded: chains this worker handed on, as (peer, driver, token).
    """

    id: int
    sends: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    peers: set[int] = field(default_factory=set)
    grads: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    finished_roots: set[Any] = field(default_factory=set)
    shares: dict[BackwardId, Share] = field(default_factory=dict)
    forwarded: set[tuple[int, int, int]] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def accumulate(
        self,
        found: Sequence[tuple[torch.Tensor, torch.Tensor]],
        rewritten: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> None:
        """Add a pass's leaf gradients; ``rewritten`` ones replace (see ``run_pass``)."""
        with self.lock:
            for leaf, grad in found:
                old = self.grads.get(leaf)
                self.grads[leaf] = grad if old is None else old + grad
            for leaf, grad in rewritten:
                self.grads[leaf] = grad

    def share(self, backward: BackwardId) -> Share:
        """This worker's share of backward pass ``backward``, made at its first use."""
        with self.lock:
            share = self.shares.get(backward)
            if share is None:
                share = self.shares[backward] = Share(backward)
            return share

    def forget_share(self, backward: BackwardId) -> None:
        """Drop the share of a backward pass that ended (on its driver)."""
        with self.lock:
            self.shares.pop(backward, None)

    def leaves(self) -> list[torch.Tensor]:
        """The leaves that have gradients in this context so far."""
        with self.lock:
            return list(self.grads)
