"""rpcx._core.retransmit: requests sent again with growing pauses until answered; copies of a
request answered from the reply kept, or dropped while it runs; a copy of a frame keeps
every field."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
import weakref
from typing import Any

import torch

from rpcx._core.retransmit import FIRST_PAUSE, LAST_PAUSE, ReplyCache, Resender
from rpcx.transport import Frame

BOUND = 10.0


class _Sent:
    def __init__(self) -> None:
        self.times: list[float] = []
        self.frames: list[tuple[int, Frame]] = []
        self.cond = threading.Condition()

    def __call__(self, dst: int, frame: Frame) -> None:
        with self.cond:
            self.times.append(time.monotonic())
            self.frames.append((dst, frame))
            self.cond.notify_all()

    def wait_for(self, count: int) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.frames) >= count, BOUND)


def test_a_request_is_sent_again_with_growing_pauses_until_answered() -> None:
    sent, pending = _Sent(), {7}
    resender = Resender("t", sent, pending.__contains__, lambda: None)
    try:
        original = Frame(b"header", request_id=7)
        started = time.monotonic()
        resender.track(7, 3, original)
        assert sent.wait_for(3)
        pending.discard(7)  # answered: no more copies
        count = len(sent.frames)
        # Pauses of FIRST_PAUSE, then twice that, then four times (up to LAST_PAUSE).
        assert sent.times[0] - started >= FIRST_PAUSE * 0.9
        assert sent.times[2] - started >= FIRST_PAUSE * 7 * 0.9
        assert all(dst == 3 and frame.header == b"header" and frame is not original
                   for dst, frame in sent.frames)
        time.sleep(LAST_PAUSE * 1.5)  # (the absence of a copy: nothing to wait on)
        assert len(sent.frames) <= count + 1  # at most the one already due
        assert resender.resent == len(sent.frames)
    finally:
        resender.close(BOUND)


def test_a_request_answered_before_its_pause_is_never_sent_again() -> None:
    sent: _Sent = _Sent()
    resender = Resender("t", sent, lambda rid: False, lambda: None)
    try:
        resender.track(1, 0, Frame(b"x"))
        time.sleep(FIRST_PAUSE * 3)  # (the absence of a copy)
        assert sent.frames == [] and resender.resent == 0
    finally:
        resender.close(BOUND)


def test_a_tracked_request_does_not_keep_its_calls_result_alive() -> None:
    # A frame's settled is its call's future.done: kept by the resender (a record lives
    # until the next pause after the answer), the future kept the result, and an RRef in
    # the result kept its owner's value past the caller's flush().
    class Result:
        pass

    pending = {5}
    sent = _Sent()
    resender = Resender("t", sent, pending.__contains__, lambda: None)
    try:
        future: torch.futures.Future[Any] = torch.futures.Future()
        frame = Frame(b"fetch", request_id=5, settled=future.done)
        resender.track(5, 1, frame)
        result = Result()
        alive = weakref.ref(result)
        future.set_result(result)
        # The caller drops the future and its result; rid 5 stays in ``pending`` here,
        # so the resender surely still holds its record (the test does not race it).
        del future, frame, result
        gc.collect()
        assert alive() is None
        assert resender._is_waiting(5)
    finally:
        resender.close(BOUND)


def test_a_copy_still_being_written_stops_waiting_once_its_request_is_answered() -> None:
    pending = {9}
    sent = _Sent()
    resender = Resender("t", sent, pending.__contains__, lambda: None)
    try:
        resender.track(9, 2, Frame(b"x", request_id=9))
        assert sent.wait_for(1)
        settled = sent.frames[0][1].settled
        assert settled is not None and not settled()
        pending.discard(9)
        assert settled()
    finally:
        resender.close(BOUND)


def test_copies_get_the_kept_answer_or_nothing_while_the_request_runs() -> None:
    cache = ReplyCache(world_size=2)
    cache.running(1, 5)
    assert cache.reply_to_copy(1, 5) is None  # still running: the copy is dropped
    reply = Frame(b"answer", reply_to=5)
    cache.answered(1, 5, reply)
    again = cache.reply_to_copy(1, 5)
    assert again is not None and again.header == b"answer" and again is not reply
    cache.answered(1, 6, Frame(b"not a kept request"))
    assert cache.reply_to_copy(1, 6) is None
    assert cache.reply_to_copy(0, 5) is None  # per caller
    cache.forget(1)
    assert cache.reply_to_copy(1, 5) is None


def test_answers_kept_are_bounded_per_caller() -> None:
    cache = ReplyCache(world_size=1)
    for rid in range(1, 3000):
        cache.running(0, rid)
        cache.answered(0, rid, Frame(b"r"))
    assert cache.reply_to_copy(0, 1) is None  # forgotten
    assert cache.reply_to_copy(0, 2999) is not None


def test_a_copy_of_a_frame_keeps_every_field() -> None:
    # A copy travels in the original's place (a request sent again, a kept reply, the
    # fault injector's duplicate), so a field it lost changes how it travels: a copy
    # without its deadline held a 1 s call to a stopped worker for 10 s. Every field of
    # Frame is set here to a value unlike its default, a field added later included.
    values: dict[str, Any] = {
        "header": b"header",
        "buffers": [torch.arange(3), torch.ones(2)],
        "request_id": 7,
        "reply_to": 5,
        "owned": frozenset({1}),
        "deadline": 123.5,
        "settled": lambda: True,
        "may_pass": True,
    }
    fields = dataclasses.fields(Frame)
    assert {f.name for f in fields} == set(values), "give each field of Frame a value here"
    for f in fields:
        if f.default is not dataclasses.MISSING:
            assert values[f.name] != f.default, f.name
        elif f.default_factory is not dataclasses.MISSING:
            assert values[f.name] != f.default_factory(), f.name
    original = Frame(**values)
    copy = original.shallow_copy()
    assert copy is not original
    for f in fields:
        if f.name != "buffers":
            assert getattr(copy, f.name) == values[f.name], f.name
    # The same buffers, in a list of its own (sending may seal a frame in place).
    assert copy.buffers is not original.buffers
    assert [id(b) for b in copy.buffers] == [id(b) for b in values["buffers"]]
