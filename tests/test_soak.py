"""The soak's short version (the long one is ``nox -s soak``): four workers calling each
other with faults injected, nothing lost, nothing left, memory flat."""

from __future__ import annotations

import json

import pytest
import torch

import rpcx
from rpcx.faulty import FAULTS_ENV
from rpcx.testing import soak
from rpcx.testing.world import world


@pytest.mark.timeout(300)
def test_a_short_soak_under_faults_loses_nothing_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(FAULTS_ENV, json.dumps(soak.DEFAULT_FAULTS))  # (restored after)
    result = soak.run("faulty:gloo", rounds=30, calls=50, rrefs=5, progress=lambda _: None)
    assert result.ok, result.problems
    assert result.calls == 30 * 4 * 50 and result.rrefs == 30 * 4 * 5
    assert result.backwards == 30 * 4
    assert set(result.leftovers) == {f"worker{r}" for r in range(4)}
    # Faults were injected and rpcx sent lost bookkeeping again.
    assert sum(left["resent_frames"] for left in result.leftovers.values()) > 0
    assert all(len(curve) == 30 for curve in result.rss_mib.values())


def test_the_judge_reports_leftovers_and_growth() -> None:
    result = soak.SoakResult("x", rounds=8)
    result.leftovers = {"worker1": {"pending_calls": 0, "owned_rrefs": 2, "user_rrefs": 0,
                                    "references_to_owned": 0, "autograd_contexts": 1}}
    result.rss_mib = {"worker1": [100.0, 200.0, 200.0, 210.0, 250.0, 220.0, 200.0, 200.0]}
    soak._judge(result)
    assert result.growth == {"worker1": 0.25}  # 200 after warm-up, 250 at most
    assert result.problems == [
        "worker1: 2 owned rrefs left",
        "worker1: 1 autograd contexts left",
        "worker1: memory grew 25% after warm-up (200 -> 250 MiB; limit 10%)",
    ]
    # Where the worker named its entries (soak.leftovers does), the report carries them.
    result.problems = []
    result.leftovers["worker1"]["owned_entries"] = ["RRef (2, 7): never created", "x"]
    soak._judge(result)
    assert result.problems[0] == "worker1: 2 owned rrefs left (RRef (2, 7): never created; x)"


def test_a_worker_names_the_rrefs_it_still_owns() -> None:
    with world("loopback", size=2, rpc_timeout=30):
        held = rpcx.remote("worker1", torch.ones, args=(2,))
        assert held.to_here(timeout=30).sum() == 2
        left = rpcx.rpc_sync("worker1", soak.leftovers, timeout=30)
        assert left["owned_rrefs"] == 1
        (entry,) = left["owned_entries"]
        assert entry.startswith("RRef (0, ") and "created, holders [0]" in entry
        assert "value set; lost ranks [], workers ['worker0', 'worker1']" in entry
        del held
