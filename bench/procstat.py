"""What /proc says a process did: CPU time, thread wake-ups, I/O calls and bytes.

A :func:`snapshot` of a process (any process of this user on this host, by its id) reads

* ``/proc/<pid>/stat``: ``utime`` + ``stime`` (clock ticks, usually 10 ms; the whole
  process, threads that already ended included);
* ``/proc/<pid>/task/*/schedstat``: each live thread's time on a CPU in nanoseconds (the
  precise clock, but a thread that ended before the second snapshot is missing from it);
* ``/proc/<pid>/task/*/status``: each live thread's ``voluntary_ctxt_switches`` and
  ``nonvoluntary_ctxt_switches``: every time a thread went to sleep and woke again, or
  was preempted. Their sum is the count of thread wake-ups;
* ``/proc/<pid>/io``: ``rchar``/``wchar`` (bytes through read- and write-type calls) and
  ``syscr``/``syscw`` (the calls). The kernel counts ``read``/``write``/``readv``/
  ``writev``/``pread``/``pwrite`` (and eventfd or pipe writes: they are writes), **not**
  ``sendmsg``/``recvmsg``/``sendto``/``recvfrom``, and not bytes moved through shared
  memory; so they count a transport's calls only where it uses the former.

A process that reads its own ``io`` file at a window's start adds that read (two calls,
about 100 bytes) to the window: over N steps, 2/N read calls per step.

:func:`delta` subtracts two snapshots; threads present in only one of them are counted
(``threads_started``, ``threads_ended``) so a window where threads came and went can be
read with that in mind.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _read(path: pathlib.Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # a thread that just ended
        return None


def _stat_cpu_s(pid: int) -> float:
    text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) * TICK_S


def _io(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    text = _read(pathlib.Path(f"/proc/{pid}/io"))
    for line in (text or "").splitlines():
        key, _, value = line.partition(":")
        if key in ("rchar", "wchar", "syscr", "syscw"):
            out[key] = int(value)
    return out


def snapshot(pid: int, io_last: bool = True) -> dict[str, Any]:
    """Counters of process ``pid`` now (see the module docstring).

    Reading /proc is itself reading: a process that reads its own counters adds those
    reads to them. ``io_last`` (at a window's start) reads ``io`` after everything else,
    ``io_last=False`` (at its end) before, so neither snapshot's own reads fall inside
    the window.
    """
    io = None if io_last else _io(pid)
    threads: dict[str, dict[str, int]] = {}
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        status = _read(task / "status")
        sched = _read(task / "schedstat")
        if status is None or sched is None:
            continue
        switches = 0
        for line in status.splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                switches += int(line.split()[1])
        threads[task.name] = {"switches": switches, "cpu_ns": int(sched.split()[0])}
    cpu_s = _stat_cpu_s(pid)
    return {"pid": pid, "cpu_s": cpu_s, "io": _io(pid) if io is None else io,
            "threads": threads}


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the process did between two snapshots."""
    common = before["threads"].keys() & after["threads"].keys()
    started = after["threads"].keys() - before["threads"].keys()
    out: dict[str, Any] = {
        "cpu_s": after["cpu_s"] - before["cpu_s"],
        # Threads that started in the window count from zero; ended ones are lost.
        "cpu_sched_s": (sum(after["threads"][t]["cpu_ns"] - before["threads"][t]["cpu_ns"]
                            for t in common)
                        + sum(after["threads"][t]["cpu_ns"] for t in started)) / 1e9,
        "wakeups": (sum(after["threads"][t]["switches"] - before["threads"][t]["switches"]
                        for t in common)
                    + sum(after["threads"][t]["switches"] for t in started)),
        "per_thread": {
            t: {"wakeups": after["threads"][t]["switches"]
                - before["threads"].get(t, {"switches": 0})["switches"],
                "cpu_ms": (after["threads"][t]["cpu_ns"]
                           - before["threads"].get(t, {"cpu_ns": 0})["cpu_ns"]) / 1e6}
            for t in after["threads"]},
        "threads": len(after["threads"]),
        "threads_started": len(started),
        "threads_ended": len(before["threads"].keys() - after["threads"].keys()),
    }
    for key in ("rchar", "wchar", "syscr", "syscw"):
        if key in before["io"] and key in after["io"]:
            out[key] = after["io"][key] - before["io"][key]
    return out
