"""Worker processes for test worlds, started without a torch import each.

Test worlds start their worker processes with :func:`worker_context`: forked from a
server that imported torch, rpcx and the harness once (:mod:`rpcx._util.forkserver`), each
ready in milliseconds instead of the 2-3 s of CPU a spawned interpreter spends on
importing torch, and otherwise as a spawned one: the starter's environment at the
time, fresh seeds, the exit handlers run.

``$RPCX_TEST_START_METHOD=spawn`` goes back to fresh interpreters (to compare, or to
rule the fork server out when hunting a bug); it is also what platforms other than
Linux get.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

from rpcx._util import forkserver as _forkserver

__all__ = ["PRELOAD", "START_METHOD_ENV", "WorkerContext", "start_method", "worker_context"]

START_METHOD_ENV = "RPCX_TEST_START_METHOD"

# The harness and the functions the kit runs on other workers, imported by the server;
# and torch._dynamo, which torch imports when a process makes its first optimizer: 1.4 s
# of CPU in every worker that owns a DistributedOptimizer's parameters (with it preloaded,
# the gloo pass took 92 s of CPU instead of 157). Importing it starts no thread.
PRELOAD = ("rpcx.backends", "rpcx.testing.world", "rpcx.testing.remote",
           "rpcx.testing.training", "torch._dynamo")


def start_method() -> str:
    """``forkserver`` on Linux, unless ``$RPCX_TEST_START_METHOD`` says otherwise;
    ``spawn`` elsewhere (see :func:`rpcx._util.forkserver.available`)."""
    chosen = os.environ.get(START_METHOD_ENV, "").strip()
    if chosen:
        if chosen not in multiprocessing.get_all_start_methods():
            raise ValueError(f"${START_METHOD_ENV}={chosen!r}: this platform's start methods "
                             f"are {', '.join(multiprocessing.get_all_start_methods())}")
        return chosen
    return _forkserver.FORKSERVER if _forkserver.available() else "spawn"


class WorkerContext:
    """A ``multiprocessing`` context for test workers: ``Process`` starts them as
    described above; ``Queue``, ``Pipe`` and the rest are the underlying context's."""

    def __init__(self, method: str) -> None:
        self.method = method
        self._context: Any = (_forkserver.context(PRELOAD) if method == _forkserver.FORKSERVER
                              else multiprocessing.get_context(method))

    def Process(
        self, target: Callable[..., Any], args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None, *, daemon: bool | None = None,
        name: str | None = None,
    ) -> Any:
        """A process that will run ``target(*args, **kwargs)``, in this process's
        environment as it is now."""
        if self.method != _forkserver.FORKSERVER:
            return self._context.Process(target=target, args=args, kwargs=kwargs or {},
                                         daemon=daemon, name=name)
        return self._context.Process(
            target=_forkserver.run_as_spawned,
            args=(*_forkserver.starter(), target, args, kwargs),
            daemon=daemon, name=name)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._context, attribute)


_contexts: dict[str, WorkerContext] = {}


def worker_context() -> WorkerContext:
    """The context test worlds start their worker processes with."""
    method = start_method()
    if method not in _contexts:
        _contexts[method] = WorkerContext(method)
    return _contexts[method]
