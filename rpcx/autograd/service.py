"""Distributed autograd's per-worker state: contexts, the message scope, the handlers.

A context exists on every worker that took part in it: the one that opened it and every
worker that received or sent a request inside it. Each remembers the peers it exchanged
messages with in the context, so releasing it reaches them all: the worker that opened
it tells its peers, each of which forgets it and tells its own peers, and so on. Released
ids are remembered (a bounded set), so a message of a released context that arrives late
does not bring it back.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rpcx._pool import holding
from rpcx._timer import within
from rpcx.autograd.engine import LocalEngine, OnOutboxFull
from rpcx.autograd.releases import ReleaseNotes
from rpcx.autograd.schedule import Outbox
from rpcx.autograd.share import BackwardId, Share
from rpcx.errors import PeerLostError, RemoteErrorInfo, RpcTimeoutError
from rpcx.futures import RpcFuture, all_done, wait, wait_done
from rpcx.messages import MessageKind
from rpcx.serialization import DecodeContext, EncodeContext, Placed, set_scope_hooks
from rpcx.service_host import Deferred, ServiceHost, first_id
from rpcx.worker import WorkerInfo

__all__ = ["AutogradContext", "AutogradService", "current_context_id", "install", "service"]

log = logging.getLogger("rpcx.autograd")

_SERVICE = "autograd"
_RANK_SHIFT = 48  # context ids: the creating rank in the high bits, a counter below
_RELEASED_MEMORY = 65536  # released context ids remembered per worker
_RELEASE_WAIT = 300.0  # bound on waiting for releases when no timeout is given

# A chain of passes (see AutogradService.start): the driver's rank and its token.
Chain = tuple[int, int]
# What a round tells the driver: the ranks of the next round, then (rank, holds) for
# each pass that ran, in order: whether that worker holds gradients that wait.
Report = tuple[set[int], list[tuple[int, bool]]]

# The context the calling thread works in (a context id), or None.
_current: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "rpcx_autograd_context", default=None
)


def current_context_id() -> int | None:
    """The id of the distributed autograd context the calling thread is in, if any."""
    return _current.get()


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


def service(agent: ServiceHost) -> AutogradService:
    """The autograd service of ``agent``."""
    svc: AutogradService = agent.services[_SERVICE]
    return svc


class AutogradService:
    """Distributed autograd for one worker; also the agent's message scope."""

    def __init__(self, agent: ServiceHost) -> None:
        self.agent = agent
        self._contexts: dict[int, AutogradContext] = {}
        self._released: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._ids = itertools.count(first_id(agent.incarnation))
        self._tags = itertools.count(1)
        # Releases owed to peers: they ride in frames sent anyway (see releases.py).
        self.releases = ReleaseNotes(agent, _describe_contexts)
        self._tokens = itertools.count(1)
        self._backwards = itertools.count(1)  # the backward passes this worker drives
        # Chains this worker drives, by token: (context id, future of the next round).
        self._chains: dict[int, tuple[int, RpcFuture[Report]]] = {}
        self.passes = 0  # local passes run here, ever (debug_info shows it)
        # One local pass at a time on this worker (see rpcx.autograd.engine).
        self.grad_lock = threading.RLock()
        # Local passes, the pass running now and recv nodes.
        self.engine = LocalEngine(self)

    # ----------------------------------------------------------------------- contexts

    def open(self) -> AutogradContext:
        """A new context created by this worker."""
        context_id = (self.agent.rank << _RANK_SHIFT) | next(self._ids)
        context = AutogradContext(context_id)
        with self._lock:
            self._contexts[context_id] = context
        return context

    def find(self, context_id: int) -> AutogradContext | None:
        """The context ``context_id`` if this worker has it."""
        return self._contexts.get(context_id)

    def get(self, context_id: int) -> AutogradContext:
        """The context ``context_id``; raises a clear error if this worker lacks it."""
        context = self._contexts.get(context_id)
        if context is None:
            state = "was released" if context_id in self._released else "does not exist"
            raise RuntimeError(
                f"Could not find autograd context with id: {context_id} on worker "
                f"{self.agent.name!r} (it {state} here)"
            )
        return context

    def _joined(self, context_id: int, peer: int) -> AutogradContext | None:
        """The context, created here if new, with ``peer`` noted; None if released.

        Under the service lock, so that a peer is never added to a context that a
        concurrent release has already taken out (that peer would never hear of it).
        """
        with self._lock:
            if context_id in self._released:
                return None
            context = self._contexts.get(context_id)
            if context is None:
                context = self._contexts[context_id] = AutogradContext(context_id)
            if peer != self.agent.rank:
                context.peers.add(peer)
            return context

    def release(self, context_id: int, notify_except: int | None = None) -> None:
        """Forget ``context_id`` here; its peers hear of it in their next frame from this
        worker, or soon (:mod:`rpcx.autograd.releases`)."""
        with self._lock:
            context = self._contexts.pop(context_id, None)
            self._released[context_id] = None
            while len(self._released) > _RELEASED_MEMORY:
                self._released.popitem(last=False)
        if context is None or not self.agent.is_running:
            return
        peers = [p for p in sorted(context.peers) if p != notify_except]
        if any(self.agent.is_lost(p) for p in peers):
            # A lost peer cannot pass the word on to the workers that joined through it:
            # tell everyone (a worker without the context only remembers the id).
            peers = self._everyone_but(notify_except)
        self.releases.owe(peers, context_id)

    def _everyone_but(self, notify_except: int | None) -> list[int]:
        me = self.agent.rank
        return [r for r in range(self.agent.world_size)
                if r not in (me, notify_except) and not self.agent.is_lost(r)]

    def on_peer_lost(self, rank: int) -> None:
        """A worker died or left: fail the chains handed to it, release the contexts it
        created (which it never will), and pass on the releases it may not have."""
        with self._lock:
            orphans = [c for c in self._contexts if c >> _RANK_SHIFT == rank]
            contexts = list(self._contexts.values())
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
        self.releases.on_peer_lost(rank)
        for context_id in orphans:
            self.release(context_id, notify_except=rank)

    def release_from_user(self, context_id: int) -> None:
        """Release a context whose ``with`` block ended; the peers are told in the
        background (:meth:`wait_released` waits for them)."""
        self.release(context_id)

    def wait_released(self, timeout: float | None = None) -> int:
        """Wait until every release this worker started (or passed on) has reached every
        peer, and everything they passed on has too, for at most ``timeout`` seconds.

        Returns how many peers were asked. Failures (a peer gone) are logged, not raised.
        """
        waiting = self.releases.flush_acknowledged()
        asked = len(waiting)
        waiting += [f for f in self.releases.in_flight() if f not in waiting]
        deadline = time.monotonic() + (_RELEASE_WAIT if timeout is None else timeout)
        for future in waiting:
            try:
                _wait(future, max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                log.debug("%s: a context release failed: %s", self.agent.name, exc)
        return asked

    def stats(self) -> dict[str, int]:
        """Live contexts, releases still travelling and local passes run so far."""
        releasing = self.releases.pending()
        with self._lock:
            return {
                "contexts": len(self._contexts),
                "releasing": releasing,
                "passes": self.passes,
            }

    # ------------------------------------------------------------------ message scope

    def outgoing(self, dst: int) -> int | None:
        """The scope of a request sent now: the thread's context, with ``dst`` noted."""
        context_id = _current.get()
        if context_id is None or self._joined(context_id, dst) is None:
            return None  # a released context travels no further
        return context_id

    @contextlib.contextmanager
    def entered(self, scope: int, src: int) -> Iterator[None]:
        """Serve a request of context ``scope`` from ``src`` inside that context."""
        if self._joined(scope, src) is None:  # released here already: serve it outside
            yield
            return
        token = _current.set(scope)
        try:
            yield
        finally:
            _current.reset(token)

    def on_encode(self, ctx: EncodeContext, tensor: torch.Tensor) -> None:
        """A tensor requiring grad is being sent in context ``ctx.scope``: record it."""
        assert ctx.scope is not None
        context = self._joined(ctx.scope, ctx.peer)
        if context is None:
            return
        with context.lock:
            if ctx.scope_tag == 0:
                ctx.scope_tag = next(self._tags)
                context.sends[ctx.scope_tag] = []
            context.sends[ctx.scope_tag].append(tensor)

    def on_decode(self, ctx: DecodeContext, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor requiring grad arrived in context ``ctx.scope``: give it a recv node."""
        assert ctx.scope is not None
        index = ctx.scope_count
        ctx.scope_count += 1
        if self._joined(ctx.scope, ctx.peer) is None:  # released: a plain leaf
            return tensor.requires_grad_(True)
        return self.engine.make_recv(tensor, ctx.peer, ctx.scope, ctx.scope_tag, index,
                                     ctx.source_device)

    # ------------------------------------------------------------------------ passes

    def collect(
        self,
        peer: int,
        context_id: int,
        tag: int,
        index: int,
        grad: torch.Tensor | None,
        source: torch.device | None = None,
    ) -> None:
        """A recv node's gradient, to be sent to ``peer`` when the running pass ends.

        ``None`` (the node ran, but no gradient reached it) is sent too, as torch's
        RecvRpcBackward sends zeros: the sender's nodes count on hearing from every
        message they sent (a ``Join`` that gives its second input no gradient, say)."""
        running = self.engine.active
        # torch runs CPU nodes on the thread that called backward, so a CPU gradient on
        # another thread comes from someone else's plain backward. CUDA nodes run on
        # torch's per-device threads: for those, a pass in progress is all we can check.
        on_pass_thread = running is not None and running.thread == threading.get_ident()
        on_cpu = grad is None or grad.device.type == "cpu"
        if running is None or (not on_pass_thread and on_cpu):
            raise RuntimeError(
                f"a tensor received over RPC in distributed autograd context {context_id} "
                f"is part of this graph; run rpcx.autograd.backward(context_id, roots) "
                "instead of Tensor.backward() or torch.autograd.backward()"
            )
        if context_id != running.context_id:
            # An edge recorded in another context: its gradient belongs to that
            # context's own backward pass, not to this one.
            log.debug("%s: gradient for context %d dropped in a pass of context %d",
                      self.agent.name, context_id, running.context_id)
            return
        item = grad if source is None or grad is None else Placed(grad, source)
        running.outbox.setdefault(peer, []).append((tag, index, item))
        running.recvs_left -= 1
        if running.recvs_left == 0 and running.on_full is not None and on_pass_thread:
            running.on_full(running.outbox)

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
            timeout=self.agent.timeout_for(None), api="dist_autograd.backward",
            target=context.id, describe_target=_describe_context,
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
            timeout=self.agent.timeout_for(None), api="dist_autograd.backward",
            target=context.id, describe_target=_describe_context,
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

    def handle_forget(self, caller: WorkerInfo, context_ids: Any) -> None:
        """A peer released contexts (a note, in order): forget them, pass the word on."""
        for context_id in context_ids:
            self.release(int(context_id), notify_except=caller.id)

    def handle_release(self, caller: WorkerInfo, context_ids: Any) -> Any:
        """A peer waits for its releases: forget these, pass every release owed here on
        the same way, and answer once those peers answered."""
        self.handle_forget(caller, context_ids)
        futures = self.releases.flush_acknowledged()
        if not futures:
            return None
        return Deferred(all_done(futures))

    def drain(self, left: float | None = None) -> int:
        """Shutdown: ask every peer owed releases, or told some one way, to acknowledge
        them (and what it passed on), for at most ``left`` seconds (and
        ``rpc_timeout``)."""
        self.wait_released(timeout=within(self.agent.timeout_for(None), left))
        return 0


def _wait(future: torch.futures.Future[Any], timeout: float) -> None:
    if not wait_done(future, timeout):
        raise TimeoutError(f"context release not acknowledged within {timeout:g} s")
    future.value()


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


def _describe_context(context_id: Any) -> str:
    return f"context {context_id}"


def _describe_contexts(context_ids: Any) -> str:
    return f"contexts {list(context_ids)}"


def install(agent: ServiceHost) -> None:
    """Give ``agent`` distributed autograd: its service, scope and handlers."""
    svc = AutogradService(agent)
    agent.services[_SERVICE] = svc
    agent.scope = svc
    set_scope_hooks(_on_encode, _on_decode)
    agent.register_handler(MessageKind.AUTOGRAD_BACKWARD, svc.handle_backward)
    agent.register_handler(MessageKind.AUTOGRAD_RUN, svc.handle_run)
    agent.register_handler(MessageKind.AUTOGRAD_CHAIN, svc.handle_chain,
                           on_decode_error=svc.chain_undecodable)
    agent.register_handler(MessageKind.AUTOGRAD_CHAIN_END, svc.handle_chain_end, in_order=True)
    agent.register_handler(MessageKind.AUTOGRAD_RELEASE, svc.handle_release)
    agent.register_handler(MessageKind.AUTOGRAD_FORGET, svc.handle_forget, in_order=True)
    agent.note_sources.append(svc.releases)
    agent.on_close.append(lambda left: svc.releases.close())
    agent.on_drain.append(svc.drain)
    agent.on_peer_lost.append(svc.on_peer_lost)
    agent.on_rank_reused.append(svc.releases.rank_reused)


def _on_encode(ctx: EncodeContext, tensor: torch.Tensor) -> None:
    service(ctx.agent).on_encode(ctx, tensor)


def _on_decode(ctx: DecodeContext, tensor: torch.Tensor) -> torch.Tensor:
    return service(ctx.agent).on_decode(ctx, tensor)
