"""Receive lanes (rpcx._core.lanes): the receiving role moves when a served request blocks."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from rpcx._core.lanes import LaneWatch, ReceiveLane, current_lane
from rpcx._util import pool as _pool

TIMEOUT = 10.0


class Loop:
    """A fake receive loop: delivers items from a list, in order, on the lane's holder."""

    def __init__(self, items: list[Callable[[], None]]) -> None:
        self.items = items
        self.next = 0
        self.lock = threading.Lock()
        self.threads: list[str] = []
        self.done = threading.Event()
        self.lane = ReceiveLane("test", self.run, self.start)

    def start(self, resume: Callable[[], None]) -> None:
        threading.Thread(target=resume, daemon=True).start()

    def run(self) -> None:
        self.lane.enter()
        while True:
            with self.lock:
                if self.next == len(self.items):
                    self.lane.leave()
                    self.done.set()
                    return
                item = self.items[self.next]
                self.next += 1
            self.threads.append(threading.current_thread().name)
            assert current_lane() is self.lane
            self.lane.serve(item)
            if not self.lane.still_held():
                assert current_lane() is None
                return


def test_items_served_on_the_receiving_thread_when_nothing_blocks() -> None:
    ran: list[int] = []
    loop = Loop([lambda i=i: ran.append(i) for i in range(5)])  # type: ignore[misc]
    worker = threading.Thread(target=loop.run, name="receiver")
    worker.start()
    assert loop.done.wait(TIMEOUT)
    worker.join(TIMEOUT)
    assert ran == [0, 1, 2, 3, 4]
    assert set(loop.threads) == {"receiver"}


def test_a_wait_rpcx_sees_hands_receiving_to_a_follower_at_once() -> None:
    release = threading.Event()
    later: list[str] = []

    def blocks() -> None:
        with _pool.blocking():  # what every rpcx wait does
            assert release.wait(TIMEOUT)

    def after() -> None:
        later.append(threading.current_thread().name)
        release.set()  # only a follower can get here while the first item blocks

    loop = Loop([blocks, after])
    worker = threading.Thread(target=loop.run, name="receiver")
    worker.start()
    assert loop.done.wait(TIMEOUT)
    worker.join(TIMEOUT)
    assert later and later[0] != "receiver"


def test_the_watchdog_moves_receiving_off_a_wait_rpcx_cannot_see() -> None:
    release = threading.Event()

    def blocks() -> None:
        assert release.wait(TIMEOUT)  # a plain Event: no _pool.blocking()

    loop = Loop([blocks, release.set])
    watch = LaneWatch("test", interval=0.005)
    watch.add(loop.lane)
    try:
        worker = threading.Thread(target=loop.run, name="receiver")
        worker.start()
        assert loop.done.wait(TIMEOUT)
        worker.join(TIMEOUT)
    finally:
        watch.close(TIMEOUT)
    assert loop.threads[0] == "receiver" and loop.threads[1] != "receiver"


def test_hand_off_is_one_shot_and_only_while_serving() -> None:
    lane = ReceiveLane("test", lambda: None, lambda resume: started.append(resume))
    started: list[Callable[[], None]] = []
    lane.enter()
    assert not lane.hand_off()  # not serving: nothing to hand off

    def nested() -> None:
        assert lane.hand_off()
        assert not lane.hand_off()

    lane.serve(nested)
    assert len(started) == 1
    assert not lane.still_held()


def test_held_here_tells_the_holder_without_changing_anything() -> None:
    lane = ReceiveLane("test", lambda: None, lambda resume: None)
    assert not lane.held_here()
    lane.enter()
    assert lane.held_here()
    seen: list[bool] = []
    other = threading.Thread(target=lambda: seen.append(lane.held_here()))
    other.start()
    other.join(TIMEOUT)
    assert seen == [False]
    assert lane.held_here() and lane.still_held()  # still the holder
    lane.serve(lambda: seen.append(lane.hand_off()))
    assert seen == [False, True] and not lane.held_here()


@pytest.mark.parametrize("blocks", [True, False])
def test_order_is_kept_across_hand_offs(blocks: bool) -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def item(i: int) -> Callable[[], None]:
        def run() -> None:
            with lock:
                seen.append(i)
            if blocks and i % 3 == 0:
                with _pool.blocking():
                    pass

        return run

    loop = Loop([item(i) for i in range(30)])
    worker = threading.Thread(target=loop.run, name="receiver")
    worker.start()
    assert loop.done.wait(TIMEOUT)
    worker.join(TIMEOUT)
    # Items start in order (each item's start happens before the next is taken).
    assert seen == list(range(30))


def test_serving_on_a_thread_the_role_left_does_not_mark_the_lane() -> None:
    # A thread whose role moved on (hand-off while it served) may still serve more
    # before it returns to its loop. That must not mark the lane as serving: the
    # watchdog would take the role from the real holder, which is receiving, and two
    # threads would read one peer.
    started: list[Callable[[], None]] = []
    lane = ReceiveLane("test", lambda: None, started.append)
    holder_entered, release = threading.Event(), threading.Event()

    def follower() -> None:
        lane.enter()
        holder_entered.set()
        release.wait(TIMEOUT)

    def outer() -> None:
        assert lane.hand_off()
        thread = threading.Thread(target=follower)
        thread.start()
        assert holder_entered.wait(TIMEOUT)
        seen: list[object | None] = []

        def inner() -> None:
            assert lane._serving is None  # not marked: this thread is not the holder
            seen.append(lane._hand_off_if_stuck(None))
            seen.append(lane._hand_off_if_stuck(seen[-1]))

        lane.serve(inner)
        assert seen == [None, None] and len(started) == 1  # no second follower
        release.set()
        thread.join(TIMEOUT)

    lane.enter()
    lane.serve(outer)
    assert not lane.still_held()


def test_a_nested_serve_keeps_the_outer_requests_hand_off() -> None:
    # A request served inside another on the holding thread (a call to this worker
    # itself) must not clear the outer request's mark when it ends: a wait later in
    # the outer request must still hand receiving off.
    started: list[Callable[[], None]] = []
    lane = ReceiveLane("test", lambda: None, started.append)
    lane.enter()

    def outer() -> None:
        outer_token = lane._serving
        lane.serve(lambda: None)  # the nested request
        assert lane._serving is outer_token
        assert lane.hand_off()  # the outer request's wait still moves the role

    lane.serve(outer)
    assert len(started) == 1 and not lane.still_held()


def test_the_watchdog_looks_only_while_a_request_is_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An idle worker's watchdog used to look 100 times a second; it now sleeps until a
    # lane starts serving, and again once nothing is served.
    looked, saw_nothing = threading.Event(), threading.Event()
    looks: list[object | None] = []
    real_look = ReceiveLane._hand_off_if_stuck

    def counting_look(lane: ReceiveLane, seen: object | None) -> object | None:
        result = real_look(lane, seen)
        looks.append(result)
        looked.set()
        if result is None:
            saw_nothing.set()
        return result

    monkeypatch.setattr(ReceiveLane, "_hand_off_if_stuck", counting_look)
    served = threading.Event()

    def serves_until_looked_at() -> None:
        assert looked.wait(TIMEOUT), "the watchdog never looked at a lane that serves"
        served.set()

    loop = Loop([serves_until_looked_at])
    watch = LaneWatch("test", interval=0.002)
    watch.add(loop.lane)
    try:
        assert not looked.wait(0.05), "the watchdog looked with nothing being served"
        worker = threading.Thread(target=loop.run, name="receiver")
        worker.start()
        # (Both, each waited for: under load a second look may find the request still
        # served and hand the lane off, and the follower can end the loop (done) before
        # the first thread has returned from the item.)
        assert loop.done.wait(TIMEOUT) and served.wait(TIMEOUT)
        worker.join(TIMEOUT)
        saw_nothing.clear()
        assert saw_nothing.wait(TIMEOUT), "the watchdog never saw the serving end"
        count = len(looks)
        looked.clear()
        assert not looked.wait(0.05), "the watchdog kept looking after serving ended"
        assert len(looks) == count
    finally:
        watch.close(TIMEOUT)
