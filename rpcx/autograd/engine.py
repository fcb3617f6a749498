"""The distributed backward pass on one worker: local passes, gradients.

Each tensor that requires grad and arrives in a call made inside a context becomes the
output of a recv node (:class:`rpcx.autograd.nodes.RecvBackward`), which knows where the
tensor came from (peer, context, send tag, position). A *pass* runs torch's local
autograd engine as a :class:`rpcx.autograd.schedule.Plan` says: from some nodes with
given gradients, through every node that no longer waits for a gradient from elsewhere.
A recv node's gradient goes to the pass's outbox, which the service sends back to the
peer after the local engine is done (one message per peer: ``AUTOGRAD_BACKWARD``, or
``AUTOGRAD_CHAIN`` when the pass hands a chain on).

A plan runs in one of two ways:

- in one piece, as ``Tensor.backward()`` would run it: the engine runs every node the
  roots reach, recv nodes report their gradients as they run;
- *split*, when part of the graph must wait (a node that will get more gradients in a
  later pass) or user ``torch.autograd.Function`` code takes part: first torch's
  ``autograd.grad`` captures the gradients of the plan's leaves, recv nodes and
  frontier slots without running those nodes, then a second run accumulates the
  leaves' gradients through their ``AccumulateGrad`` nodes (their hooks, DDP's
  all-reduce, run there). The first run writes no ``.grad``, so a backward that user
  code runs inside it (a reentrant checkpoint) leaves its leaf gradients in ``.grad``,
  as torch does.

A recv node accepts a gradient only while a pass runs (:attr:`LocalEngine.active`), and a
CPU gradient only on that pass's own thread (torch runs CUDA nodes on its per-device
threads): a plain ``loss.backward()`` that reaches one raises and says to use
``rpcx.autograd.backward``; an edge recorded in another context drops its gradient,
which belongs to that context's own pass.

Leaves get their gradients in the context, not in ``.grad``: the pass lets torch's
``AccumulateGrad`` write ``.grad`` (so every hook on it runs: DDP's all-reduce happens
here), then moves what landed there into the context and puts back what was there.
Passes on one worker are serialized by the service's gradient lock so two contexts
never see each other's gradients.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from rpcx.autograd.nodes import Collector, RecvBackward
from rpcx.autograd.schedule import Outbox, Plan, slot_of

__all__ = ["ActivePass", "LocalEngine", "OnOutboxFull", "Pass"]

log = logging.getLogger("rpcx.autograd")

# Leaf gradients (leaf, gradient), as run_plan returns them.
Grads = list[tuple[torch.Tensor, torch.Tensor]]
# run_plan's result: found, rewritten, outbox, and the gradients captured at the plan's
# frontier (in its order; None where nothing arrived).
Pass = tuple[Grads, Grads, Outbox, list[torch.Tensor | None]]
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
    """One worker's local side of distributed backward: recv nodes, and the pass running
    now (:attr:`active`, which only :meth:`run_plan` sets).

    Recv nodes send their gradients to ``collector`` (the autograd service).
    """

    def __init__(self, collector: Collector) -> None:
        self._collector = collector
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
        # The node hangs from a leaf of its own (torch records a Function in the graph
        # only when an input requires grad), so that a pass can ask the engine to run
        # exactly the recv nodes it reaches: those whose anchors it captures.
        anchor = torch.empty(0, requires_grad=True)
        with torch.enable_grad():
            out: torch.Tensor = RecvBackward.apply(  # type: ignore[no-untyped-call]
                anchor, received, (self._collector, peer, context_id, tag, index, source)
            )
        return out

    def run_plan(
        self,
        context_id: int,
        plan: Plan,
        earlier: Sequence[torch.Tensor] = (),
        on_full: OnOutboxFull | None = None,
    ) -> Pass:
        """Run ``plan``'s pass of context ``context_id``.

        Returns ``(found, rewritten, outbox, captured)``: the gradients this pass
        produced for the leaves it reached, to be added to the context; the gradients
        written during the pass into leaves of ``earlier`` (leaves given gradients by
        earlier passes of this context) that it did not reach, which replace the
        context's; the gradients owed to peers; and those captured at the plan's
        frontier. ``.grad`` is left as it was.

        Only a hook can write a leaf's gradient without the pass reaching the leaf: DDP
        does, when the last of its buckets becomes ready in this pass, writing every
        parameter's all-reduced gradient, also of parameters an earlier pass reached (its
        bucket holds their gradients since). That written value is the whole gradient, so
        it replaces what the context has, as torch's DDP does to a torch context.

        ``on_full(outbox)`` runs on this thread as soon as every recv node the pass
        reaches has given its gradient (inside the engine, or between the two runs of a
        split plan): the driver of a backward pass hands a chain on from there, so its
        peers work while its own engine still runs the rest (DDP's all-reduce, say). It
        never runs if a reachable recv node gives no gradient.

        The caller holds the service's ``grad_lock`` (taken with
        ``rpcx._util.pool.holding``), for the pass and for what it does with the result.
        """
        leaves = plan.leaves
        if earlier:
            reached = {id(leaf) for leaf in leaves}
            others = [leaf for leaf in earlier if id(leaf) not in reached]
        else:
            others = []
        outbox: Outbox = {}
        # (CPU nodes run on this thread, CUDA nodes on torch's device threads; recv
        # nodes check what they can, see AutogradService.collect.)
        self._active = ActivePass(threading.get_ident(), context_id, outbox, len(plan.recvs),
                                  on_full if plan.final else None)
        try:
            if plan.split:
                leaf_grads, captured = _capture(plan)
                roots = [leaf for leaf, grad in zip(leaves, leaf_grads, strict=True)
                         if grad is not None]
                grads = [grad for grad in leaf_grads if grad is not None]
                # (The leaves' tensor hooks ran at the capture: not again.)
                with _staged(leaves, others) as found, _silenced_tensor_hooks(roots):
                    _run_torch_engine(roots, grads)
                return found[0], found[1], outbox, captured
            with _staged(leaves, others, nested=plan.guarded) as found:
                if plan.guarded:
                    # Listing what it reaches makes it torch's own kind of run: a
                    # reentrant checkpoint refuses, as under torch's distributed engine.
                    _run_torch_engine(plan.roots, plan.grads,
                                      (*leaves, *_anchors(plan.recvs)),
                                      accumulate=True, first=_first_nodes(plan.roots))
                elif plan.roots:
                    _run_torch_engine(plan.roots, plan.grads)
            return found[0], found[1], outbox, []
        finally:
            self._active = None


@contextlib.contextmanager
def _staged(
    leaves: Sequence[torch.Tensor], others: Sequence[torch.Tensor], nested: bool = False
) -> Iterator[list[Grads]]:
    """``.grad`` as the staging area of the run inside: yields ``[found, rewritten]``,
    filled on the way out with what landed in the ``.grad`` of ``leaves`` and ``others``,
    each given its old ``.grad`` back.

    ``nested``: a backward that user code runs inside the run (a reentrant checkpoint)
    keeps the gradients it gives these leaves in ``.grad``, as under torch's distributed
    engine, instead of in the context: their ``AccumulateGrad`` nodes get a pre-hook
    that takes what another graph task than the run's own brings them.
    """
    saved = [leaf.grad for leaf in leaves]
    saved_others = [leaf.grad for leaf in others]
    for leaf in leaves:
        leaf.grad = None
    for leaf in others:
        leaf.grad = None
    result: list[Grads] = [[], []]
    diverted: dict[int, torch.Tensor] = {}
    handles = _divert_nested([*leaves, *others], diverted) if nested else []
    try:
        yield result
    finally:
        for handle in handles:
            handle.remove()
        result[0] = _take_grads(leaves, saved)
        result[1] = _take_grads(others, saved_others)
        for leaf in [*leaves, *others]:
            grad = diverted.get(id(leaf))
            if grad is not None:
                leaf.grad = grad if leaf.grad is None else leaf.grad + grad


# The graph task of the run in progress on this thread (see _run_torch_engine's first).
_runs = threading.local()


def _divert_nested(leaves: Sequence[torch.Tensor], diverted: dict[int, torch.Tensor]) -> list[Any]:
    handles = []
    for leaf in leaves:
        def divert(grad_outputs: Sequence[torch.Tensor | None],
                   key: int = id(leaf)) -> tuple[None, ...] | None:
            outer = getattr(_runs, "task", None)
            if outer is None or torch._C._current_graph_task_id() == outer:
                return None  # the run's own gradient: accumulate it
            grad = grad_outputs[0]
            if grad is not None:
                old = diverted.get(key)
                diverted[key] = grad if old is None else old + grad
            return (None,)
        handles.append(slot_of(leaf)[0].register_prehook(divert))
    return handles


@contextlib.contextmanager
def _silenced_tensor_hooks(leaves: Sequence[torch.Tensor]) -> Iterator[None]:
    """Empty the ``register_hook`` hooks of ``leaves`` for the run inside (torch reads the
    same dict when it runs them)."""
    silenced = []
    for leaf in leaves:
        hooks = leaf._backward_hooks
        if hooks:
            silenced.append((hooks, dict(hooks)))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, kept in silenced:
            hooks.update(kept)


def _first_nodes(roots: Sequence[Any]) -> list[Any]:
    """The nodes a run from ``roots`` starts with (leaf roots aside)."""
    nodes = []
    for root in roots:
        node = root.node if isinstance(root, GradientEdge) else root.grad_fn
        if node is not None:
            nodes.append(node)
    return nodes


def _capture(plan: Plan) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """The first run of a split plan: the gradients of its leaves and frontier slots,
    captured without running their nodes, and without writing any ``.grad``.

    The plan's recv nodes run (the run captures their anchors' gradients, which are
    nothing), so each gives its gradient as it runs, as in a whole run: what the engine
    runs after them (callbacks queued for the end of the run, such as DDP's wait) may
    need a peer's pass to have started. A node of the frontier may still run, when the
    engine needs it to reach another frontier slot below it; its pre-hook then hands it
    no gradient, so it computes nothing (it runs for real, once, in the pass in which
    it is ready).
    """
    # (A leaf tensor stands for its AccumulateGrad node, as a root or an input.)
    inputs: list[Any] = [*plan.leaves, *_anchors(plan.recvs)]
    inputs += [GradientEdge(node, nr) for node, nr in plan.frontier]
    handles = [node.register_prehook(_no_gradient) for node in plan.waiting]
    try:
        captured = list(_run_torch_engine(plan.roots, plan.grads, inputs))
    finally:
        for handle in handles:
            handle.remove()
    nl, na = len(plan.leaves), len(plan.recvs)
    return captured[:nl], captured[nl + na:]


def _anchors(recvs: Sequence[Any]) -> list[GradientEdge]:
    """The inputs that make the engine run ``recvs``: their anchors' AccumulateGrad."""
    return [GradientEdge(node.next_functions[0][0], 0) for node in recvs]


def _no_gradient(grad_outputs: Sequence[torch.Tensor | None]) -> tuple[None, ...]:
    return tuple(None for _ in grad_outputs)


def _run_torch_engine(
    roots: Sequence[Any], grads: Sequence[torch.Tensor], inputs: Sequence[Any] = (),
    accumulate: bool = False, first: Sequence[Any] = (),
) -> Sequence[torch.Tensor | None]:
    """``torch.autograd.backward(roots, grads, retain_graph=True)``, minus one step; with
    ``inputs``, ``torch.autograd.grad(roots, inputs, grads, retain_graph=True,
    allow_unused=True)`` instead, or with ``accumulate`` too, ``backward(...,
    inputs=inputs)``. While the run's ``first`` nodes start, they note its graph task
    (``_runs.task``) for the hooks of :func:`_divert_nested`.

    ``torch.autograd.backward`` stashes the caller's ``contextvars`` context (a Python
    object) in a C++ thread-local for the length of the pass, so torch.compile's config
    reaches its device threads. Every collective that DDP's hooks start inside the pass
    captures that thread-local state, so gloo's worker thread must take the GIL to drop
    it when it retires the work. If the last reference to the process group goes
    meanwhile (a trainer returns right after its last step), the thread releasing it
    joins gloo's threads *holding* the GIL: the whole process freezes, timers included
    (docs/design/autograd.md, "Calling torch's engine"). So torch's engine is called
    directly, with ``backward()``'s own arguments and without the stash; where that
    entry point is missing (another torch), ``backward()`` or ``grad()`` itself runs.
    """
    handles = [node.register_prehook(_note_task) for node in first]
    try:
        engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
        run_backward = getattr(engine, "run_backward", None)
        if run_backward is None:
            if inputs and not accumulate:
                return torch.autograd.grad(list(roots), list(inputs), list(grads),
                                           retain_graph=True, allow_unused=True)
            torch.autograd.backward(list(roots), list(grads), retain_graph=True,
                                    inputs=list(inputs) or None)
            return ()
        # (tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable,
        # accumulate_grad): what torch.autograd.backward and grad pass for these.
        result: Sequence[torch.Tensor | None] = run_backward(
            tuple(roots), tuple(grads), True, False, tuple(inputs), allow_unreachable=True,
            accumulate_grad=accumulate or not inputs)
        return result
    finally:
        for handle in handles:
            handle.remove()
        _runs.task = None


def _note_task(grad_outputs: Sequence[torch.Tensor | None]) -> None:
    if getattr(_runs, "task", None) is None:
        _runs.task = torch._C._current_graph_task_id()


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
