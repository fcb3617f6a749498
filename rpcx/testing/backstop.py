"""pytest plugin: a test that hangs where pytest-timeout cannot reach it still ends the run.

pytest-timeout's ``signal`` method (the default here) raises in the test when its time is
up, so the test's ``finally`` blocks run and the session goes on: the best outcome, and it
stays first. But a thread blocked inside a C++ call that retries on ``EINTR`` (a c10d
store waiting for a lock, a gloo wait) never sees the signal, and the run stalls until
CI's own limit ends it without a word. So each test also arms :mod:`faulthandler`'s
watchdog, a C thread the hang cannot block: ``BACKSTOP_GRACE`` seconds after the test's
timeout it writes every thread's stack to the terminal and ends the process (under
pytest-xdist, that worker: the run reports it crashed and goes on with a fresh one).
"""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

__all__ = ["BACKSTOP_GRACE", "backstop_seconds"]

# past the test's own timeout (pytest-timeout had its chance); $RPCX_BACKSTOP_GRACE overrides
BACKSTOP_GRACE = float(os.environ.get("RPCX_BACKSTOP_GRACE", "60"))

_stderr: Any = None  # the terminal, saved before pytest captures file descriptor 2


def pytest_configure(config: pytest.Config) -> None:
    """Keep a descriptor of the real stderr for the watchdog's report."""
    global _stderr
    if _stderr is None:
        stream = sys.__stderr__
        if stream is not None:
            _stderr = os.fdopen(os.dup(stream.fileno()), "w")


def backstop_seconds(item: pytest.Item) -> float | None:
    """When the watchdog ends a hung ``item``: its pytest-timeout (marker, command line,
    or ini file) plus :data:`BACKSTOP_GRACE`; ``None`` without a timeout."""
    marker = item.get_closest_marker("timeout")
    timeout: Any = None
    if marker is not None:
        timeout = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
    if timeout is None:
        try:
            timeout = item.config.getoption("timeout")
        except ValueError:  # pytest-timeout is not installed
            return None
    if timeout is None:
        timeout = item.config.getini("timeout") or None
    if timeout is None or float(timeout) <= 0:
        return None
    return float(timeout) + BACKSTOP_GRACE


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Arm the watchdog for the test's setup, call and teardown; disarm after."""
    seconds = backstop_seconds(item)
    if seconds is None or _stderr is None:
        yield
        return
    faulthandler.dump_traceback_later(seconds, exit=True, file=_stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
