"""Worker processes that start without importing torch: a fork server that has.

A process started with ``spawn`` is a fresh interpreter that imports torch before it
runs a line of its own: 2-3 s of CPU on a 2-core machine, paid again by every worker.
``multiprocessing``'s ``forkserver`` start method, with torch and rpcx preloaded, pays
that once: a server process imports them, and each worker is a fork of it, ready in
milliseconds. The server is a clean process that ran nothing but those imports (no
threads of the program, no CUDA context, none of the program's state), which is what
makes the fork safe where forking the program itself is not.

A forked worker differs from a spawned one in four ways, and :func:`run_as_spawned`,
its entry point, undoes each: its environment, standard output and standard error are
the server's (as they were when the server started), so the starter's current ones are
carried over (a test capturing a worker's output, a program whose output is piped);
torch's random generator is the server's, so it is seeded anew (Python's ``random``
reseeds itself after a fork); and it leaves through ``os._exit``, past the
interpreter's exit handlers, so those run (rpcx's own says goodbye for a worker that
never called ``shutdown()``). ``sys.path``, the working directory and the main module
travel as they do with ``spawn``.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import reduction
from typing import Any

__all__ = ["FORKSERVER", "PRELOAD", "StarterStdio", "available", "context", "run_as_spawned",
           "starter"]

FORKSERVER = "forkserver"
PRELOAD = ("torch", "rpcx")  # what the server imports before it forks a worker


def available() -> bool:
    """Whether workers start from the fork server by default here: on Linux. Windows has
    no ``forkserver``; macOS has it, but a fork of a process that loaded Apple's
    frameworks (as torch does) can crash, which is why Python defaults to ``spawn``
    there, and so does rpcx."""
    return sys.platform.startswith("linux") and (
        FORKSERVER in multiprocessing.get_all_start_methods())


def context(preload: Sequence[str] = PRELOAD) -> Any:
    """The ``forkserver`` context, its server set to import ``preload`` (and torch and
    rpcx) when it starts. The server is one per process and starts on the first
    ``Process.start()``; a preload asked for after that takes no effect."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    asked = list(getattr(server, "_preload_modules", []))  # (what the program asked for)
    multiprocessing.set_forkserver_preload(list(dict.fromkeys([*asked, *PRELOAD, *preload])))
    return multiprocessing.get_context(FORKSERVER)


class StarterStdio:
    """The starter's standard output and error, handed to a forked worker: put it in the
    worker's arguments; unpickled there, it is the two descriptors, passed by the fork
    server (``multiprocessing.reduction.DupFd``) as the worker starts."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_received, tuple(reduction.DupFd(fd) if _is_open(fd) else None
                                 for fd in (1, 2)))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # (a starter whose output is closed: the worker keeps the server's)
        return False
    return True


def _received(out: Any, err: Any) -> tuple[int | None, int | None]:
    return (None if out is None else out.detach(), None if err is None else err.detach())


def starter() -> tuple[dict[str, str], StarterStdio]:
    """What :func:`run_as_spawned` needs of the starter, taken now: its environment and
    its standard output and error (pass both first among the worker's arguments)."""
    return dict(os.environ), StarterStdio()


def run_as_spawned(environ: Mapping[str, str], stdio: Any, target: Callable[..., Any],
                   args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
    """A forked worker's entry: ``target(*args, **kwargs)`` run as a spawned worker would
    run it, in the environment ``environ`` and with the standard output and error
    ``stdio`` (a :class:`StarterStdio`, passed as the starter's at the start)."""
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    for stream, fd, mine in ((sys.stdout, 1, stdio[0]), (sys.stderr, 2, stdio[1])):
        if mine is None:
            continue
        if stream is not None:
            stream.flush()
        os.dup2(mine, fd)
        os.close(mine)
    import torch

    torch.seed()
    try:
        return target(*args, **(kwargs or {}))
    finally:
        atexit._run_exitfuncs()
