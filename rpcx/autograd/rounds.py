"""The rounds of a distributed backward pass, as one worker takes part in them: the
driver's loop, a worker's pass of a round, the chains that carry a round from worker to
worker, and the messages between them (``AUTOGRAD_BACKWARD``, ``AUTOGRAD_RUN``,
``AUTOGRAD_CHAIN``, ``AUTOGRAD_CHAIN_END``).

The comment above :meth:`Rounds.start` tells how a pass runs in rounds;
docs/design/autograd.md tells the whole story.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rpcx._core.service_host import CallLabel, ServiceHost
from rpcx._util.pool import holding
from rpcx._wire.codec import Placed
from rpcx.autograd.context import AutogradContext
from rpcx.autograd.engine import LocalEngine, OnOutboxFull
from rpcx.autograd.schedule import Outbox
from rpcx.autograd.share import BackwardId, Share
from rpcx.errors import PeerLostError, RemoteErrorInfo, RpcTimeoutError
from rpcx.futures import RpcFuture, wait, wait_done
from rpcx.messages import MessageKind
from rpcx.worker import WorkerInfo

__all__ = ["Chain", "Report", "Rounds"]

log = logging.getLogger("rpcx.autograd")

# A chain of passes (see Rounds.start): the driver's rank and its token.
Chain = tuple[int, int]
# What a round tells the driver: the ranks of the next round, then (rank, holds) for
# each pass that ran, in order: whether that worker holds gradients that wait.
Report = tuple[set[int], list[tuple[int, bool]]]


class Rounds:
    """The backward passes this worker drives or takes part in.

    Args:
        agent: the worker.
        get: the context of an id (raises if this worker lacks it).
        engine: runs the local passes.
        grad_lock: one local pass at a time on this worker.
    """

    def __init__(self, agent: ServiceHost, get: Callable[[int], AutogradContext],
                 engine: LocalEngine, grad_lock: threading.RLock) -> None:
        self.agent = agent
        self.get = get
        self.engine = engine
        self.grad_lock = grad_lock
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._backwards = itertools.count(1)  # the backward passes this worker drives
        # Chains this worker drives, by token: (context id, future of the next round).
        self._chains: dict[int, tuple[int, RpcFuture[Report]]] = {}
        self.passes = 0  # local passes run here, ever (debug_info shows it)

    def on_peer_lost(self, contexts: Sequence[AutogradContext], rank: int) -> None:
        """Worker ``rank`` is gone: fail the chains this worker handed to it."""
        for context in contexts:
            with context.lock:
                lost = [(d, t) for (peer, d, t) in context.forwarded if peer == rank]
                context.forwarded.difference_update((rank, d, t) for d, t in lost)
            for chain in lost:
                lost_error = self.agent.lost_error(
                    rank, f"dist_autograd.backward(context {context.id})"
                )
                self._end_chain(chain, None, PeerLostError(
                    f"{lost_error}; worker {self.agent.name!r} had sent it the chain of passes"
                ))

    # A distributed backward pass runs in rounds, driven by the worker that called
    # backward(). In each round every worker holding gradients runs ONE local pass from
    # all of them (summed per sent tensor) and delivers the gradients it produces to
    # their senders, where they wait for the next round. Within a pass, each worker runs
    # only what no longer waits for gradients from elsewhere (its share's schedule,
    # rpcx.autograd.schedule): a node reached by paths through different numbers of
    # calls runs once, in the round its last gradient arrives in, as in torch's engine.
    # The number of rounds is bounded by the longest path, not the number of paths.
    #
    # A round with a single worker is a chain: when that worker's pass delivers to a
    # single peer, no other gradient can join that peer's next round, so it forwards
    # the gradients one way (AUTOGRAD_CHAIN) and the peer runs at once. The chain goes
    # on from worker to worker with no thread waiting anywhere but on the driver; the
    # worker where it ends reports to the driver (AUTOGRAD_CHAIN_END) with the ranks of
    # the next round, or the error. The common pipeline shape costs one message per
    # hop plus one.
    #
    # Every pass reports whether its worker still holds gradients that wait (a Report:
    # the next round's ranks, then (rank, holds) pairs in the order the passes ran).
    # When no round is left and some worker still holds, nothing more can reach it (a
    # start whose gradient never comes: torch's FAST mode would wait forever); the
    # driver flushes those workers, which run what they hold.

    def start(
        self, context: AutogradContext, roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> None:
        """Run the distributed backward pass from ``roots``; return when it is done."""
        backward = (self.agent.rank, next(self._backwards))
        share = context.share(backward)
        try:
            report = self._sole_round(context, functools.partial(
                self._advance, context, share, roots=(list(roots), list(grads)), early=True
            ))
            holding: dict[int, bool] = {}
            while True:
                ranks, holders = report
                holding.update(holders)
                flush = False
                if not ranks:
                    holding[self.agent.rank] = share.holds  # (no pass runs now)
                    ranks = {rank for rank, holds in holding.items() if holds}
                    if not ranks:
                        return
                    flush = True
                if len(ranks) == 1:
                    (rank,) = ranks
                    report = self._sole_round(context, functools.partial(
                        self._run_round, context, backward, rank, flush=flush))
                else:
                    report = self._wide_round(context, backward, ranks, flush)
        finally:
            context.forget_share(backward)

    def _sole_round(
        self, context: AutogradContext, run: Callable[[Chain], Report | None]
    ) -> Report:
        """A round of one worker, which may become a chain: ``run(chain)`` starts it and
        returns the report of the round, or ``None`` when the chain went on to another
        worker."""
        token = next(self._tokens)
        done: RpcFuture[Report] = RpcFuture()
        with self._lock:
            self._chains[token] = (context.id, done)
        try:
            report = run((self.agent.rank, token))
            if report is not None:
                return report
            timeout = self.agent.timeout_for(None)
            if not wait_done(done, timeout):
                raise RpcTimeoutError(
                    f"dist_autograd.backward(context {context.id}) on worker "
                    f"{self.agent.name!r}: the chain of passes it started did not finish "
                    f"within {timeout:g} s (rpc_timeout)"
                )
            result: Report = wait(done)
            return result
        finally:
            with self._lock:
                self._chains.pop(token, None)

    def _run_round(self, context: AutogradContext, backward: BackwardId, rank: int,
                   chain: Chain, flush: bool = False) -> Report | None:
        """Start a sole round on ``rank``: here, or with an ``AUTOGRAD_RUN``."""
        if rank == self.agent.rank:
            return self._advance(context, context.share(backward), chain, early=True,
                                 flush=flush)
        return _report(wait(self._request_run(context, backward, rank, chain, flush)))

    def _wide_round(self, context: AutogradContext, backward: BackwardId, ranks: set[int],
                    flush: bool) -> Report:
        """A round of several workers: each runs its pass and delivers, then replies."""
        futures = [self._request_run(context, backward, rank, None, flush)
                   for rank in sorted(ranks) if rank != self.agent.rank]
        following: set[int] = set()
        holders: list[tuple[int, bool]] = []
        error: BaseException | None = None
        if self.agent.rank in ranks:
            try:
                here = self._advance(context, context.share(backward), None, flush=flush)
                assert here is not None  # (no chain: the pass delivers itself)
                following |= here[0]
                holders += here[1]
            except Exception as exc:
                error = exc
        for future in futures:
            try:
                report = _report(wait(future))
                assert report is not None
                following |= report[0]
                holders += report[1]
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        return following, holders

    def _request_run(
        self, context: AutogradContext, backward: BackwardId, rank: int, chain: Chain | None,
        flush: bool,
    ) -> RpcFuture[Any]:
        return self.agent.request(
            self.agent.workers[rank], MessageKind.AUTOGRAD_RUN,
            (context.id, backward, chain, flush),
            timeout=self.agent.timeout_for(None),
            label=CallLabel("dist_autograd.backward", context.id, _describe_context),
        )

    def _advance(
        self,
        context: AutogradContext,
        share: Share,
        chain: Chain | None,
        early: bool = False,
        flush: bool = False,
        roots: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
        holders: Sequence[tuple[int, bool]] = (),
    ) -> Report | None:
        """This worker's pass of a round, from every gradient delivered to its
        ``share`` (and ``roots``, on the driver's first pass), then delivery; returns the
        round's report, or ``None`` when the pass forwarded a ``chain`` to another worker.
        ``holders``: what the chain's earlier passes reported.

        ``early``: this is the driver's own thread, which returns from ``backward()``
        only after this pass: it may hand the chain on from inside the pass, as soon as
        what the pass owes is known (see ``run_plan``'s ``on_full``). Elsewhere the
        chain could end, and ``backward()`` return, before this worker's leaves have
        their gradients.
        """
        handed: list[int] = []
        on_full: OnOutboxFull | None = None
        if early and chain is not None:
            def hand_on(outbox: Outbox) -> None:
                if len(outbox) == 1 and self.agent.rank not in outbox:
                    ((peer, items),) = outbox.items()
                    self._forward(context, share, peer, list(items), chain, list(holders))
                    handed.append(peer)

            on_full = hand_on

        # The context's leaves, the pass and the accumulation are one step under the
        # gradient lock: a later pass of this context on another thread (a chain handed
        # on early that comes back here) must see this pass's leaves among the earlier
        # ones, or it would miss gradients DDP rewrites in it; and it must find this
        # pass's schedule settled.
        outbox: Outbox = {}
        with holding(self.grad_lock):
            with context.lock:
                pending, share.pending = share.pending, {}
            if not pending and roots is None and not flush:
                return set(), [(self.agent.rank, share.holds)]
            runs = share.plans(context.sends, pending, roots, flush,
                               f"worker {self.agent.name!r}: context {context.id}")
            for plan, scheduled in runs:
                found, rewritten, owed, captured = self.engine.run_plan(
                    context.id, plan, context.leaves(), on_full
                )
                on_full = None  # (a second run is late gradients: they go after)
                context.accumulate(found, rewritten)
                if scheduled:
                    owed = share.settle(plan, captured, owed)
                for peer, items in owed.items():
                    outbox.setdefault(peer, []).extend(items)
            self.passes += 1
            reports = [*holders, (self.agent.rank, share.holds)]
        if handed:
            return None
        if not outbox:
            return set(), reports
        if chain is not None and len(outbox) == 1:
            ((peer, items),) = outbox.items()
            if peer == self.agent.rank:  # the chain stays here
                self._store(context, share, items)
                return self._advance(context, share, chain, early, holders=reports)
            self._forward(context, share, peer, items, chain, reports)
            return None
        futures = []
        for peer, items in outbox.items():
            if peer == self.agent.rank:
                self._store(context, share, items)
            else:
                futures.append(self._deliver(context, share, peer, items))
        error: BaseException | None = None
        for future in futures:  # delivered everywhere before the round ends
            try:
                wait(future)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        return set(outbox), reports

    def _deliver(self, context: AutogradContext, share: Share, peer: int,
                 items: list[Any]) -> RpcFuture[Any]:
        """Send ``peer`` the gradients it is owed, for its pass of the next round."""
        return self.agent.request(
            self.agent.workers[peer], MessageKind.AUTOGRAD_BACKWARD,
            (context.id, share.backward, items),
            timeout=self.agent.timeout_for(None),
            label=CallLabel("dist_autograd.backward", context.id, _describe_context),
        )

    def _forward(self, context: AutogradContext, share: Share, peer: int, items: list[Any],
                 chain: Chain, holders: list[tuple[int, bool]]) -> None:
        """Hand the chain to ``peer`` with the gradients it is owed (one way)."""
        if self.agent.is_lost(peer):
            raise self.agent.lost_error(peer, f"dist_autograd.backward(context {context.id})")
        with context.lock:
            # If that peer is lost while the chain is there, the driver hears it from
            # here (on_peer_lost), not only when its timeout runs out.
            context.forwarded.add((peer, *chain))
        self.agent.send_one_way(
            self.agent.workers[peer], MessageKind.AUTOGRAD_CHAIN,
            (context.id, share.backward, items, chain, holders),
        )

    def _end_chain(
        self, chain: Chain, report: Report | None, error: BaseException | None
    ) -> None:
        """Tell the driver of ``chain`` that it ended here: the report, or why not."""
        driver, token = chain
        if driver == self.agent.rank:
            self._settle_chain(token, report, lambda _: error)
            return
        info = None if error is None else RemoteErrorInfo.capture(error, self.agent.name)
        self.agent.send_one_way(self.agent.workers[driver], MessageKind.AUTOGRAD_CHAIN_END,
                                (token, _wire_report(report), info))

    def _settle_chain(
        self, token: int, report: Report | None,
        error: Callable[[int], BaseException | None],
    ) -> None:
        """Complete the future of chain ``token`` this worker drives: with the round's
        report, or with ``error(context id)``. A chain already ended is left alone."""
        with self._lock:
            context_id, done = self._chains.get(token, (0, None))
        if done is None or done.done():
            log.debug("%s: end of chain %s after its backward ended", self.agent.name, token)
            return
        exc = error(context_id)
        if exc is None:
            done.set_result(report or (set(), []))
        else:
            done.set_exception(exc)  # type: ignore[arg-type]

    @staticmethod
    def _store(context: AutogradContext, share: Share, items: list[Any]) -> None:
        """Gradients delivered to this worker (or owed by it to itself), into ``share``;
        each is moved to the device of the tensor it belongs to, since it may come back
        by another route than its tensor went (a CPU gradient for a tensor a map sent
        to the CPU, say)."""
        with context.lock:
            for tag, index, grad in items:
                if isinstance(grad, Placed):  # a gradient this worker owes itself
                    grad = grad.tensor.to(grad.device)
                sent = context.sends.get(tag)
                if (grad is not None and sent is not None and index < len(sent)
                        and grad.device != sent[index].device):
                    grad = grad.to(sent[index].device)
                share.deliver(tag, index, grad)

    def handle_backward(self, caller: WorkerInfo, payload: Any) -> Any:
        """Gradients for tensors this worker sent, for its pass of the next round."""
        context_id, backward, items = payload
        context = self.get(context_id)
        self._store(context, context.share(_backward_id(backward)), items)
        return []

    def handle_chain(self, caller: WorkerInfo, payload: Any) -> None:
        """A chain reached this worker (one way): store the gradients, run the pass now,
        and either forward the chain or report its end to the driver."""
        context_id, backward, items, (driver, token), holders = payload
        chain = (int(driver), int(token))
        try:
            context = self.get(context_id)
            share = context.share(_backward_id(backward))
            self._store(context, share, items)
            report = self._advance(context, share, chain, holders=_holders(holders))
        except Exception as exc:
            self._end_chain(chain, None, exc)
            return
        if report is not None:
            self._end_chain(chain, report, None)

    def chain_undecodable(self, caller: WorkerInfo, partial: Any, error: BaseException) -> None:
        """A chain reached this worker with gradients it cannot read (``partial`` is the
        lenient read): end the chain here with that error, so that the driver's backward
        fails now, naming this worker and the cause, instead of at its timeout."""
        try:
            _context_id, _backward, _items, (driver, token), _holders = partial
            chain = (int(driver), int(token))
        except (TypeError, ValueError):
            log.warning("%s: an unreadable backward chain from %s could not be ended: %s",
                        self.agent.name, caller.name, error)
            return
        self._end_chain(chain, None, error)

    def handle_chain_end(self, caller: WorkerInfo, payload: Any) -> None:
        """A chain this worker drives ended on ``caller`` (in order, never blocks)."""
        token, report, info = payload
        self._settle_chain(token, _report(report), lambda context_id: None if info is None else
                           info.rebuild(f"dist_autograd.backward(context {context_id})"))

    def handle_run(self, caller: WorkerInfo, payload: Any) -> Any:
        """The driver starts a round: run a pass from the gradients delivered here.

        The reply is the round's report (see :func:`_wire_report`); with a chain, it is
        ``None`` when the chain went on to another worker (its end reaches the driver in
        an ``AUTOGRAD_CHAIN_END``)."""
        context_id, backward, chain, flush = payload
        context = self.get(context_id)
        report = self._advance(context, context.share(_backward_id(backward)), chain,
                               flush=bool(flush))
        return _wire_report(report)

def _describe_context(context_id: Any) -> str:
    return f"context {context_id}"


def _wire_report(report: Report | None) -> Any:
    """A report as plain data, for a reply or an ``AUTOGRAD_CHAIN_END``."""
    if report is None:
        return None
    ranks, holders = report
    return [sorted(ranks), [[rank, holds] for rank, holds in holders]]


def _report(wire: Any) -> Report | None:
    """A report from plain data (``None``: the chain went on)."""
    if wire is None:
        return None
    ranks, holders = wire
    return {int(rank) for rank in ranks}, _holders(holders)


def _holders(wire: Any) -> list[tuple[int, bool]]:
    return [(int(rank), bool(holds)) for rank, holds in wire]


def _backward_id(wire: Any) -> BackwardId:
    driver, number = wire
    return int(driver), int(number)
