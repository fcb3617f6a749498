"""Start and stop RPC worlds for tests: this process is worker 0 (the driver).

The other workers run :func:`_serve`: they join and then wait in a graceful
``shutdown()`` until the driver shuts down, serving its calls meanwhile. On in-process
backends they are threads; otherwise they are processes, forked from a server that
imported torch and rpcx once (:mod:`rpcx.testing.processes`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import rpcx
from rpcx._core import context as _context
from rpcx.registry import resolve_backend
from rpcx.testing.processes import worker_context

__all__ = ["DynamicWorld", "World", "dynamic_world", "start_world", "world"]

log = logging.getLogger("rpcx.testing")

_JOIN_TIMEOUT = 60.0
_FAILED_START_JOIN = 10.0  # seconds a failed start waits for its worker threads, in all
LOG_LEVEL_ENV = "RPCX_TEST_LOG_LEVEL"  # e.g. INFO: worker processes log at that level


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS reports free (tests never hard-code one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _options(
    backend: str, init_method: str, options: dict[str, Any]
) -> rpcx.TensorPipeRpcBackendOptions:
    """The backend's own options type where it extends torch's (so tests can set its
    fields), else torch's TensorPipe options, which every backend accepts."""
    options_type = resolve_backend(backend).options_type
    if not issubclass(options_type, rpcx.TensorPipeRpcBackendOptions):
        options_type = rpcx.TensorPipeRpcBackendOptions
    return options_type(init_method=init_method, **options)


def _serve(rank: int, size: int, init_method: str, backend: str, options: dict[str, Any]) -> None:
    level = os.environ.get(LOG_LEVEL_ENV)
    if level and not logging.getLogger().handlers:  # worker processes log to stderr
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    rpcx.init_rpc(
        f"worker{rank}", backend=backend, rank=rank, world_size=size,
        rpc_backend_options=_options(backend, init_method, options),
    )
    rpcx.shutdown()


@dataclass
class World:
    """A running world whose worker 0 is the calling thread (or process)."""

    backend: str
    size: int
    init_method: str
    names: list[str]
    multi_process: bool
    _threads: list[threading.Thread] = field(default_factory=list)
    _processes: list[Any] = field(default_factory=list)
    _tmpdir: tempfile.TemporaryDirectory[str] | None = None
    thread_errors: list[tuple[str, BaseException]] = field(default_factory=list)
    """What each worker thread (an in-process world's) raised, by worker name: a test
    that expects a failure reads it here, and nothing reaches ``threading.excepthook``."""

    def _serve_in_thread(self, rank: int, *args: Any) -> None:
        try:
            _serve(rank, *args)
        except BaseException as exc:  # (kept for the test, not left to excepthook)
            self.thread_errors.append((self.names[rank], exc))
            log.debug("worker thread %s failed: %r", self.names[rank], exc)

    def close(self, graceful: bool = True) -> None:
        """Shut the driver down (the others follow) and reap every worker."""
        try:
            if _context.maybe_current_agent() is not None:
                rpcx.shutdown(graceful=graceful, timeout=_JOIN_TIMEOUT)
        finally:
            for thread in self._threads:
                thread.join(_JOIN_TIMEOUT)
            for process in self._processes:
                process.join(_JOIN_TIMEOUT)
                if process.is_alive():
                    log.warning("worker process %s did not exit; killing it", process.pid)
                    process.kill()
                    process.join(5)
            if self._tmpdir is not None:
                self._tmpdir.cleanup()
            for name, exc in self.thread_errors:  # (a test that expected it reads it)
                log.warning("worker thread %s failed: %s: %s", name, type(exc).__name__, exc)


def start_world(
    backend: str, size: int = 3, init_method: str | None = None, **options: Any
) -> World:
    """Start ``size`` workers named ``worker0..``; this thread becomes ``worker0``.

    ``init_method`` defaults to a fresh ``file://`` rendezvous (no ports needed);
    ``options`` are ``TensorPipeRpcBackendOptions`` fields (``rpc_timeout``, ...).
    """
    spec = resolve_backend(backend)
    tmpdir = tempfile.TemporaryDirectory(prefix="rpcx-world-")
    if init_method is None:
        init_method = "file://" + os.path.join(tmpdir.name, "rendezvous")
    world = World(
        backend=spec.name, size=size, init_method=init_method,
        names=[f"worker{r}" for r in range(size)],
        multi_process=spec.capabilities.multi_process and not spec.capabilities.in_process,
        _tmpdir=tmpdir,
    )
    args = (size, init_method, spec.name, options)
    if world.multi_process:
        context = worker_context()
        for rank in range(1, size):
            process = context.Process(target=_serve, args=(rank, *args), daemon=True)
            process.start()
            world._processes.append(process)
    else:
        for rank in range(1, size):
            thread = threading.Thread(target=world._serve_in_thread, args=(rank, *args),
                                      name=f"rpcx-test-worker{rank}", daemon=True)
            thread.start()
            world._threads.append(thread)
    try:
        rpcx.init_rpc(
            "worker0", backend=spec.name, rank=0, world_size=size,
            rpc_backend_options=_options(spec.name, init_method, options),
        )
    except BaseException:
        for process in world._processes:
            process.kill()
        deadline = time.monotonic() + _FAILED_START_JOIN
        # The worker threads fail too; wait for them a while (one that ends later still
        # keeps its error in thread_errors, away from threading.excepthook).
        for thread in world._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        tmpdir.cleanup()
        raise
    return world


@contextmanager
def world(
    backend: str, size: int = 3, init_method: str | None = None, **options: Any
) -> Iterator[World]:
    """``with world("gloo") as w:`` -- a world that is closed when the block ends."""
    started = start_world(backend, size, init_method, **options)
    try:
        yield started
    finally:
        started.close()


# ----------------------------------------------------------------------- dynamic worlds


LEAVE_EVENT = "rpcx-testing-leave"  # (the remote.set_event key that tells a joiner to go)


def _join_dynamic(name: str, rank: int, world_size: int | None, init_method: str,
                  backend: str, options: dict[str, Any], outcome: Any) -> None:
    """A worker process of a dynamic world: join (no ``world_size``), report, serve until
    told to leave (:meth:`DynamicWorld.leave`), then shut down. A refused join puts
    ``("refused", type, message)`` on ``outcome``; a join ``("joined", name)``."""
    from rpcx.testing import remote

    level = os.environ.get(LOG_LEVEL_ENV)
    if level and not logging.getLogger().handlers:
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        rpcx.init_rpc(name, backend=backend, rank=rank, world_size=world_size,
                      rpc_backend_options=_options(backend, init_method, options))
    except Exception as exc:
        outcome.put(("refused", type(exc).__name__, str(exc)))
        return
    outcome.put(("joined", name))
    remote.wait_for_event(LEAVE_EVENT, 3 * _JOIN_TIMEOUT)
    rpcx.shutdown()


@dataclass
class DynamicWorld:
    """A dynamic world (``init_rpc`` without ``world_size``) whose rank 0 is this
    process; others join and leave when a test says so."""

    backend: str
    init_method: str
    options: dict[str, Any]
    _processes: dict[str, Any] = field(default_factory=dict)

    def join(self, name: str, rank: int, timeout: float = _JOIN_TIMEOUT,
             world_size: int | None = None, **options: Any) -> tuple[str, ...]:
        """Start a process that joins as ``name`` at ``rank``; wait (bounded) until it
        joined or was refused; its outcome (``("joined", name)`` or ``("refused",
        error type, message)``). ``world_size``: join as a static worker instead (to
        check the refusal). ``options``: its backend options other than the world's
        (e.g. another ``auth_key``)."""
        context = worker_context()
        outcome = context.Queue()
        process = context.Process(
            target=_join_dynamic, daemon=True,
            args=(name, rank, world_size, self.init_method, self.backend,
                  {**self.options, **options}, outcome))
        process.start()
        self._processes[name] = process
        try:
            result: tuple[str, ...] = outcome.get(timeout=timeout)
        except Exception as exc:  # queue.Empty: it neither joined nor was refused
            raise TimeoutError(f"worker {name!r} did not join within {timeout:g} s "
                               f"(exit code {process.exitcode})") from exc
        if result[0] == "refused":
            process.join(timeout)
        return result

    def leave(self, name: str, timeout: float = _JOIN_TIMEOUT) -> None:
        """Tell worker ``name`` to shut down, and wait (bounded) for its process to end."""
        from rpcx.testing import remote

        rpcx.rpc_sync(name, remote.set_event, args=(LEAVE_EVENT,))
        process = self._processes.pop(name)
        process.join(timeout)
        if process.is_alive():
            raise TimeoutError(f"worker {name!r} did not leave within {timeout:g} s")

    def kill(self, name: str, timeout: float = _JOIN_TIMEOUT) -> None:
        """Kill worker ``name``'s process outright (``SIGKILL``: it says goodbye to
        nobody), and wait (bounded) until it is gone."""
        process = self._processes.pop(name)
        process.kill()
        process.join(timeout)
        if process.is_alive():
            raise TimeoutError(f"worker {name!r} (pid {process.pid}) outlived SIGKILL "
                               f"for {timeout:g} s")

    def close(self) -> None:
        """Every joiner leaves, then this worker; processes that do not end are killed."""
        try:
            for name in list(self._processes):
                process = self._processes[name]
                if process.is_alive():
                    with contextlib.suppress(Exception):
                        self.leave(name)
            if _context.maybe_current_agent() is not None:
                rpcx.shutdown(timeout=_JOIN_TIMEOUT)
        finally:
            for process in self._processes.values():
                process.join(5)
                if process.is_alive():
                    log.warning("worker process %s did not exit; killing it", process.pid)
                    process.kill()


@contextmanager
def dynamic_world(backend: str, name: str = "worker0", **options: Any
                  ) -> Iterator[DynamicWorld]:
    """``with dynamic_world("auto") as w:`` -- this process joins a new dynamic world as
    ``name`` (rank 0, the store's host), then ``w.join(...)`` adds workers. Every worker
    leaves when the block ends."""
    port = free_port()
    started = DynamicWorld(backend, f"tcp://127.0.0.1:{port}", options)
    rpcx.init_rpc(name, backend=backend, rank=0,
                  rpc_backend_options=_options(backend, started.init_method, options))
    try:
        yield started
    finally:
        started.close()
