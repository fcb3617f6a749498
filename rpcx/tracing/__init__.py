"""One timeline of every worker's calls.

Three ways to record (each worker writes ``DIR/<worker>.rpcx-trace.json``):

* ``RPCX_TRACE=DIR`` in every worker's environment, or
  ``RpcBackendOptions(trace_dir=DIR)``: from ``init_rpc`` to ``shutdown``;
* ``with rpcx.tracing.trace(DIR):`` on one worker: every worker of the world records
  for the block (a training step, say), and has written its file when it ends;
* :func:`start` / :func:`stop`: this worker alone.

Then ``rpcx trace merge DIR -o step.json`` writes one Chrome trace (Perfetto,
``chrome://tracing``) with the workers' clocks aligned, and ``rpcx trace plot DIR -o
step.png`` draws it. Recording appends to a bounded in-memory ring; nothing is written
until the trace ends. docs/guide/tracing.md shows how to read a trace;
docs/design/tracing.md gives the file format and how clocks are aligned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
from collections.abc import Iterator
from typing import Any

from rpcx._core import context as _context
from rpcx._services.calls import rpc_sync
from rpcx.tracing.ring import DEFAULT_CAPACITY
from rpcx.tracing.session import TraceSession, begin_session, end_session, session_of

__all__ = ["DEFAULT_CAPACITY", "TraceFiles", "is_tracing", "start", "stop", "trace"]

log = logging.getLogger("rpcx.tracing")


def start(directory: str | os.PathLike[str], *, capacity: int = DEFAULT_CAPACITY) -> None:
    """Start recording this worker's calls; its file goes to ``directory`` at
    :func:`stop`. ``capacity``: events kept (the newest), about 100 bytes each."""
    begin_session(directory, capacity)


def stop() -> pathlib.Path | None:
    """Stop recording this worker and write its trace file; returns its path (``None``
    if this worker was not recording)."""
    return end_session()


def is_tracing() -> bool:
    """Whether this worker is recording."""
    return session_of() is not None


class TraceFiles(list[pathlib.Path]):
    """The trace files a :func:`trace` block wrote, one per worker (filled as it ends)."""

    directory: pathlib.Path


# What a trace() block asks of the other workers, in order (see trace()).

def _prepare_here(directory: str, capacity: int) -> None:
    begin_session(directory, capacity, record=False)


def _record_here() -> None:
    _session().record()


def _quiet_here() -> None:
    _session().quiet()


def _stop_here() -> str | None:
    path = end_session()
    return None if path is None else str(path)


def _session() -> TraceSession:
    session = session_of()
    if session is None:
        raise RuntimeError(f"worker {_context.current_agent().name!r} is not tracing")
    return session


@contextlib.contextmanager
def trace(directory: str | os.PathLike[str], *, capacity: int = DEFAULT_CAPACITY,
          world: bool = True) -> Iterator[TraceFiles]:
    """Record every worker (``world=False``: this one only) for the ``with`` block.

    Every worker writes its own file into ``directory`` (a path each of them can write
    to: a shared one across hosts, or gather the files afterwards). Yields the list of
    files, filled when the block ends.

    The set-up is kept out of the trace: every worker first samples its clock with
    recording off, then the others switch recording on and this worker last; at the
    end this worker stops first, then the others, and only then do they take their
    last clock samples and write their files.
    """
    agent = _context.current_agent()
    directory = str(directory)
    files = TraceFiles()
    files.directory = pathlib.Path(directory)
    others = [w for w in agent.members() if w.id != agent.rank] if world else []
    prepared: list[Any] = []
    session: TraceSession | None = None
    try:
        for worker in others:
            rpc_sync(worker, _prepare_here, args=(directory, capacity))
            prepared.append(worker)
        session = begin_session(directory, capacity, agent, record=False)
        for worker in others:
            rpc_sync(worker, _record_here)
        session.record()
        yield files
    finally:
        # Every worker that started is stopped, even if one of them fails to answer.
        if session is not None:
            session.quiet()
        for worker in prepared:
            _ask(worker, _quiet_here)
        if session is not None:
            mine = end_session(agent)
            if mine is not None:
                files.append(mine)
        for worker in prepared:
            path = _ask(worker, _stop_here)
            if path is not None:
                files.append(pathlib.Path(path))


def _ask(worker: Any, func: Any) -> Any:
    """``rpc_sync(worker, func)`` while ending a trace: a failure is logged (the worker
    keeps no file) and the others are still stopped."""
    try:
        return rpc_sync(worker, func)
    except Exception as exc:
        log.warning("rpcx.tracing: could not end the trace on worker %r: %s", worker.name,
                    exc)
        return None
