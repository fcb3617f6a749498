"""bench/guard.py judges a run by its ratios to torch, and calls a line regressed only
when a second run agrees (the run itself is not repeated here: judge() takes both)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_guard", ROOT / "bench" / "guard.py")
assert _spec is not None and _spec.loader is not None
guard = importlib.util.module_from_spec(_spec)
sys.modules["bench_guard"] = guard
_spec.loader.exec_module(guard)

WORKLOADS = {"rpc_sync": {"higher_is_better": False},
             "rpc_async": {"higher_is_better": True}}


def _medians(**values: dict[str, float]) -> dict[str, Any]:
    return {"scalars": {system: {line: {"value": v} for line, v in lines.items()}
                        for system, lines in values.items()}}


def test_ratios_follow_the_bench_convention_better_is_above_one() -> None:
    medians = _medians(torch={"rpc_sync": 450.0, "rpc_async": 4000.0},
                       gloo={"rpc_sync": 3100.0, "rpc_async": 8000.0})
    got = {r.line: r for r in guard.readings(medians, WORKLOADS,
                                            {"gloo": {"rpc_sync": 0.45, "rpc_async": 0.4}})}
    assert got["rpc_sync"].ratio == pytest.approx(450 / 3100)
    assert got["rpc_sync"].under
    assert got["rpc_async"].ratio == pytest.approx(2.0)
    assert not got["rpc_async"].under


def test_a_line_not_measured_is_not_judged() -> None:
    medians = _medians(torch={"rpc_sync": 450.0}, gloo={"rpc_async": 1.0})
    assert guard.readings(medians, WORKLOADS, {"gloo": {"rpc_sync": 0.45}}) == []


def test_a_line_under_its_floor_twice_is_a_regression_once_is_noise() -> None:
    slow = guard.Reading("gloo", "rpc_sync", 0.14, 0.45)
    fine = guard.Reading("auto", "rpc_sync", 1.5, 0.75)
    regressions, noise = guard.judge(
        [slow, fine], {("gloo", "rpc_sync"): guard.Reading("gloo", "rpc_sync", 0.73, 0.45)})
    assert regressions == [] and len(noise) == 1 and "0.73x" in noise[0]
    regressions, noise = guard.judge(
        [slow, fine], {("gloo", "rpc_sync"): guard.Reading("gloo", "rpc_sync", 0.2, 0.45)})
    assert len(regressions) == 1 and "gloo rpc_sync" in regressions[0] and noise == []
    regressions, _ = guard.judge([slow], {})
    assert regressions == ["gloo rpc_sync: 0.14x (floor 0.45x); run again: no result"]


def test_the_quiet_one_host_run_is_found_in_every_layout() -> None:
    single = {"meta": {"condition": "quiet"}, "median": {"scalars": {"a": 1}}}
    assert guard.quiet_medians(single) == {"scalars": {"a": 1}}
    assert guard.quiet_medians({"meta": {"condition": "busy"}, "median": {}}) is None
    several = {"conditions": {"busy": {"condition": "busy", "median": {"b": 0}},
                              "quiet": {"condition": "quiet", "median": {"q": 1}}}}
    assert guard.quiet_medians(several) == {"q": 1}


def test_every_floor_names_a_known_line_and_is_below_what_it_guards() -> None:
    data = json.loads((ROOT / "bench" / "guard.json").read_text())
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from workloads import WORKLOADS as KNOWN
    finally:
        sys.path.remove(str(ROOT / "bench"))
    for system, lines in data["floors"].items():
        for line, floor in lines.items():
            assert line in KNOWN and KNOWN[line].kind == "scalar", (system, line)
            measured = data["measured"][system][line]
            assert 0 < floor < measured, (system, line, floor, measured)
