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
import time
from collections.abc import Iterator
from typing import Any

import torch

from rpcx._core.service_host import Deferred, ServiceHost, first_id
from rpcx._util.timer import within
from rpcx._wire.codec import DecodeContext, EncodeContext, Placed, set_scope_hooks
from rpcx.autograd.context import AutogradContext
from rpcx.autograd.engine import LocalEngine
from rpcx.autograd.releases import ReleaseNotes
from rpcx.autograd.rounds import Rounds
from rpcx.futures import all_done, wait_done
from rpcx.messages import MessageKind
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
        # One local pass at a time on this worker (see rpcx.autograd.engine).
        self.grad_lock = threading.RLock()
        # Local passes, the pass running now and recv nodes.
        self.engine = LocalEngine(self)
        # The backward passes' rounds and chains (rpcx.autograd.rounds).
        self.rounds = Rounds(agent, self.get, self.engine, self.grad_lock)

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
        self.rounds.on_peer_lost(contexts, rank)
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
                "passes": self.rounds.passes,
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
    rounds = svc.rounds
    agent.register_handler(MessageKind.AUTOGRAD_BACKWARD, rounds.handle_backward)
    agent.register_handler(MessageKind.AUTOGRAD_RUN, rounds.handle_run)
    agent.register_handler(MessageKind.AUTOGRAD_CHAIN, rounds.handle_chain,
                           on_decode_error=rounds.chain_undecodable)
    agent.register_handler(MessageKind.AUTOGRAD_CHAIN_END, rounds.handle_chain_end,
                           in_order=True)
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
