"""Requests run under torch's profiler, on the callee: the ``PROFILED`` message kind.

While the caller's thread is profiled, :class:`~rpcx._core.call_path.CallPath` wraps a
call as ``PROFILED (kind, payload)`` (:mod:`rpcx._core.profiling` decides which kinds).
Here is the callee's end, plugged into the call path's handler table: the wrapped
request's own handler runs under the profiler, and its events ride back in the reply.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rpcx._core.pending import PendingCall
from rpcx._core.profiling import PROFILED_KINDS, install_profile_hooks, serve_profiled
from rpcx._core.service_host import Deferred, Handler
from rpcx.errors import RpcError
from rpcx.messages import MessageKind
from rpcx.worker import WorkerInfo

__all__ = ["ProfiledRequests", "profiled_reply"]

log = logging.getLogger("rpcx.agent")

DecodeErrorHook = Callable[[WorkerInfo, Any, BaseException], None]


class ProfiledRequests:
    """The ``PROFILED`` handler and its decode-error hook, over one worker's tables."""

    def __init__(self, name: str, handlers: dict[int, Handler],
                 decode_error_hooks: dict[int, DecodeErrorHook]) -> None:
        self._name = name
        self._handlers = handlers
        self._decode_error_hooks = decode_error_hooks

    def install(self) -> None:
        """Enter the handler and the hook in the tables; remote events join a caller's
        profile as it ends (torch's profiler hooks, once per process)."""
        self._handlers[MessageKind.PROFILED] = self.serve
        self._decode_error_hooks[MessageKind.PROFILED] = self.decode_error
        install_profile_hooks()

    def serve(self, caller: WorkerInfo, payload: Any) -> Any:
        """The wrapped request's own handler, under torch's profiler
        (:func:`rpcx._core.profiling.serve_profiled`)."""
        kind, inner = payload
        # (never a bookkeeping kind: those keep their plain-data decoder)
        handler = self._handlers.get(kind) if kind in PROFILED_KINDS else None
        if handler is None:
            raise RpcError(f"worker {self._name!r} does not profile message kind {kind}")
        return serve_profiled(lambda: handler(caller, inner),
                              lambda result: isinstance(result, Deferred), Deferred)

    def decode_error(self, caller: WorkerInfo, partial: Any, error: BaseException) -> None:
        """The wrapped request's own hook: a ``remote()`` whose arguments cannot be read
        still has to settle the RRef it was to create."""
        if isinstance(partial, tuple) and len(partial) == 2 and partial[0] in PROFILED_KINDS:
            hook = self._decode_error_hooks.get(partial[0])
            if hook is not None:
                hook(caller, partial[1], error)


def profiled_reply(name: str, pending: PendingCall, reply: Any) -> Any:
    """The value of a ``PROFILED`` request's reply; its remote events join the call's
    span (``name``: this worker, for the warning when a peer sent none)."""
    try:
        return pending.span.received(reply)
    except (TypeError, ValueError):  # not (value, serve_ns, events): a peer's bug
        log.warning("%s: the reply to %s from %s carried no profile", name, pending.call,
                    pending.dst.name)
        return reply
