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
import os
import pathlib
from collections.abc import Iterator

from rpcx import _context
from rpcx._trace_ring import DEFAULT_CAPACITY
from rpcx.calls import rpc_sync
from rpcx.trace_session import begin_session, end_session, session_of

__all__ = ["DEFAULT_CAPACITY", "TraceFiles", "is_tracing", "start", "stop", "trace"]


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


def _start_here(directory: str, capacity: int) -> None:
    begin_session(directory, capacity)


def _stop_here() -> str | None:
    path = end_session()
    return None if path is None else str(path)


@contextlib.contextmanager
def trace(directory: str | os.PathLike[str], *, capacity: int = DEFAULT_CAPACITY,
          world: bool = True) -> Iterator[TraceFiles]:
    """Record every worker (``world=False``: this one only) for the ``with`` block.

    The others are started before the block runs and stopped after it, each writing
    its own file into ``directory`` (a path every worker can write to: a shared one
    across hosts, or gather the files afterwards). Yields the list of files, filled
    when the block ends.
    """
    agent = _context.current_agent()
    files = TraceFiles()
    files.directory = pathlib.Path(directory)
    others = ([w for w in agent.members() if w.id != agent.rank] if world else [])
    started = []
    try:
        for worker in others:
            rpc_sync(worker, _start_here, args=(str(directory), capacity))
            started.append(worker)
        begin_session(directory, capacity, agent)
        try:
            yield files
        finally:
            mine = end_session(agent)
            if mine is not None:
                files.append(mine)
    finally:
        for worker in started:
            path = rpc_sync(worker, _stop_here)
            if path is not None:
                files.append(pathlib.Path(path))
