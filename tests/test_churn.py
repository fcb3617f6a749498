"""The churn's version in the suite (the long one is ``nox -s soak -- --churn``): a
dynamic world of 8 whose last 4 ranks leave and are joined again, 100 times in a row,
every 4th departure a ``kill -9``, while every worker in the world calls, passes RRefs,
runs backward passes and steps a ``DistributedOptimizer`` through whoever is in it."""

from __future__ import annotations

import pytest

from rpcx.testing import churn


@pytest.mark.timeout(600)
def test_workers_leave_and_join_100_times_while_the_others_work() -> None:
    result = churn.run("auto", size=8, slots=4, cycles=100, kill_every=4,
                       progress=lambda _: None)
    assert result.ok, result.problems
    assert result.kills == 25
    assert len(result.join_seconds) == 7 + 100  # every join succeeded
    # The others kept working all along, through every kind of activity.
    assert all(result.counts.get(kind, 0) >= 100 for kind in (
        "call", "rref", "fork", "backward", "step")), result.counts
    # Every survivor and every worker in the world at the end was checked, and holds
    # nothing (the judge turned any count into a problem above).
    assert set(result.leftovers) == {"lead", "stable1", "stable2", "stable3", "slot4-97",
                                     "slot5-98", "slot6-99", "slot7-100"}


def test_a_world_without_a_stable_worker_or_a_slot_is_refused() -> None:
    with pytest.raises(ValueError, match="a stable worker and a slot"):
        churn.run(size=5, slots=4)
