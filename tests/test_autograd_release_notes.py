"""Context releases ride as notes in the next frame to each peer (rpcx.autograd.releases).

With a stub agent, each test sees exactly which messages a release cost: none of its own
when a frame to the peer takes it, one one-way ``AUTOGRAD_FORGET`` when none does within
the linger, one acknowledged ``AUTOGRAD_RELEASE`` per peer when someone waits, and a
broadcast when a peer that may not have passed the word on is lost. A loopback world
then pins the training loop's cost: a step's release travels in no frame of its own.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import rpcx
import rpcx.autograd as dist_autograd
from rpcx._core import context as _context
from rpcx._wire.codec import decode_envelope
from rpcx.autograd import releases
from rpcx.autograd.releases import ReleaseNotes
from rpcx.errors import PeerLostError
from rpcx.messages import MessageKind
from rpcx.testing.world import world
from rpcx.worker import WorkerInfo

TIMEOUT = 10.0
FORGET, RELEASE = int(MessageKind.AUTOGRAD_FORGET), int(MessageKind.AUTOGRAD_RELEASE)


class StubAgent:
    """Records what the release notes send; answers requests as told."""

    def __init__(self, size: int = 4) -> None:
        self.rank = 0
        self.name = "w0"
        self.world_size = size
        self.workers = [WorkerInfo(f"w{i}", i) for i in range(size)]
        self.sent: list[tuple[str, int, int, Any]] = []  # (how, dst, kind, payload)
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.answers: dict[int, torch.futures.Future[Any]] = {}  # dst -> next request's
        self.lost: set[int] = set()
        self.is_running = True
        self.lossy = False

    def _record(self, entry: tuple[str, int, int, Any]) -> None:
        with self.changed:
            self.sent.append(entry)
            self.changed.notify_all()

    def send_one_way(self, dst: WorkerInfo, kind: int, payload: Any) -> None:
        self._record(("one-way", dst.id, int(kind), list(payload)))

    def request(self, dst: WorkerInfo, kind: int, payload: Any, **_: Any) -> Any:
        self._record(("request", dst.id, int(kind), list(payload)))
        future = self.answers.pop(dst.id, None)
        if future is None:
            future = torch.futures.Future()
            future.set_result(None)
        return future

    def timeout_for(self, timeout: Any) -> float:
        return TIMEOUT

    def call_soon(self, fn: Any, *args: Any) -> None:
        fn(*args)

    def is_lost(self, rank: int) -> bool:
        return rank in self.lost

    def wait_sent(self, count: int) -> list[tuple[str, int, int, Any]]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.sent) >= count, TIMEOUT), self.sent
            return list(self.sent)


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[StubAgent, ReleaseNotes]]:
    # A linger far longer than any test's own steps: a frame always comes first, however
    # slow the machine (tests of the flusher shorten it themselves).
    monkeypatch.setattr(releases, "LINGER", 5.0)
    agent = StubAgent()
    notes = ReleaseNotes(agent)  # type: ignore[arg-type]
    try:
        yield agent, notes
    finally:
        notes.close()


def test_a_frame_to_the_peer_carries_its_releases_and_the_rest_go_one_way(
    stub: tuple[StubAgent, ReleaseNotes], monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent, notes = stub
    monkeypatch.setattr(releases, "LINGER", 0.05)
    owed_at = time.monotonic()
    notes.owe([1, 2], 7)
    notes.owe([1], 8)
    assert notes.notes_for(1) == [(FORGET, [7, 8])]
    assert notes.notes_for(1) == []  # taken once
    # Worker 2's went in no frame: the flusher sends it on its own, after the linger.
    assert agent.wait_sent(1) == [("one-way", 2, FORGET, [7])]
    assert time.monotonic() - owed_at >= 0.05
    assert notes.pending() == 0


def test_releases_of_a_frame_never_sent_are_taken_back_and_sent(
    stub: tuple[StubAgent, ReleaseNotes], monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent, notes = stub
    monkeypatch.setattr(releases, "LINGER", 0.05)
    notes.owe([1], 7)
    taken = notes.notes_for(1)
    notes.notes_not_sent(1, taken)  # the frame failed to encode
    assert agent.wait_sent(1) == [("one-way", 1, FORGET, [7])]


def test_waiting_asks_every_peer_told_or_owed_once_and_then_none(
    stub: tuple[StubAgent, ReleaseNotes],
) -> None:
    agent, notes = stub
    notes.owe([1], 7)
    notes.notes_for(1)  # worker 1 was told in a frame: it owes an acknowledgement
    notes.owe([2], 8)  # worker 2 was told nothing yet
    futures = notes.flush_acknowledged()
    assert len(futures) == 2 and all(f.done() for f in futures)
    assert sorted(agent.sent) == [("request", 1, RELEASE, []), ("request", 2, RELEASE, [8])]
    assert notes.flush_acknowledged() == []  # everything was acknowledged
    assert notes.pending() == 0


def test_an_acknowledgement_is_asked_for_every_so_many_releases(
    stub: tuple[StubAgent, ReleaseNotes], monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent, notes = stub
    monkeypatch.setattr(releases, "ACK_EVERY", 3)
    monkeypatch.setattr(releases, "LINGER", 0.05)
    for context_id in range(3):
        notes.owe([1], context_id)
        assert notes.notes_for(1) == [(FORGET, [context_id])]
    assert agent.wait_sent(1) == [("request", 1, RELEASE, [])]
    assert notes.flush_acknowledged() == []  # that answer covered all three


def test_a_lost_peer_s_releases_go_to_everyone_else(
    stub: tuple[StubAgent, ReleaseNotes],
) -> None:
    agent, notes = stub
    notes.owe([1], 7)
    notes.notes_for(1)  # told, not acknowledged: worker 1 may not have passed it on
    notes.owe([1], 8)  # not told at all
    agent.lost.add(1)
    notes.on_peer_lost(1)
    assert notes.notes_for(1) == []
    assert notes.notes_for(2) == [(FORGET, [8, 7])]
    assert notes.notes_for(3) == [(FORGET, [8, 7])]


def test_a_release_owed_to_a_peer_already_lost_goes_to_everyone_else(
    stub: tuple[StubAgent, ReleaseNotes],
) -> None:
    agent, notes = stub
    agent.lost.add(1)
    notes.on_peer_lost(1)
    notes.owe([1], 7)  # the caller looked before worker 1 was lost
    assert notes.notes_for(1) == []
    assert notes.notes_for(2) == [(FORGET, [7])]
    assert notes.notes_for(3) == [(FORGET, [7])]


def test_a_new_worker_at_a_lost_rank_is_owed_its_releases_like_any_peer(
    stub: tuple[StubAgent, ReleaseNotes],
) -> None:
    # A dynamic world: worker 1 was lost, a new worker took rank 1 and took part in
    # context 9. It must hear of the release itself (it alone holds the context), not
    # have the release go to everyone else as if rank 1 were still the dead worker.
    agent, notes = stub
    agent.lost.add(1)
    notes.on_peer_lost(1)
    agent.lost.discard(1)
    notes.rank_reused(1)
    notes.owe([1], 9)
    assert notes.notes_for(1) == [(FORGET, [9])]
    assert notes.notes_for(2) == []


def test_on_a_lossy_transport_a_release_is_an_acknowledged_request(
    stub: tuple[StubAgent, ReleaseNotes], monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent, notes = stub
    monkeypatch.setattr(releases, "LINGER", 0.05)
    agent.lossy = True
    notes.owe([1], 7)
    assert agent.wait_sent(1) == [("request", 1, RELEASE, [7])]
    assert notes.flush_acknowledged() == []  # answered: nothing left to ask for


def test_a_failed_acknowledgement_goes_to_everyone_else(
    stub: tuple[StubAgent, ReleaseNotes],
) -> None:
    agent, notes = stub
    failed: torch.futures.Future[Any] = torch.futures.Future()
    agent.answers[1] = failed
    notes.owe([1], 7)
    (future,) = notes.flush_acknowledged()
    agent.lost.add(1)
    failed.set_exception(PeerLostError("worker 'w1' is gone"))
    assert notes.notes_for(2) == [(FORGET, [7])]
    assert notes.notes_for(3) == [(FORGET, [7])]
    assert future.done() and notes.in_flight() == []


# ------------------------------------------------------------ in a loopback world


def forward(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@pytest.fixture(scope="module")
def pair() -> Iterator[None]:
    with world("loopback", size=2):
        yield


def test_a_training_step_s_release_travels_in_the_next_step_s_call(
    pair: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(releases, "LINGER", 5.0)  # the next step's call always comes first
    calls = _context.current_agent()._calls  # type: ignore[attr-defined]
    sent: collections.Counter[int] = collections.Counter()
    send = calls._transmit_frame

    def counting(dst: int, frame: Any) -> None:
        sent[decode_envelope(frame)[0]] += 1
        send(dst, frame)

    w = torch.ones(3, requires_grad=True)
    calls._transmit_frame = counting
    try:
        for _ in range(20):
            with dist_autograd.context() as context_id:
                y = rpcx.rpc_sync("worker1", forward, args=(w,))
                dist_autograd.backward(context_id, [y.sum()])
    finally:
        calls._transmit_frame = send
    assert sent[MessageKind.CALL] == 20
    # The first 19 releases rode in the next call; the last one waits for a frame.
    assert sent[MessageKind.AUTOGRAD_FORGET] == 0
    assert sent[MessageKind.AUTOGRAD_RELEASE] == 0
    # Waiting for releases reaches worker1, which holds no context afterwards.
    assert dist_autograd._wait_released(TIMEOUT) == 1
    stats = rpcx.rpc_sync("worker1", rpcx.debug_info)["autograd"]
    assert stats["contexts"] == 0 and stats["releasing"] == 0, stats
