"""Stop a process (``SIGSTOP``) for the length of a ``with`` block.

``kill()`` returns before the stop takes hold: on a busy host a thread of the target
can still be running, and answer one more request, a moment after the signal was sent.
A test that asserts what a stopped process cannot do therefore waits until the kernel
reports the process stopped, which :func:`stopped` does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

STOP_BOUND = 60.0  # seconds the kernel may take to stop every thread (a starved host)


def stop(pid: int, timeout: float = STOP_BOUND) -> None:
    """Stop process ``pid`` and return once every thread of it is stopped.

    The wait reads the kernel's own report, each thread's state in ``/proc``, so ``pid``
    need not be a child of this process (test workers are the fork server's children);
    it gives up after ``timeout`` seconds.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = _thread_states(pid)
        if not states or "Z" in states or "X" in states:
            raise AssertionError(f"process {pid} ended instead of stopping")
        if states <= {"T", "t"}:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} was not stopped {timeout:g} s after "
                                 f"SIGSTOP (its threads' states: {sorted(states)})")
        time.sleep(0.001)  # (a poll of the kernel's state, bounded above)


def _thread_states(pid: int) -> set[str]:
    """The state letter of each thread of ``pid`` (``/proc/PID/task/TID/stat``)."""
    states = set()
    with contextlib.suppress(FileNotFoundError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with (contextlib.suppress(FileNotFoundError, ProcessLookupError),
                  open(f"/proc/{pid}/task/{task}/stat") as stat):
                states.add(stat.read().rsplit(")", 1)[1].split()[0])
    return states


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """Keep process ``pid`` stopped while the block runs, then let it go on."""
    stop(pid)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
