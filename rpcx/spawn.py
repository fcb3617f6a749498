"""``rpcx.spawn``: start the workers of a program, on any backend.

Like ``torch.multiprocessing.spawn`` (``fn(rank, *args)`` for each rank). For in-process
backends (loopback) the ranks are threads of this process, and ``init_rpc`` called on
them joins one private in-process world whatever ``init_method`` it is given; for every
other backend they are processes, with the backend exported as ``$RPCX_BACKEND`` and,
where the parent has none, ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT`` (as
``torchrun --standalone`` does), so ``env://``, the default ``init_method``, just works.

Worker processes are forked from a server that imported torch and rpcx once
(:mod:`rpcx._util.forkserver`), not started as fresh interpreters that import torch each:
a worker is ready in milliseconds. ``start_method="spawn"`` asks for fresh interpreters.
"""

from __future__ import annotations

import contextvars
import logging
import os
import socket
import threading
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.spawn import start_processes

from rpcx import api
from rpcx._core import context as _context
from rpcx._util import forkserver as _forkserver
from rpcx.errors import RpcError
from rpcx.messages import LEAVING_THREAD_ENDED
from rpcx.registry import ENV_VAR, resolve_backend

__all__ = ["SpawnContext", "WorkerFailedError", "spawn", "under_torchrun"]

log = logging.getLogger("rpcx")

# What torchrun (and ``rpcx launch``) set in each worker it starts.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_ERROR_GRACE = 10.0  # seconds join() waits for the other workers after one raised


class WorkerFailedError(RpcError):
    """A worker started by :func:`spawn` raised; ``rank`` says which, ``__cause__`` what."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    backend: str | None = None,
    daemon: bool = False,
    start_method: str | None = None,
) -> Any:
    """Run ``fn(rank, *args)`` for ``rank`` in ``range(nprocs)`` on ``backend``'s kind of worker.

    ``backend=None`` resolves the backend the way ``init_rpc`` does. Returns ``None`` when
    ``join`` is true (raising if a worker raised), else a context with ``join()``.
    ``start_method``: how worker processes start; ``None`` (the default) forks them from
    a server that has imported torch and rpcx (``"forkserver"``, on Linux; ``"spawn"``
    elsewhere); ``"spawn"`` starts each as a fresh interpreter.
    """
    spec = resolve_backend(backend, _context.spawn_backend.get())
    launched = under_torchrun()
    if launched and os.environ.get("RANK") == "0":  # (one line for the launcher's world)
        log.warning(
            "rpcx.spawn: this process is one of %s workers a launcher started (torchrun or "
            "`rpcx launch`), and rpcx.spawn starts %d more in each: %s separate worlds. "
            "Under a launcher, call init_rpc in the script itself (rpcx.launch does the "
            "right thing either way), or run the script with python",
            os.environ["WORLD_SIZE"], nprocs, os.environ["WORLD_SIZE"])
    if spec.capabilities.in_process:
        context = SpawnContext(fn, args, nprocs, spec.name)
        if not join:
            return context
        while not context.join():
            pass
        return None
    # Like torchrun: several processes on one host each running as many OpenMP threads
    # as there are cores oversubscribe it, and OpenMP workers spin between parallel
    # regions, taking the CPU the RPC threads need (the DDP + RPC benchmark ran 2-4x
    # slower so). OMP_NUM_THREADS, when set, wins.
    threads = 1 if nprocs > 1 and "OMP_NUM_THREADS" not in os.environ else None
    if threads is not None:
        log.info("rpcx.spawn: %d worker processes: torch intra-op threads set to 1 in each "
                 "(set OMP_NUM_THREADS to choose)", nprocs)
    rendezvous = _local_rendezvous(own=launched)
    if rendezvous:
        where = {**os.environ, **rendezvous}
        log.info("rpcx.spawn: env:// rendezvous on this host at %s:%s",
                 where["MASTER_ADDR"], where["MASTER_PORT"])
    if start_method is None:
        start_method = _forkserver.FORKSERVER if _forkserver.available() else "spawn"
    starter = None  # (forked workers take this process's environment and output)
    if start_method == _forkserver.FORKSERVER:
        _forkserver.context()  # (its server imports torch and rpcx before it forks)
        starter = _forkserver.starter()
    return start_processes(  # type: ignore[no-untyped-call]
        _process_entry,
        args=(fn, args, spec.name, threads, rendezvous, starter),
        nprocs=nprocs,
        join=join,
        daemon=daemon,
        start_method=start_method,
    )


def under_torchrun() -> bool:
    """Whether this process is a worker that ``torchrun`` (or ``rpcx launch``) started."""
    return all(var in os.environ for var in _LAUNCHER_VARS)


def _local_rendezvous(own: bool = False) -> dict[str, str]:
    """``MASTER_ADDR``/``MASTER_PORT`` for workers on this host, where not set already.

    ``own``: whatever is set (a launcher's store, which the launcher's workers share),
    the spawned world gets a store of its own, so worlds spawned by each of them meet
    nobody else's."""
    missing: dict[str, str] = {}
    if own:
        missing["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    if own or not os.environ.get("MASTER_ADDR"):
        missing["MASTER_ADDR"] = "127.0.0.1"
    if own or not os.environ.get("MASTER_PORT"):
        with socket.socket() as sock:  # a port the OS says is free now
            sock.bind((missing.get("MASTER_ADDR") or os.environ["MASTER_ADDR"], 0))
            missing["MASTER_PORT"] = str(sock.getsockname()[1])
    return missing


def _process_entry(
    rank: int, fn: Callable[..., Any], args: tuple[Any, ...], backend: str, threads: int | None,
    rendezvous: dict[str, str], starter: tuple[dict[str, str], Any] | None,
) -> None:
    if starter is not None:  # forked from the server: be what a spawned worker is
        _forkserver.run_as_spawned(*starter, _run_worker,
                                   (rank, fn, args, backend, threads, rendezvous))
    else:
        _run_worker(rank, fn, args, backend, threads, rendezvous)


def _run_worker(
    rank: int, fn: Callable[..., Any], args: tuple[Any, ...], backend: str, threads: int | None,
    rendezvous: dict[str, str],
) -> None:
    os.environ.update(rendezvous)
    os.environ[ENV_VAR] = backend
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for what the worker starts itself
        torch.set_num_threads(threads)
    fn(rank, *args)


def _leave_if_running(rank: int) -> None:
    """A worker thread that ends without ``shutdown()`` leaves as a process does at exit.

    A process's worker is shut down non-gracefully by an ``atexit`` handler; a thread has
    none. Left running, its agent would keep the others' graceful ``shutdown()`` waiting
    for it forever, and its threads blocked in torch at interpreter exit abort the process.
    """
    agent = _context.thread_agent()
    if agent is None or not agent.is_running:
        return
    log.warning(
        "worker %r (spawned thread %d) ended without rpcx.shutdown(); leaving without "
        "waiting for peers", agent.name, rank,
    )
    try:
        agent.say_leaving(LEAVING_THREAD_ENDED)  # (peers say so, not "has shut down")
        api.shutdown(graceful=False)
    except Exception:
        log.exception("worker %r: shutdown after its thread ended failed", agent.name)


class SpawnContext:
    """The threads of an in-process world started by :func:`spawn`."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int, backend: str):
        self._cond = threading.Condition()
        self._errors: dict[int, BaseException] = {}
        self._finished: set[int] = set()
        world = f"spawn-{uuid.uuid4().hex}"
        self.threads: list[threading.Thread] = []
        for rank in range(nprocs):
            ctx = contextvars.copy_context()
            ctx.run(_context.spawn_backend.set, backend)
            ctx.run(_context.spawn_world.set, world)
            thread = threading.Thread(
                target=ctx.run,
                args=(self._run, rank, fn, args),
                name=f"rpcx-spawn-{rank}",
                daemon=True,
            )
            self.threads.append(thread)
        for thread in self.threads:
            thread.start()

    def _run(self, rank: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        error: BaseException | None = None
        try:
            fn(rank, *args)
        except BaseException as exc:
            error = exc
        finally:
            _leave_if_running(rank)  # before join() can see the error and the program exit
            with self._cond:
                if error is not None:
                    self._errors[rank] = error
                self._finished.add(rank)
                self._cond.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the workers. True once all finished; raises if one of them raised.

        Like torch's ``ProcessContext.join``: returns False if ``timeout`` passed first.
        """
        with self._cond:
            self._cond.wait_for(
                lambda: self._errors or len(self._finished) == len(self.threads), timeout
            )
            if self._errors:
                # The failed worker has left; the others' graceful shutdowns now finish
                # promptly. Give them a moment, so a program that exits on the error does
                # not leave worker threads inside torch at interpreter exit.
                self._cond.wait_for(
                    lambda: len(self._finished) == len(self.threads), _ERROR_GRACE
                )
                rank = min(self._errors)
                exc = self._errors[rank]
                text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                raise WorkerFailedError(
                    f"worker thread {rank} raised {type(exc).__name__}: {exc}\n\n{text}", rank
                ) from exc
            return len(self._finished) == len(self.threads)
