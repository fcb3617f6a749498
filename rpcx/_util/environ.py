"""An environment variable set for a block, then put back as it was.

rpcx sets variables that other code reads from the environment at one moment (torch's
TensorPipe agent reads ``TP_SOCKET_IFNAME`` when it starts; worker processes read
``RPCX_FAULTS`` when they are started). Left set, they would leak into processes started
later and into later worlds.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["environment_variable"]


@contextlib.contextmanager
def environment_variable(name: str, value: str | None) -> Iterator[None]:
    """``$name`` is ``value`` inside the block, and afterwards what it was before (unset
    if it was unset), even when the block raises. ``None`` leaves the variable alone."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
