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
import itertools
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rpcx.agent import Deferred, RpcAgent
from rpcx.autograd.engine import Outbox, make_recv, run_pass
from rpcx.errors import RpcError
from rpcx.futures import RpcFuture, wait
from rpcx.messages import MessageKind
from rpcx.serialization import DecodeContext, EncodeContext, set_scope_hooks
from rpcx.worker import WorkerInfo

__all__ = ["AutogradContext", "AutogradService", "current_context_id", "install", "service"]

log = logging.getLogger("rpcx.autograd")

_SERVICE = "autograd"
_RANK_SHIFT = 48  # context ids: the creating rank in the high bits, a counter below
_RELEASED_MEMORY = 65536  # released context ids remembered per worker
_RELEASE_WAIT = 300.0  # bound on waiting for releases when no timeout is given

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
    """

    id: int
    sends: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    peers: set[int] = field(default_factory=set)
    grads: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    finished_roots: set[Any] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def accumulate(self, found: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add a pass's leaf gradients."""
        with self.lock:
            for leaf, grad in found:
                old = self.grads.get(leaf)
                self.grads[leaf] = grad if old is None else old + grad


def service(agent: RpcAgent) -> AutogradService:
    """The autograd service of ``agent``."""
    svc: AutogradService = agent.services[_SERVICE]
    return svc


class AutogradService:
    """Distributed autograd for one worker; also the agent's message scope."""

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self._contexts: dict[int, AutogradContext] = {}
        self._released: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._tags = itertools.count(1)
        self._releasing: list[RpcFuture[Any]] = []
        # One local pass at a time on this worker (see rpcx.autograd.engine).
        self.grad_lock = threading.RLock()
        self.active_outbox: Outbox | None = None
        # Every recv node hangs from this leaf, so that torch records the node at all.
        self.anchor = torch.empty(0, requires_grad=True)

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
        """The context, created here if new, with ``peer`` noted; None if released."""
        context = self._contexts.get(context_id)
        if context is None:
            with self._lock:
                if context_id in self._released:
                    return None
                context = self._contexts.setdefault(context_id, AutogradContext(context_id))
        if peer != self.agent.rank and peer not in context.peers:
            with context.lock:
                context.peers.add(peer)
        return context

    def release(self, context_id: int, notify_except: int | None = None) -> list[RpcFuture[Any]]:
        """Forget ``context_id`` here and tell the peers that took part in it."""
        with self._lock:
            context = self._contexts.pop(context_id, None)
            self._released[context_id] = None
            while len(self._released) > _RELEASED_MEMORY:
                self._released.popitem(last=False)
        if context is None:
            return []
        futures: list[RpcFuture[Any]] = []
        if not self.agent.is_running:
            return futures
        for peer in sorted(context.peers):
            if peer == notify_except:
                continue
            try:
                futures.append(self.agent.request(
                    self.agent.workers[peer], MessageKind.AUTOGRAD_RELEASE, context_id,
                    timeout=self.agent.timeout_for(None), api="dist_autograd.release",
                    target=context_id, describe_target=_describe_context,
                ))
            except RpcError as exc:
                log.debug("%s: release of context %d not sent to rank %d: %s",
                          self.agent.name, context_id, peer, exc)
        return futures

    def release_from_user(self, context_id: int) -> None:
        """Release a context whose ``with`` block ended; the peers are told in the
        background (:meth:`wait_released` waits for them)."""
        futures = self.release(context_id)
        with self._lock:
            self._releasing = [f for f in self._releasing if not f.done()]
            self._releasing.extend(futures)

    def wait_released(self, timeout: float | None = None) -> int:
        """Wait until every release this worker started has reached every peer.

        Returns how many were outstanding. Failures (a peer gone) are logged, not raised.
        """
        with self._lock:
            waiting, self._releasing = self._releasing, []
        for future in waiting:
            try:
                _wait(future, _RELEASE_WAIT if timeout is None else timeout)
            except Exception as exc:
                log.debug("%s: a context release failed: %s", self.agent.name, exc)
        return len(waiting)

    def stats(self) -> dict[str, int]:
        """Live contexts and releases still travelling, for ``rpcx.debug_info()``."""
        with self._lock:
            releasing = sum(1 for f in self._releasing if not f.done())
            return {"contexts": len(self._contexts), "releasing": releasing}

    # ------------------------------------------------------------------ message scope

    def outgoing(self, dst: int) -> int | None:
        """The scope of a request sent now: the thread's context, with ``dst`` noted."""
        context_id = _current.get()
        if context_id is not None:
            self._joined(context_id, dst)
        return context_id

    @contextlib.contextmanager
    def entered(self, scope: int, src: int) -> Iterator[None]:
        """Serve a request of context ``scope`` from ``src`` inside that context."""
        self._joined(scope, src)
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
        return make_recv(self, self.anchor, tensor, ctx.peer, ctx.scope, ctx.scope_tag, index)

    # ------------------------------------------------------------------------ passes

    def collect(self, peer: int, context_id: int, tag: int, index: int, grad: torch.Tensor) -> None:
        """A recv node's gradient, to be sent to ``peer`` when the running pass ends."""
        outbox = self.active_outbox
        if outbox is None:
            raise RuntimeError(
                f"a tensor received over RPC in distributed autograd context {context_id} "
                f"is part of this graph; run rpcx.autograd.backward(context_id, roots) "
                "instead of Tensor.backward() or torch.autograd.backward()"
            )
        outbox.setdefault(peer, []).append((context_id, tag, index, grad))

    def run(
        self,
        context: AutogradContext,
        tensors: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
    ) -> list[RpcFuture[Any]]:
        """One local pass; returns the futures of the gradients it sent on."""
        found, outbox = run_pass(self, tensors, grads)
        context.accumulate(found)
        futures = []
        for peer, items in outbox.items():
            futures.append(self.agent.request(
                self.agent.workers[peer], MessageKind.AUTOGRAD_BACKWARD, items,
                timeout=self.agent.timeout_for(None), api="dist_autograd.backward",
                target=context.id, describe_target=_describe_context,
            ))
        return futures

    def handle_backward(self, caller: WorkerInfo, items: Any) -> Any:
        """Gradients for tensors this worker sent: run a pass per context from them."""
        by_context: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
        for context_id, tag, index, grad in items:
            slots = by_context.setdefault(context_id, {})
            old = slots.get((tag, index))
            slots[(tag, index)] = grad if old is None else old + grad
        futures: list[RpcFuture[Any]] = []
        for context_id, slots in by_context.items():
            context = self.get(context_id)
            tensors, grads = [], []
            for (tag, index), grad in slots.items():
                sent = context.sends.get(tag)
                if sent is None or index >= len(sent):
                    raise RpcError(
                        f"worker {self.agent.name!r}: context {context_id} has no tensor "
                        f"{index} of send {tag} (gradient from {caller.name!r})"
                    )
                tensors.append(sent[index])
                grads.append(grad)
            futures.extend(self.run(context, tensors, grads))
        # Reply once the passes this one started are done. Waiting here (the pool grows
        # while a thread waits) costs one thread hand-off per hop; a Deferred reply would
        # cost two, and backward passes are chains of such hops.
        errors = []
        for future in futures:
            try:
                wait(future)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return None

    def handle_release(self, caller: WorkerInfo, context_id: Any) -> Any:
        """A peer released a context: forget it and pass the word on."""
        futures = self.release(int(context_id), notify_except=caller.id)
        if not futures:
            return None
        return Deferred(all_done(futures))

    def drain(self) -> int:
        """Shutdown: let context releases this worker started finish (sends nothing)."""
        self.wait_released(timeout=self.agent.timeout_for(None))
        return 0


def all_done(futures: Sequence[torch.futures.Future[Any]]) -> torch.futures.Future[None]:
    """A future that completes when all of ``futures`` have, failing with the first error."""

    def check(done: torch.futures.Future[list[torch.futures.Future[Any]]]) -> None:
        for future in done.value():
            future.value()  # raises that future's error

    return torch.futures.collect_all(list(futures)).then(check)


def _wait(future: torch.futures.Future[Any], timeout: float) -> None:
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    if not done.wait(timeout):
        raise TimeoutError(f"context release not acknowledged within {timeout:g} s")
    future.value()


def _describe_context(context_id: Any) -> str:
    return f"context {context_id}"


def install(agent: RpcAgent) -> None:
    """Give ``agent`` distributed autograd: its service, scope and handlers."""
    svc = AutogradService(agent)
    agent.services[_SERVICE] = svc
    agent.scope = svc
    set_scope_hooks(_on_encode, _on_decode)
    agent.register_handler(MessageKind.AUTOGRAD_BACKWARD, svc.handle_backward)
    agent.register_handler(MessageKind.AUTOGRAD_RELEASE, svc.handle_release)
    agent.on_drain.append(svc.drain)


def _on_encode(ctx: EncodeContext, tensor: torch.Tensor) -> None:
    service(ctx.agent).on_encode(ctx, tensor)


def _on_decode(ctx: DecodeContext, tensor: torch.Tensor) -> torch.Tensor:
    return service(ctx.agent).on_decode(ctx, tensor)
