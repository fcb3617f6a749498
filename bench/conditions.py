"""The machine conditions a benchmark runs under: ``quiet`` and ``busy``.

``quiet``: nothing of the benchmark's own runs beside it (other users of a shared
machine still do). ``busy``: one CPU-bound process per core (``os.cpu_count()``) runs
beside it for the whole condition, started before its first round and stopped, by the
ids of the processes started, when its last round ends (or fails). A burner is a plain
Python busy loop in a process of its own, at the benchmark's own nice value (0 unless
the benchmark itself was started niced), so the scheduler shares the cores between the
benchmark's workers and the burners as it would between a training job and its
neighbours: "training machines are busy machines" (issue 27).

``run.py`` and ``examples.py`` take ``--conditions quiet,busy``: every condition runs
the whole table (all rounds, systems interleaved as usual), and :func:`drift_table`
puts the conditions side by side: per system and workload, the ratio vs torch in each
condition and its *drift*, the busy ratio divided by the quiet ratio. A drift of 1.00
means the backend kept its standing against torch under load; below 1 it lost ground
(it suffers more from the load than torch does), above 1 it gained. Issue 27's target
for the default backend is a drift within 25% of 1 (0.75 to 1.25); the table marks a
drift below that band ``!`` and one above it ``+``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

QUIET, BUSY = "quiet", "busy"
CONDITIONS = (QUIET, BUSY)
DRIFT_BAND = 0.25  # the target: every ratio of the default within 25% of its quiet value
JOIN_S = 5.0

DESCRIPTION = {
    QUIET: "quiet: nothing of the benchmark's own beside it",
    BUSY: "busy: one CPU-bound process per core beside it",
}


def parse(text: str) -> list[str]:
    """``"quiet,busy"`` -> ``["quiet", "busy"]``; raises ``ValueError`` on an unknown one."""
    names = [c for c in (part.strip() for part in text.split(",")) if c]
    unknown = [c for c in names if c not in CONDITIONS]
    if unknown or not names:
        raise ValueError(f"unknown condition(s) {unknown or [text]}; known: "
                         f"{', '.join(CONDITIONS)}")
    return [c for c in CONDITIONS if c in names]  # quiet first: drift is busy / quiet


def burner_count() -> int:
    """How many burners ``busy`` starts: one per core."""
    return os.cpu_count() or 1


def _burn(niceness: int) -> None:
    """A burner's body: a busy loop until killed."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    n = 0
    while True:
        n += 1


@contextlib.contextmanager
def condition(name: str) -> Iterator[dict[str, Any]]:
    """Run the body under condition ``name``; yields its facts (for the JSON)."""
    facts: dict[str, Any] = {"condition": name, "description": DESCRIPTION[name]}
    if name != BUSY:
        yield facts
        return
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    try:
        for index in range(burner_count()):
            proc = ctx.Process(target=_burn, args=(niceness,), name=f"bench-burner-{index}",
                               daemon=True)
            proc.start()
            procs.append(proc)
        time.sleep(1.0)  # let them reach their loops (a spawned interpreter starts slowly)
        facts.update(burners=len(procs), burner_pids=[p.pid for p in procs],
                     burner_nice=niceness)
        print(f"busy: {len(procs)} CPU-bound burner process(es) running "
              f"(pids {', '.join(str(p.pid) for p in procs)}, nice {niceness})",
              file=sys.stderr, flush=True)
        yield facts
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=JOIN_S)
        if procs:
            print(f"busy: burners stopped ({len(procs)})", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- drift


def drift(quiet_ratio: float | None, busy_ratio: float | None) -> float | None:
    """The busy ratio over the quiet one (1.00: the same standing against torch)."""
    if not quiet_ratio or busy_ratio is None:
        return None
    return busy_ratio / quiet_ratio


def _drift_text(value: float | None) -> str:
    if value is None:
        return "-"
    flag = " !" if value < 1 - DRIFT_BAND else " +" if value > 1 + DRIFT_BAND else ""
    return f"{value:.2f}{flag}"


def drift_table(rows: list[tuple[str, str]], systems: list[str],
                ratios: dict[str, dict[str, dict[str, float | None]]],
                conditions: list[str], default: str | None, what: str = "workload") -> str:
    """Markdown: per workload and rpcx system, each condition's ratio and the drift.

    ``rows``: ``(workload name, label)``; ``ratios[condition][system][workload]``: the
    ratio vs torch (>1 better) or ``None``. The drift column compares the last
    condition with the first (``busy`` with ``quiet``).
    """
    first, last = conditions[0], conditions[-1]
    rpcx_systems = [s for s in systems if s != "torch"]
    head = [what]
    for system in rpcx_systems:
        name = system + (" (default)" if system == default else "")
        head.extend(f"{name} {c}" for c in conditions)
        head.append(f"{name} drift")
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for key, label in rows:
        cells = [label]
        for system in rpcx_systems:
            values = [ratios.get(c, {}).get(system, {}).get(key) for c in conditions]
            cells.extend("-" if v is None else f"{v:.2f}x" for v in values)
            d = drift(ratios.get(first, {}).get(system, {}).get(key),
                      ratios.get(last, {}).get(system, {}).get(key))
            cells.append(_drift_text(d))
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    out.append(f"Ratios: each rpcx backend vs torch in the same condition, >1 is better. "
               f"Drift: the {last} ratio / the {first} ratio (1.00: the backend keeps its "
               f"standing against torch; below 1 it loses ground under load). "
               f"The target band for the default backend is {1 - DRIFT_BAND:.2f}-"
               f"{1 + DRIFT_BAND:.2f}: '!' marks a drift below it (rpcx lost ground), '+' "
               f"one above it (torch lost more than rpcx under load).")
    return "\n".join(out)
