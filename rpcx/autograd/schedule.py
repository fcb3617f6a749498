"""What one local pass of a distributed backward runs: torch's dependency counts, kept
from pass to pass.

In torch's FAST mode the first gradient a worker receives for a backward pass creates
one ``GraphTask`` on that worker, whose dependencies are counted from the roots and from
*every* send function of the context; gradients that arrive later join it, so a node
runs once, when the last gradient it waits for is in, with their sum. rpcx runs a
worker's share of a backward pass as several runs of torch's engine, one per round in
which gradients reach the worker (:mod:`rpcx.autograd.service`), so it keeps those
counts itself, in a :class:`Schedule` that lives from the worker's first pass of that
backward to its last:

- *Starts* are the send tags of the context (each the tensors sent in one message) and,
  on the worker that called ``backward()``, the roots. The schedule walks the graph from
  every start and counts, for each node, the edges that reach it.
- A start *arrives* when a pass brings its gradients: each goes to its tensor's node
  (summed per input and held), and that node has one edge fewer to wait for.
- :meth:`Schedule.plan` finds the nodes whose count fell to zero and, from them, every
  node all of whose edges are now accounted for: the pass runs exactly those, each
  once. An edge from a node the pass runs into one that still waits is a *frontier
  slot*: the pass captures the gradient there instead of running the node, and the
  schedule holds it for the pass in which that node is ready.
- Gradients owed for one message (the recv nodes of one ``(peer, send tag)``) leave
  together, once every recv node of that message that the worker's starts can reach has
  run (:meth:`Schedule.settle`); indices that got no gradient travel as nothing. So a
  sender sees each message's gradients arrive once, as torch's RecvRpcBackward sends
  one message per message received.

A start whose gradients never come (an output of its own message that nothing used)
would keep nodes waiting forever; torch's FAST mode assumes that never happens (its
backward waits for every send function). rpcx's driver knows when nothing else can
arrive, and *flushes* the workers still holding gradients (:meth:`Schedule.flush`): each
runs what it holds as if every start were in.

The first pass of a worker that brings every start at once needs none of this:
:func:`plan_whole` plans it from one walk of the graph, and the engine runs it in one
piece, as before.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from rpcx.autograd.nodes import is_leaf, is_recv, is_user_function, origin_of

__all__ = ["Outbox", "Plan", "Schedule", "plan_whole", "slot_of"]

# Gradients a pass owes its peers: rank -> [(send tag, index, gradient)]; a gradient
# bound for a device rather than the CPU travels as a ``Placed``.
Outbox = dict[int, list[tuple[int, int, Any]]]
# An input of a node: (node, input number), torch's GradientEdge.
Slot = tuple[Any, int]
# The message a recv node's tensor came in: (peer, send tag).
Message = tuple[int, int]


@dataclass(eq=False)
class Plan:
    """One run of torch's engine: from ``roots`` (tensors or ``GradientEdge``) with
    ``grads``.

    Attributes:
        leaves: leaf tensors the run gives gradients to.
        recvs: recv nodes the run reaches.
        frontier: slots whose gradient the run captures instead of running their node.
        waiting: the frontier's inner nodes (neither leaves nor recv nodes); the engine
            may have to run one to reach another frontier slot below it, and it must
            then compute nothing (see ``LocalEngine.run_plan``).
        split: there is a frontier: capture the gradients of the leaves and of the
            frontier slots first (torch's ``autograd.grad``), then accumulate the
            leaves' in a second run.
        guarded: ``torch.autograd.Function`` code runs: it may run a backward of its
            own, whose leaf gradients must stay in ``.grad``, and a reentrant checkpoint
            must refuse to run, both as under torch's distributed engine.
        final: what the run owes its peers is final once its recv nodes have given their
            gradients (no message of theirs waits for a later pass).
    """

    roots: list[Any]
    grads: list[torch.Tensor]
    leaves: list[torch.Tensor]
    recvs: list[Any]
    frontier: list[Slot] = field(default_factory=list)
    waiting: list[Any] = field(default_factory=list)
    split: bool = False
    guarded: bool = False
    final: bool = True
    messages: list[Message] = field(default_factory=list)  # messages whose recv nodes ran


def plan_whole(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> Plan:
    """A run from ``roots`` through everything they reach (nothing waits elsewhere)."""
    leaves: list[torch.Tensor] = []
    recvs: list[Any] = []
    seen_leaves: set[int] = set()
    seen: set[Any] = set()
    stack: list[Any] = []
    functions = False
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
        if is_recv(node):  # (its one edge leads to its anchor leaf, not a gradient's)
            recvs.append(node)
            continue
        functions = functions or is_user_function(node)
        stack.extend(edge[0] for edge in node.next_functions)
    return Plan(list(roots), list(grads), leaves, recvs, guarded=functions)


class Schedule:
    """One worker's dependency counts for one backward pass (see the module's notes).

    ``starts`` maps each start's key (a send tag, or any key for the roots) to its
    tensors, in order. Not thread-safe: the service calls it under its gradient lock.
    """

    def __init__(self, starts: Mapping[Hashable, Sequence[torch.Tensor]]) -> None:
        self._slots: dict[Hashable, list[Slot]] = {}  # starts that have not arrived
        self._remaining: dict[Any, int] = {}  # edges each node still waits for
        self._edges: dict[Any, list[Slot]] = {}  # each inner node's edges
        self._recvs_left: dict[Message, int] = {}  # recv nodes of a message not run yet
        self._held: dict[Any, dict[int, torch.Tensor]] = {}  # gradients waiting at nodes
        self._owed: dict[Message, list[tuple[int, int, Any]]] = {}  # held outbox items
        self._ready: list[Any] = []
        stack: list[Any] = []
        for key, tensors in starts.items():
            slots = []
            for tensor in tensors:
                slot = slot_of(tensor)
                slots.append(slot)
                self._count(slot[0], stack)
            self._slots[key] = slots
        while stack:
            node = stack.pop()
            if is_leaf(node):
                continue
            if is_recv(node):
                message = origin_of(node)
                self._recvs_left[message] = self._recvs_left.get(message, 0) + 1
                continue
            edges = [(child, nr) for child, nr in node.next_functions if child is not None]
            self._edges[node] = edges
            for child, _nr in edges:
                self._count(child, stack)

    def _count(self, node: Any, stack: list[Any]) -> None:
        count = self._remaining.get(node)
        if count is None:
            self._remaining[node] = 1
            stack.append(node)
        else:
            self._remaining[node] = count + 1

    @property
    def holds(self) -> bool:
        """Whether gradients wait here for starts that have not arrived."""
        return bool(self._held or self._owed)

    @property
    def done(self) -> bool:
        """Whether every start has arrived and nothing waits any more."""
        return not self._slots and not self._held and not self._owed

    def awaits(self, key: Hashable) -> bool:
        """Whether ``key`` is a start that has not arrived yet."""
        return key in self._slots

    def arrive(self, key: Hashable, grads: Sequence[torch.Tensor | None]) -> None:
        """Start ``key`` brings ``grads``, one per tensor (``None``: no gradient)."""
        slots = self._slots.pop(key)
        for (node, nr), grad in zip(slots, grads, strict=True):
            if grad is not None:
                self._hold(node, nr, grad)
            self._release(node, self._ready)

    def flush(self) -> None:
        """Nothing more will arrive: every start not in yet arrives without gradients."""
        for key in list(self._slots):
            self.arrive(key, [None] * len(self._slots[key]))

    def _hold(self, node: Any, nr: int, grad: torch.Tensor) -> None:
        inputs = self._held.setdefault(node, {})
        old = inputs.get(nr)
        inputs[nr] = grad if old is None else old + grad

    def _release(self, node: Any, ready: list[Any]) -> None:
        count = self._remaining[node] - 1
        self._remaining[node] = count
        if count == 0:
            ready.append(node)

    def plan(self) -> Plan:
        """The run of this pass: every node that no longer waits, once."""
        ready, self._ready = self._ready, []
        live: set[Any] = set()  # nodes a running node gives a gradient to
        i = 0
        while i < len(ready):  # (grows: torch's dependency count, in order)
            node = ready[i]
            i += 1
            del self._remaining[node]
            running = node in self._held or node in live
            for child, _nr in self._edges.get(node, ()):
                if running:
                    live.add(child)
                self._release(child, ready)
        plan = Plan([], [], [], [], split=False)
        frontier: dict[Slot, None] = {}
        for node in ready:
            held = self._held.pop(node, None)
            if held is not None:
                for nr, grad in held.items():
                    plan.roots.append(GradientEdge(node, nr))
                    plan.grads.append(grad)
            # A node no gradient reaches does not run (torch's engine never sees it),
            # but the edges it would have given still count as given.
            running = held is not None or node in live
            if is_leaf(node):
                if running:
                    plan.leaves.append(node.variable)
                continue
            if is_recv(node):
                message = origin_of(node)
                self._recvs_left[message] -= 1
                plan.messages.append(message)
                if running:
                    plan.recvs.append(node)
                continue
            if not running:
                continue
            plan.guarded = plan.guarded or is_user_function(node)
            for child, nr in self._edges[node]:
                # A child that waits for more: capture its gradient, hold it.
                if child in self._remaining and (child, nr) not in frontier:
                    frontier[(child, nr)] = None
                    if child in self._edges and child not in plan.waiting:
                        plan.waiting.append(child)
        plan.frontier = list(frontier)
        plan.split = bool(frontier)
        plan.final = not any(self._recvs_left[m] or m in self._owed for m in plan.messages)
        return plan

    def hold(self, plan: Plan, captured: Iterable[torch.Tensor | None]) -> None:
        """Keep the gradients ``plan``'s run captured at its frontier."""
        for (node, nr), grad in zip(plan.frontier, captured, strict=True):
            if grad is not None:
                self._hold(node, nr, grad)

    def settle(self, plan: Plan, outbox: Outbox) -> Outbox:
        """What to send after ``plan``'s run: each message's gradients once all of its
        recv nodes have run; the others stay owed until then."""
        send: Outbox = {}
        for peer, items in outbox.items():
            for item in items:
                message = (peer, item[0])
                if self._recvs_left.get(message, 0) > 0:
                    self._owed.setdefault(message, []).append(item)
                else:
                    send.setdefault(peer, []).append(item)
        for message in plan.messages:
            if not self._recvs_left[message] and message in self._owed:
                send.setdefault(message[0], []).extend(self._owed.pop(message))
        return send


def slot_of(tensor: torch.Tensor) -> Slot:
    """The node input ``tensor``'s gradient goes to: its ``grad_fn``'s, or for a leaf
    its ``AccumulateGrad``."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn, tensor.output_nr
    if tensor.layout is torch.strided:
        edge = get_gradient_edge(tensor)
        return edge.node, edge.output_nr
    # (get_gradient_edge goes through a view, which sparse tensors do not have.)
    with torch.enable_grad():
        node = (tensor * 1).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
    return node, 0
