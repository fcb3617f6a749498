"""``rpcx launch -n N [--backend B] script.py [args ...]``: N workers of a script, on
this host, as ``torchrun --standalone`` would start them.

The launcher hosts the rendezvous store (as torchrun's agent does) and starts each
worker with torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``, ...), so ``init_method="env://"``, ``rpcx.launch`` and
``dist.init_process_group`` all meet there; ``--backend`` sets ``$RPCX_BACKEND``, and
``OMP_NUM_THREADS`` is 1 unless set (as torchrun sets it). Each
line a worker prints comes out prefixed with its name. When a worker fails, the others
are stopped and the launcher exits with the failed worker's status; Ctrl-C (SIGINT or
SIGTERM to the launcher) stops every worker and exits with 130.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

__all__ = ["launch_script"]

_STOP_GRACE = 10.0  # seconds a worker gets to exit after SIGINT/SIGTERM before SIGKILL
INTERRUPTED = 130


def _pump(stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock) -> None:
    """Copy ``stream`` to ``out`` line by line, each line prefixed."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def _stop(workers: Sequence[subprocess.Popen[bytes]], sig: int) -> None:
    """Signal every worker still running, then kill those not gone within the grace."""
    for worker in workers:
        if worker.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, sig)
    deadline = time.monotonic() + _STOP_GRACE
    for worker in workers:
        try:
            worker.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(_STOP_GRACE)


def launch_script(nprocs: int, script: str, script_args: Sequence[str],
                  backend: str | None = None) -> int:
    """Run ``nprocs`` workers of ``script``; the exit status (see the module docstring)."""
    from torch._C._distributed_c10d import TCPStore

    if nprocs < 1:
        print(f"rpcx launch: -n must be at least 1, got {nprocs}", file=sys.stderr)
        return 2
    # The rendezvous store lives here, as torchrun's agent hosts it: every worker,
    # rank 0 included, is a client, so any number of env:// rendezvous can share it.
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, multi_tenant=True)
    base = dict(os.environ)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0",
                GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nprocs),
                TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
                PYTHONUNBUFFERED="1")
    if backend:
        base["RPCX_BACKEND"] = backend
    if nprocs > 1 and "OMP_NUM_THREADS" not in base:
        base["OMP_NUM_THREADS"] = "1"  # as torchrun: N workers must not each take every core
    lock = threading.Lock()
    workers: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    interrupted = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        interrupted.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank in range(nprocs):
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
            # A session of its own: the launcher decides what reaches each worker.
            worker = subprocess.Popen([sys.executable, script, *script_args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      start_new_session=True)
            workers.append(worker)
            for stream, out in ((worker.stdout, sys.stdout), (worker.stderr, sys.stderr)):
                assert stream is not None
                pump = threading.Thread(target=_pump, args=(stream, out, f"[worker{rank}] ",
                                                            lock), daemon=True)
                pump.start()
                pumps.append(pump)
        status = _watch(workers, interrupted)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for pump in pumps:
        pump.join(_STOP_GRACE)
    del store
    return status


def _watch(workers: list[subprocess.Popen[bytes]], interrupted: threading.Event) -> int:
    """Wait for every worker; stop them all at the first failure or an interrupt."""
    while True:
        if interrupted.wait(0.1):
            print(f"rpcx launch: interrupted; stopping {len(workers)} workers",
                  file=sys.stderr)
            _stop(workers, signal.SIGINT)
            return INTERRUPTED
        codes = [worker.poll() for worker in workers]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            running = sum(1 for c in codes if c is None)
            print(f"rpcx launch: worker{rank} exited with status {code}; stopping "
                  f"{running} others", file=sys.stderr)
            _stop(workers, signal.SIGTERM)
            return code if code > 0 else 128 - code  # (killed by a signal: 128 + signal)
        if all(code == 0 for code in codes):
            return 0
