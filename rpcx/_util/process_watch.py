"""Asking the kernel whether a silent peer's process still runs (peers on this host).

A heartbeat cannot tell a peer starved of CPU from one that is stopped: both are silent.
On one host the kernel can. Each worker publishes its *mark* at start (the kernel it
runs on, its pid and network namespaces, its pid and start time); a worker that finds a
peer silent reads the peer's ``/proc/<pid>/stat``. A process that is running, sleeping
or waiting on I/O is alive, however late its frames; one that is stopped, a zombie, or
gone is not. The mark names the process exactly: the boot id and namespaces make sure
the pid means the same process here, and the start time that the pid was not reused.
Peers on other hosts (or in another network namespace, which a partition can cut off
while the process runs) get no answer, and the heartbeat decides alone.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

__all__ = ["PeerProcesses", "local_mark", "process_state"]

log = logging.getLogger("rpcx.heartbeat")

# The kernel's process states (proc(5)) that mean "alive, will run again by itself".
_ALIVE = {"R": "running", "S": "sleeping", "D": "waiting on I/O", "W": "paging", "I": "idle"}
_SEPARATOR = "|"


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return ""


def _namespace(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, str] | None:
    """``(state, start time)`` of process ``pid``, or ``None`` if it does not exist."""
    text = _read(f"/proc/{pid}/stat")
    if not text:
        return None
    # "pid (comm) state ...": comm may hold spaces and parentheses; the last ')' ends it.
    fields = text[text.rfind(")") + 2:].split()
    if len(fields) < 20:
        return None
    return fields[0], fields[19]  # proc(5): field 3 is the state, field 22 the start time


_kernel_of: dict[int, list[str]] = {}  # by pid: a forked child reads its own


def _kernel() -> list[str]:
    """This process's boot id and pid and network namespaces (read once per process:
    the heartbeat asks for every quiet peer every interval)."""
    pid = os.getpid()
    found = _kernel_of.get(pid)
    if found is None:
        found = [_read("/proc/sys/kernel/random/boot_id"), _namespace("pid"),
                 _namespace("net")]
        _kernel_of.clear()
        _kernel_of[pid] = found
    return found


def _same_kernel(parts: list[str]) -> bool:
    kernel = _kernel()
    return len(parts) == 5 and all(kernel) and parts[:3] == kernel and parts[3].isdigit()


def local_mark() -> bytes:
    """This process's mark: its kernel, pid and network namespaces, pid and start time."""
    pid = os.getpid()
    found = _stat(pid)
    return _SEPARATOR.join([*_kernel(), str(pid), found[1] if found else ""]).encode()


def process_state(mark: bytes) -> tuple[str, int] | None:
    """``(state, pid)`` of the process ``mark`` names, the state a letter of proc(5)
    (``R``, ``S``, ``T``, ...) or ``"gone"``; ``None`` when the kernel here cannot say (the
    mark is of another host or namespace, malformed, or this is not Linux)."""
    parts = mark.decode(errors="replace").split(_SEPARATOR)
    if not _same_kernel(parts):
        return None
    pid = int(parts[3])
    found = _stat(pid)
    if found is None or found[1] != parts[4]:
        return "gone", pid  # exited (or its pid now belongs to another process)
    return found[0], pid


class PeerProcesses:
    """Vouches for silent peers whose processes the kernel here says are alive.

    The agent hands over every peer's mark once the world is ready (:meth:`learn`);
    ``fetch(rank)`` returns the mark of one it lacks (a worker that joined later; ``None``
    if there is none), fetched when that peer first goes silent, and kept. One that
    cannot be had is asked for again only after ``retry_after`` seconds, so a store that
    does not answer costs one wait now and then, not one per look.
    """

    def __init__(self, fetch: Callable[[int], bytes | None], retry_after: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self._retry_after = retry_after
        self._clock = clock
        self._marks: dict[int, bytes] = {}
        self._failed_at: dict[int, float] = {}

    def learn(self, marks: dict[int, bytes]) -> None:
        """Peers' marks, by rank (read from the store in one operation at start)."""
        self._marks.update(marks)

    def forget(self, rank: int) -> None:
        """Another process holds ``rank`` now (a dynamic world): fetch its mark again."""
        self._marks.pop(rank, None)
        self._failed_at.pop(rank, None)

    def knows(self, rank: int) -> bool:
        """Whether the kernel here can say if ``rank``'s process runs, without asking the
        store (its mark is known and names a process of this host and namespace)."""
        mark = self._marks.get(rank)
        return mark is not None and _same_kernel(mark.decode(errors="replace").split(_SEPARATOR))

    def vouch(self, rank: int) -> str | None:
        """Why ``rank``'s process is alive, in words, or ``None`` if the kernel here does not
        say so (stopped, gone, on another host, or its mark unknown)."""
        mark = self._marks.get(rank)
        if mark is None:
            failed = self._failed_at.get(rank)
            now = self._clock()
            if failed is not None and now - failed < self._retry_after:
                return None
            try:
                mark = self._fetch(rank)
            except Exception as exc:  # the store did not answer: no evidence now
                log.debug("no process mark for rank %d: %s", rank, exc)
                mark = None
            if mark is None:
                self._failed_at[rank] = now
                return None
            self._marks[rank] = mark
        found = process_state(mark)
        if found is None:
            return None
        state, pid = found
        if state not in _ALIVE:
            return None
        return f"its process {pid} on this host is {_ALIVE[state]} (kernel state {state})"
