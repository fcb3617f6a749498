"""One worker's share of one distributed backward pass: what was delivered to it, what
waits, and the plan of each of its passes.

A backward pass is named by the worker that drives it and a number it draws
(:data:`BackwardId`); every message of the pass carries that name, so two backward
passes of one context (``retain_graph=True``) never mix their gradients. The first pass
of a share that brings every start at once (every send tag of the context that the
worker sent, and the roots on the driver) runs as one whole; otherwise the share keeps a
:class:`rpcx.autograd.schedule.Schedule` until every start has arrived, so that each
node runs once. Gradients that reach a share after that (a start that arrives a second
time, after a flush) run on their own, as a whole.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rpcx.autograd.schedule import Outbox, Plan, Schedule, plan_whole
from rpcx.errors import RpcError

__all__ = ["ROOTS", "BackwardId", "Share"]

# A backward pass: (the rank of the worker that drives it, a number it drew).
BackwardId = tuple[int, int]
# The start key of the driver's roots (send tags are ints).
ROOTS = "roots"


@dataclass(eq=False)
class Share:
    """This worker's part in one backward pass (see the module's notes).

    Attributes:
        backward: the backward pass.
        pending: gradients delivered for tensors this worker sent, by (send tag, index),
            summed, waiting for this worker's next pass.
    """

    backward: BackwardId
    pending: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)
    _schedule: Schedule | None = None
    _started: bool = False

    @property
    def holds(self) -> bool:
        """Whether gradients wait here for others that have not arrived."""
        return self._schedule is not None and self._schedule.holds

    def deliver(self, tag: int, index: int, grad: torch.Tensor | None) -> None:
        """Add a gradient for tensor ``index`` of send ``tag`` (``None``: the receiver's
        node ran and no gradient reached it); the caller holds the context's lock."""
        old = self.pending.get((tag, index))
        if grad is None:
            self.pending[(tag, index)] = old
        else:
            self.pending[(tag, index)] = grad if old is None else old + grad

    def plans(
        self,
        sends: Mapping[Any, Sequence[torch.Tensor]],
        pending: Mapping[tuple[int, int], torch.Tensor | None],
        roots: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
        flush: bool = False,
        where: str = "",
    ) -> list[tuple[Plan, bool]]:
        """The runs of this worker's next pass, from ``pending`` (and ``roots`` with
        their gradients, on the driver's first pass), each with whether it is the
        schedule's (:meth:`settle` it). ``flush``: nothing more will arrive."""
        arrivals: dict[Hashable, list[torch.Tensor | None]] = {}
        for (tag, index), grad in pending.items():
            sent = sends.get(tag)
            if sent is None or index >= len(sent):
                raise RpcError(f"{where} has no tensor {index} of send {tag} to take a "
                               "gradient for")
            arrivals.setdefault(tag, [None] * len(sent))[index] = grad
        starts: dict[Hashable, Sequence[torch.Tensor]] = {}
        if roots is not None:
            starts[ROOTS] = roots[0]
            arrivals[ROOTS] = list(roots[1])
        if not self._started:
            self._started = True
            starts.update(sends)
            if not flush and all(key in arrivals for key in starts):
                return [(_whole(starts, arrivals), False)]
            self._schedule = Schedule(starts)
        schedule = self._schedule
        if schedule is None:  # every start arrived before: these run as they are
            return [(_whole({**sends, **starts}, arrivals), False)] if arrivals else []
        late: dict[Hashable, list[torch.Tensor | None]] = {}
        for key, grads in arrivals.items():
            if schedule.awaits(key):
                schedule.arrive(key, grads)
            else:
                late[key] = grads
        if flush:
            schedule.flush()
        runs = [(schedule.plan(), True)]
        if late:
            runs.append((_whole({**sends, **starts}, late), False))
        return runs

    def settle(self, plan: Plan, captured: Sequence[torch.Tensor | None],
               outbox: Outbox) -> Outbox:
        """After the schedule's ``plan`` ran: hold what it captured, and return what to
        send of ``outbox`` (the rest waits for the message's other gradients)."""
        schedule = self._schedule
        assert schedule is not None
        schedule.hold(plan, captured)
        send = schedule.settle(plan, outbox)
        if schedule.done:
            self._schedule = None
        return send


def _whole(starts: Mapping[Hashable, Sequence[torch.Tensor]],
           arrivals: Mapping[Hashable, Sequence[torch.Tensor | None]]) -> Plan:
    tensors: list[Any] = []
    grads: list[torch.Tensor] = []
    for key, given in arrivals.items():
        for tensor, grad in zip(starts[key], given, strict=True):
            if grad is not None:
                tensors.append(tensor)
                grads.append(grad)
    return plan_whole(tensors, grads)
