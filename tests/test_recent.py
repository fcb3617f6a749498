"""rpcx._util.recent.RecentIds: seen once, in any order, in bounded memory."""

from __future__ import annotations

from rpcx._util.recent import RecentIds


def test_each_id_is_new_once_in_any_order() -> None:
    seen = RecentIds(size=8)
    assert [seen.add(i) for i in (3, 1, 2, 3, 1)] == [True, True, True, False, False]
    assert 2 in seen and 4 not in seen


def test_with_a_floor_ids_older_than_what_is_kept_count_as_seen() -> None:
    seen = RecentIds(size=4)
    for i in range(1, 11):
        assert seen.add(i)
    assert not seen.add(5)  # forgotten, but at or below the floor: a duplicate
    assert seen.add(11)


def test_without_a_floor_forgotten_ids_are_new_again() -> None:
    answered = RecentIds(size=4, floor=False)  # replies come back in any order
    for i in range(10, 20):
        answered.add(i)
    assert answered.add(3)  # an old call answered late: not a duplicate
    assert not answered.add(3)
