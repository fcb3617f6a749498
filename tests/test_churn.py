"""The churn's version in the suite (the longest is ``nox -s soak -- --churn``): a
dynamic world of 8 whose last 4 ranks leave and are joined again, 8 times in a row in
``nox -s tests`` and 100 in ``nox -s long``, every 4th departure a ``kill -9``, while
every worker in the world calls, passes RRefs, runs backward passes and steps a
``DistributedOptimizer`` through whoever is in it."""

from __future__ import annotations

import pytest

from rpcx.testing import churn


# 8 cycles churn every slot twice (two of them by kill -9) in the suite; the 100 in a
# row are a long run (``nox -s long``, which CI runs).
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cycles", [8, pytest.param(100, marks=pytest.mark.long)])
def test_workers_leave_and_join_while_the_others_work(cycles: int) -> None:
    result = churn.run("auto", size=8, slots=4, cycles=cycles, kill_every=4,
                       progress=lambda _: None)
    assert result.ok, result.problems
    assert result.kills == cycles // 4
    assert len(result.join_seconds) == 7 + cycles  # every join succeeded
    # The others kept working all along, through every kind of activity.
    assert all(result.counts.get(kind, 0) >= cycles for kind in (
        "call", "rref", "fork", "backward", "step")), result.counts
    # Every survivor and every worker in the world at the end was checked, and holds
    # nothing (the judge turned any count into a problem above). Slot rank r last
    # joined in the last cycle that churned it.
    assert set(result.leftovers) == {"lead", "stable1", "stable2", "stable3",
                                     *(f"slot{r}-{cycles - 7 + r}" for r in range(4, 8))}


def test_a_world_without_a_stable_worker_or_a_slot_is_refused() -> None:
    with pytest.raises(ValueError, match="a stable worker and a slot"):
        churn.run(size=5, slots=4)
