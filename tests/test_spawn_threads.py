"""rpcx.spawn on an in-process backend: a worker thread that ends without shutdown().

A process that exits without ``rpcx.shutdown()`` leaves non-gracefully (an ``atexit``
handler); a spawned *thread* must do the same, or its agent stays up: the other workers'
graceful shutdown then waits for it forever, and the interpreter aborts at exit.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

import rpcx
from rpcx._core import context as _context

JOIN = 60.0  # generous bound: the world below takes well under a second


def _leaves_without_shutdown(rank: int, world_size: int) -> None:
    rpcx.init_rpc(f"w{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        return  # no shutdown()
    rpcx.shutdown()  # graceful: waits for w0, which must leave for this to return


def _raises_without_shutdown(rank: int, world_size: int) -> None:
    rpcx.init_rpc(f"w{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        raise ValueError("boom")
    rpcx.shutdown()


_SEEN: dict[str, list[rpcx.MembershipChange]] = {}


def _says_why_it_left(rank: int, world_size: int, key: str, watching: threading.Event) -> None:
    rpcx.init_rpc(f"w{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        assert watching.wait(JOIN)
        return  # no shutdown(), once w1 watches
    gone = threading.Event()
    _SEEN[key] = []
    rpcx.on_membership_change(lambda change: (_SEEN[key].append(change), gone.set()))
    watching.set()
    assert gone.wait(JOIN)
    rpcx.shutdown()


def test_peers_hear_that_a_thread_ended_without_shutdown() -> None:
    key = uuid.uuid4().hex
    context = rpcx.spawn(_says_why_it_left, args=(2, key, threading.Event()), nprocs=2,
                         backend="loopback", join=False)
    assert context.join(timeout=JOIN)
    [change] = _SEEN.pop(key)
    assert (change.kind, change.worker.name, change.reason) == (
        "left", "w0", "left without calling shutdown(): its spawned thread ended")


def test_thread_ending_without_shutdown_leaves_and_peers_finish() -> None:
    context = rpcx.spawn(_leaves_without_shutdown, args=(2,), nprocs=2, backend="loopback",
                         join=False)
    assert context.join(timeout=JOIN), "a worker's graceful shutdown waited for w0 forever"
    assert not [a for a in _context.running_agents() if a.name in ("w0", "w1")]


def test_thread_raising_without_shutdown_leaves() -> None:
    context = rpcx.spawn(_raises_without_shutdown, args=(2,), nprocs=2, backend="loopback",
                         join=False)
    with pytest.raises(rpcx.WorkerFailedError, match="boom"):
        context.join(timeout=JOIN)
    for thread in context.threads:
        thread.join(JOIN)
        assert not thread.is_alive()
    assert not [a for a in _context.running_agents() if a.name in ("w0", "w1")]


def test_program_whose_worker_raised_exits_cleanly(tmp_path: Path) -> None:
    # Before the fix the interpreter aborted at exit ("terminate called without an
    # active exception", SIGABRT) because the raising worker's agent was still running.
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent("""
        import rpcx

        def run(rank, world_size):
            rpcx.init_rpc(f"w{rank}", rank=rank, world_size=world_size)
            if rank == 0:
                raise ValueError("boom")
            rpcx.shutdown()

        if __name__ == "__main__":
            try:
                rpcx.spawn(run, args=(2,), nprocs=2, backend="loopback")
            except rpcx.WorkerFailedError:
                print("caught")
    """))
    root = Path(rpcx.__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "caught"
    assert "terminate called" not in result.stderr
