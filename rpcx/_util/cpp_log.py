"""torch's C++ warnings held back while a world runs.

c10d, the C++ side of torch.distributed that rpcx's rendezvous store and gloo backend
run on, writes its warnings straight to the terminal, stack traces included: a store
connection that broke during a partition printed 20 lines of C++ backtrace, a host
without reverse DNS prints ``The hostname of the client socket cannot be retrieved`` for
every connection the store takes. They concern rpcx's own use of c10d, and rpcx says
what a user needs from them in its own words (an error naming the worker and the
cause, a log line), so from the first ``init_rpc`` of a process until its last worker
has shut down, torch's C++ log level is raised to errors (``FLAGS_caffe2_log_level``,
what ``TORCH_CPP_LOG_LEVEL=ERROR`` sets at start-up). A user who sets
``TORCH_CPP_LOG_LEVEL`` chooses: rpcx then leaves the level alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

__all__ = ["hold_back", "let_through"]

log = logging.getLogger("rpcx")

LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
_ERROR = 2  # c10's levels: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL

_lock = threading.Lock()
_worlds = 0  # workers of this process that hold the level up
_before: int | None = None  # the level to put back (None: rpcx did not change it)
_flag: ctypes.c_int | None = None
_looked = False


def _level() -> ctypes.c_int | None:
    """c10's log level variable, or ``None`` where it cannot be found (another build)."""
    global _flag, _looked
    if not _looked:
        _looked = True
        path = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
        try:
            _flag = ctypes.c_int.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_log_level")
        except (OSError, ValueError) as exc:  # no such library or symbol: leave it
            log.debug("torch's C++ log level cannot be set here: %s", exc)
    return _flag


def hold_back() -> None:
    """A worker of this process starts: C++ warnings held back (see the module's notes)."""
    global _worlds, _before
    with _lock:
        _worlds += 1
        if _worlds > 1 or LEVEL_ENV in os.environ:
            return
        flag = _level()
        if flag is not None and flag.value < _ERROR:
            _before, flag.value = flag.value, _ERROR


def let_through() -> None:
    """A worker of this process is gone: after the last, the level is as it was."""
    global _worlds, _before
    with _lock:
        _worlds = max(0, _worlds - 1)
        if _worlds or _before is None:
            return
        flag = _level()
        if flag is not None:
            flag.value = _before
        _before = None
