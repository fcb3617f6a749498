"""The distributed backward pass on one worker: recv nodes, local passes, gradients.

Each tensor that requires grad and arrives in a call made inside a context becomes the
output of a :class:`_RecvBackward` node, which knows where the tensor came from (peer,
context, send tag, position). A *pass* runs torch's local autograd engine from some
tensors with given gradients; when the engine reaches a recv node, the node hands its
gradient to the pass's outbox, which the service sends back to the peer after the
local engine is done (one message per peer: ``AUTOGRAD_BACKWARD``, or
``AUTOGRAD_CHAIN`` when the pass hands a chain on).

The worker that called ``backward()`` drives the passes in rounds (see
:mod:`rpcx.autograd.service`): in each round every worker runs one pass from all the
gradients it received in the previous round, summed, so a part of the graph reached in
one round runs once, as in torch. A part reached in several rounds (by paths through
different numbers of calls) runs once per round; backward functions are linear in
their incoming gradient, so the sums are still torch's, and passes keep the graph
(``retain_graph=True``) until the context is released to allow it.

A recv node accepts a gradient only while a pass runs (:attr:`LocalEngine.active`), and a
CPU gradient only on that pass's own thread (torch runs CUDA nodes on its per-device
threads): a plain ``loss.backward()`` that reaches one raises and says to use
``rpcx.autograd.backward``; an edge recorded in another context drops its gradient,
which belongs to that context's own pass.

Leaves get their gradients in the context, not in ``.grad``: a pass runs torch's engine
normally (so ``AccumulateGrad`` and every hook on it run: DDP's all-reduce happens
here), then moves what landed in ``.grad`` into the context and puts back what was
there. Passes on one worker are serialized by the service's gradient lock so two
contexts never see each other's gradients.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["ActivePass", "Collector", "LocalEngine", "OnOutboxFull", "Outbox", "Pass",
           "find_leaves"]

log = logging.getLogger("rpcx.autograd")

# Gradients a pass owes its peers: rank -> [(send tag, index, gradient)]; a gradient
# bound for a device rather than the CPU travels as a ``Placed``.
Outbox = dict[int, list[tuple[int, int, Any]]]


class Collector(Protocol):
    """Where a recv node's gradient goes (the autograd service): it checks the gradient
    against the running pass and adds it to that pass's outbox."""

    def collect(self, peer: int, context_id: int, tag: int, index: int, grad: torch.Tensor,
                source: torch.device | None = None) -> None:
        """A recv node's gradient, owed to ``peer`` for send ``tag``, position ``index``."""


class _RecvBackward(torch.autograd.Function):
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
        if grad is not None:
            collector, peer, context_id, tag, index, source = ctx.origin
            collector.collect(peer, context_id, tag, index, grad, source)
        return None, None, None


def find_leaves(roots: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Every leaf tensor that requires grad and that a backward from ``roots`` can reach."""
    return _explore(roots)[0]


def _explore(roots: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """``find_leaves(roots)``, and how many recv nodes a backward from them can reach."""
    recvs = 0
    leaves: list[torch.Tensor] = []
    seen_leaves: set[int] = set()
    seen: set[Any] = set()
    stack: list[Any] = []
    for root in roots:
        if root.grad_fn is None:
            if root.requires_grad and id(root) not in seen_leaves:
                seen_leaves.add(id(root))
                leaves.append(root)
        else:
            stack.append(root.grad_fn)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad: the node of a leaf
            if id(variable) not in seen_leaves:
                seen_leaves.add(id(variable))
                leaves.append(variable)
            continue
        if getattr(node, "_forward_cls", None) is _RecvBackward:
            recvs += 1
        stack.extend(edge[0] for edge in node.next_functions)
    return leaves, recvs


# Leaf gradients (leaf, gradient), as run_pass returns them.
Grads = list[tuple[torch.Tensor, torch.Tensor]]
Pass = tuple[Grads, Grads, Outbox]
# Called from inside a pass with its outbox once every recv node the pass can reach has
# given its gradient: what the pass owes its peers is final, its local work may not be.
OnOutboxFull = Callable[[Outbox], None]


@dataclass
class ActivePass:
    """The pass running on a worker (:attr:`LocalEngine.active`): what recv nodes check."""

    thread: int
    context_id: int
    outbox: Outbox
    recvs_left: int  # recv nodes the pass can reach that have not given a gradient yet
    on_full: OnOutboxFull | None


class LocalEngine:
    """One worker's local side of distributed backward: the leaf every recv node hangs
    from, and the pass running now (:attr:`active`, which only :meth:`run_pass` sets).

    Recv nodes send their gradients to ``collector`` (the autograd service).
    """

    def __init__(self, collector: Collector) -> None:
        self._collector = collector
        # Every recv node hangs from this leaf, so that torch records the node at all.
        self.anchor = torch.empty(0, requires_grad=True)
        self._active: ActivePass | None = None

    @property
    def active(self) -> ActivePass | None:
        """The pass running on this worker now, or ``None``."""
        return self._active

    def make_recv(
        self,
        received: torch.Tensor,
        peer: int,
        context_id: int,
        tag: int,
        index: int,
        source: torch.device | None = None,
    ) -> torch.Tensor:
        """``received`` as the output of a recv node whose gradient goes back to ``peer``.

        ``source`` is the device the tensor was on at ``peer`` (``None`` for CPU); the
        gradient goes back there.
        """
        with torch.enable_grad():
            out: torch.Tensor = _RecvBackward.apply(  # type: ignore[no-untyped-call]
                self.anchor, received, (self._collector, peer, context_id, tag, index, source)
            )
        return out

    def run_pass(
        self,
        context_id: int,
        tensors: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        earlier: Sequence[torch.Tensor] = (),
        on_full: OnOutboxFull | None = None,
    ) -> Pass:
        """Run the local engine from ``tensors`` with ``grads``.

        Returns ``(found, rewritten, outbox)``: the gradients this pass produced for the
        leaves it reached, to be added to the context; the gradients written during the
        pass into leaves of ``earlier`` (leaves given gradients by earlier passes of this
        context) that it did not reach, which replace the context's; and the gradients
        owed to peers. ``.grad`` is left as it was.

        Only a hook can write a leaf's gradient without the pass reaching the leaf: DDP
        does, when the last of its buckets becomes ready in this pass, writing every
        parameter's all-reduced gradient, also of parameters an earlier pass reached (its
        bucket holds their gradients since). That written value is the whole gradient, so
        it replaces what the context has, as torch's DDP does to a torch context.

        ``on_full(outbox)`` runs on this thread, inside the engine, as soon as every recv
        node the pass can reach has given its gradient: the driver of a backward pass
        hands a chain on from there, so its peers work while its own engine still runs
        the rest (DDP's all-reduce, say). It never runs if a reachable recv node gives no
        gradient.

        The caller holds the service's ``grad_lock`` (taken with
        ``rpcx._pool.holding``), for the pass and for what it does with the result.
        """
        found_leaves, recvs = _explore(tensors)
        leaves = [leaf for leaf in found_leaves if leaf is not self.anchor]
        if earlier:
            reached = {id(leaf) for leaf in leaves}
            others = [leaf for leaf in earlier if id(leaf) not in reached]
        else:
            others = []
        saved = [leaf.grad for leaf in leaves]
        saved_others = [leaf.grad for leaf in others]
        for leaf in leaves:
            leaf.grad = None
        for leaf in others:
            leaf.grad = None
        outbox: Outbox = {}
        # (CPU nodes run on this thread, CUDA nodes on torch's device threads; recv
        # nodes check what they can, see AutogradService.collect.)
        self._active = ActivePass(threading.get_ident(), context_id, outbox, recvs, on_full)
        try:
            _run_torch_engine(tensors, grads)
        finally:
            self._active = None
            found = _take_grads(leaves, saved)
            rewritten = _take_grads(others, saved_others)
        return found, rewritten, outbox


def _run_torch_engine(tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """``torch.autograd.backward(tensors, grads, retain_graph=True)``, minus one step.

    ``torch.autograd.backward`` stashes the caller's ``contextvars`` context (a Python
    object) in a C++ thread-local for the length of the pass, so torch.compile's config
    reaches its device threads. Every collective that DDP's hooks start inside the pass
    captures that thread-local state, so gloo's worker thread must take the GIL to drop
    it when it retires the work. If the last reference to the process group goes
    meanwhile (a trainer returns right after its last step), the thread releasing it
    joins gloo's threads *holding* the GIL: the whole process freezes, timers included
    (docs/design/autograd.md, "Calling torch's engine"). So torch's engine is called
    directly, with ``backward()``'s own arguments and without the stash; where that
    entry point is missing (another torch), ``backward()`` itself runs.
    """
    engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
    run_backward = getattr(engine, "run_backward", None)
    if run_backward is None:
        torch.autograd.backward(list(tensors), list(grads), retain_graph=True)
        return
    # (tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable,
    # accumulate_grad): what torch.autograd.backward passes for these arguments.
    run_backward(tuple(tensors), tuple(grads), True, False, (), allow_unreachable=True,
                 accumulate_grad=True)


def _take_grads(leaves: Sequence[torch.Tensor], saved: Sequence[torch.Tensor | None]) -> Grads:
    """The gradients ``leaves`` hold now; each gets its ``saved`` gradient back."""
    taken: Grads = []
    for leaf, old in zip(leaves, saved, strict=True):
        grad = leaf.grad
        leaf.grad = old
        if grad is not None:
            # A gradient that is a view of some buffer (DDP's bucket views) would
            # change under us next iteration: keep a copy.
            taken.append((leaf, grad.clone() if grad._is_view() else grad))
    return taken
