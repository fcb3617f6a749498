"""Stop a child process (``SIGSTOP``) for the length of a ``with`` block.

``kill()`` returns before the stop takes hold: on a busy host a thread of the target
can still be running, and answer one more request, a moment after the signal was sent.
A test that asserts what a stopped process cannot do therefore waits until the kernel
reports the process stopped, which :func:`stopped` does.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator


def stop(pid: int) -> None:
    """Stop the child process ``pid`` and return once every thread of it is stopped.

    The wait is the kernel's own report (``waitpid`` with ``WUNTRACED``), so ``pid``
    must be a child of this process; the test's timeout bounds it.
    """
    os.kill(pid, signal.SIGSTOP)
    _, status = os.waitpid(pid, os.WUNTRACED)
    if not os.WIFSTOPPED(status):
        raise AssertionError(f"process {pid} ended (wait status {status}) instead of stopping")


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """Keep the child process ``pid`` stopped while the block runs, then let it go on."""
    stop(pid)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
