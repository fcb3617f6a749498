"""The regression guard: did a backend fall far below its usual ratio to torch?

A benchmark run on this machine is noisy; a ratio to torch from the same run is what
holds still. ``bench/guard.json`` keeps, per backend and line, a floor: about half the
ratio the line has held on a quiet machine (the closing notes' figures, and where they
came from). The guard reads a ``bench/run.py`` result, lists every line under its
floor, and runs those lines again (``--rounds`` interleaved rounds, torch beside them)
before it calls one a regression: one slow run is noise until a second agrees.

What it would have caught: gloo's small round trip at 3.1 ms against torch's 0.45 ms
(0.14x, floor 0.45x) in one run of issue 51's harness. Run again, 0.62 and 0.91 ms
(0.73x, 0.49x): both over the floor, so the guard would have said "noise, once", not
"regression". Usage::

    python bench/guard.py                      # the newest bench/results/<stamp>.json
    python bench/guard.py RESULT.json [--rounds 3] [--no-rerun]

Exit status: 0 when nothing is under its floor (or every line under it recovered when
run again), 1 when a line stays under it, 2 when there is nothing to judge.
``nox -s bench`` runs it after ``bench/run.py``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
FLOORS = HERE / "guard.json"
STAMP = re.compile(r"^\d{8}-\d{6}\.json$")
BASELINE = "torch"


@dataclass(frozen=True)
class Reading:
    """One line of one backend, judged against its floor."""

    system: str
    line: str
    ratio: float
    floor: float

    @property
    def under(self) -> bool:
        """Whether the ratio fell below the floor."""
        return self.ratio < self.floor

    def __str__(self) -> str:
        return f"{self.system} {self.line}: {self.ratio:.2f}x (floor {self.floor:.2f}x)"


def newest_result(directory: pathlib.Path) -> pathlib.Path | None:
    """The newest plain ``<stamp>.json`` of bench/run.py in ``directory``."""
    found = sorted(p for p in directory.glob("*.json") if STAMP.match(p.name))
    return found[-1] if found else None


def quiet_medians(record: dict[str, Any]) -> dict[str, Any] | None:
    """The medians of the quiet, one-host run in a bench/run.py record, whatever its
    layout (one run; several conditions; several placements)."""
    if "median" in record:
        meta = record.get("meta", {})
        if meta.get("condition", "quiet") != "quiet" or meta.get(
                "placement", "one-host") != "one-host":
            return None
        return record["median"]  # type: ignore[no-any-return]
    runs = record.get("conditions") or record.get("runs") or {}
    for data in runs.values():
        if data.get("condition") == "quiet" and data.get("placement", "one-host") == "one-host":
            return data["median"]  # type: ignore[no-any-return]
    return None


def readings(medians: dict[str, Any], workloads: dict[str, Any],
             floors: dict[str, dict[str, float]]) -> list[Reading]:
    """Every line that has a floor and was measured for both the backend and torch."""
    scalars = medians.get("scalars", {})
    base = scalars.get(BASELINE, {})
    out = []
    for system, lines in floors.items():
        for line, floor in lines.items():
            value = scalars.get(system, {}).get(line, {}).get("value")
            reference = base.get(line, {}).get("value")
            if not value or not reference or line not in workloads:
                continue
            higher = workloads[line]["higher_is_better"]
            ratio = value / reference if higher else reference / value
            out.append(Reading(system, line, ratio, floor))
    return out


def rerun(under: list[Reading], rounds: int) -> dict[tuple[str, str], Reading]:
    """The lines under their floor measured again, torch beside them, in one run."""
    systems = [BASELINE, *sorted({r.system for r in under})]
    lines = sorted({r.line for r in under})
    with tempfile.TemporaryDirectory(prefix="rpcx-guard-") as out:
        subprocess.run([sys.executable, str(HERE / "run.py"), "--systems", ",".join(systems),
                        "--only", ",".join(lines), "--rounds", str(rounds),
                        "--out-dir", out], check=False, timeout=1800)
        result = newest_result(pathlib.Path(out))
        if result is None:
            return {}
        record = json.loads(result.read_text())
    floors: dict[str, dict[str, float]] = {}
    for r in under:
        floors.setdefault(r.system, {})[r.line] = r.floor
    medians = quiet_medians(record) or {}
    return {(r.system, r.line): r for r in readings(medians, record["workloads"], floors)}


def judge(first: list[Reading], again: dict[tuple[str, str], Reading] | None
          ) -> tuple[list[str], list[str]]:
    """``(regressions, noise)``, each a list of sentences."""
    regressions, noise = [], []
    for reading in (r for r in first if r.under):
        second = None if again is None else again.get((reading.system, reading.line))
        if again is None:
            regressions.append(f"{reading} (not run again)")
        elif second is None:
            regressions.append(f"{reading}; run again: no result")
        elif second.under:
            regressions.append(f"{reading}; again {second.ratio:.2f}x")
        else:
            noise.append(f"{reading}; again {second.ratio:.2f}x: noise, once")
    return regressions, noise


def main(argv: list[str] | None = None) -> int:
    """Judge a result; see the module's docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("result", nargs="?", type=pathlib.Path,
                        help="a bench/run.py JSON (default: the newest in bench/results)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds when a line is run again (default 3)")
    parser.add_argument("--no-rerun", action="store_true",
                        help="judge the one run: a line under its floor is a regression")
    args = parser.parse_args(argv)
    path = args.result or newest_result(HERE / "results")
    if path is None:
        print("guard: no bench/run.py result to judge")
        return 2
    record = json.loads(path.read_text())
    medians = quiet_medians(record)
    if medians is None:
        print(f"guard: {path} has no quiet one-host run to judge")
        return 2
    floors = json.loads(FLOORS.read_text())["floors"]
    first = readings(medians, record["workloads"], floors)
    if not first:
        print(f"guard: {path} measured no line that has a floor in {FLOORS.name}")
        return 2
    under = [r for r in first if r.under]
    again = rerun(under, args.rounds) if under and not args.no_rerun else None
    regressions, noise = judge(first, again)
    print(f"guard: {len(first)} lines of {path.name} against their floors in {FLOORS.name}")
    for sentence in noise:
        print(f"  {sentence}")
    for sentence in regressions:
        print(f"  REGRESSION {sentence}")
    if not regressions:
        print("  every line is over its floor" + (" after a second run" if noise else ""))
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
