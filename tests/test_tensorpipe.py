"""Unit tests of the tensorpipe transport's own logic; the conformance suite covers the rest.

Nothing here starts torch's agent: the re-ordering inbox, the private copies made
before a send returns, and the errors it reports are exercised directly.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

tensorpipe = pytest.importorskip("rpcx.backends.tensorpipe")

from rpcx.errors import LostCause, PeerLostError, lost_reason  # noqa: E402
from rpcx.transport import Frame  # noqa: E402


def _transport(delivered: list[tuple[int, bytes]]) -> Any:
    transport = tensorpipe.TensorPipeTransport()
    transport._ctx = SimpleNamespace(
        rank=0, names=["a", "b"], deliver=lambda src, frame: delivered.append((src, frame.header))
    )
    transport._inboxes[1] = tensorpipe._Inbox()
    return transport


def test_frames_are_delivered_in_sequence_order_whatever_the_arrival_order() -> None:
    delivered: list[tuple[int, bytes]] = []
    transport = _transport(delivered)
    for seq in (2, 0, 3, 1):
        transport._arrive(1, seq, Frame(b"f%d" % seq))
    assert delivered == [(1, b"f0"), (1, b"f1"), (1, b"f2"), (1, b"f3")]
    transport._arrive(1, 5, Frame(b"f5"))
    assert len(delivered) == 4  # 4 has not arrived: 5 waits for it
    transport._arrive(1, 4, Frame(b"f4"))
    assert [h for _, h in delivered[4:]] == [b"f4", b"f5"]


def test_concurrent_arrivals_deliver_each_frame_once_in_order() -> None:
    delivered: list[tuple[int, bytes]] = []
    transport = _transport(delivered)
    count = 2000
    seqs = list(range(count))
    halves = [seqs[0::2], seqs[1::2]]
    threads = [
        threading.Thread(target=lambda part=part: [
            transport._arrive(1, s, Frame(b"%d" % s)) for s in part
        ])
        for part in halves
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [int(h) for _, h in delivered] == seqs


class _PausingLock:
    """A lock that stops one thread just after a chosen release, until told to go on.

    It forces the window between a delivering thread's last look at the inbox and its
    giving up the delivering role, where a frame arriving on another thread used to be
    stranded.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pause_thread: threading.Thread | None = None  # pause it at its next release
        self.paused = threading.Event()
        self.resume = threading.Event()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        if self.pause_thread is threading.current_thread():
            self.pause_thread = None
            self.paused.set()
            assert self.resume.wait(10), "the test never resumed the paused thread"


def test_a_frame_arriving_while_the_deliverer_gives_up_is_still_delivered() -> None:
    delivered: list[bytes] = []
    transport = tensorpipe.TensorPipeTransport()
    lock = _PausingLock()
    inbox = tensorpipe._Inbox()
    inbox.lock = lock  # type: ignore[assignment]
    transport._inboxes[1] = inbox

    def deliver(src: int, frame: Frame) -> None:
        delivered.append(frame.header)
        if frame.header == b"f0":  # pause the deliverer right after its next look
            lock.pause_thread = threading.current_thread()

    transport._ctx = SimpleNamespace(rank=0, names=["a", "b"], deliver=deliver)
    first = threading.Thread(target=transport._arrive, args=(1, 0, Frame(b"f0")))
    first.start()
    try:
        assert lock.paused.wait(10), "the delivering thread never reached the window"
        # The deliverer found nothing after f0 and is paused in the window: f1 arrives.
        transport._arrive(1, 1, Frame(b"f1"))
    finally:
        lock.resume.set()
        first.join(10)
    assert not first.is_alive()
    assert delivered == [b"f0", b"f1"]
    assert not inbox.waiting and not inbox.delivering


def test_sends_use_private_copies_of_cpu_buffers() -> None:
    big, small = torch.zeros(5 << 20, dtype=torch.uint8), torch.arange(4.0)
    staged = tensorpipe.TensorPipeTransport._staged([big, small], None)
    big.fill_(1)
    small.add_(1)
    assert staged[0].sum().item() == 0 and torch.equal(staged[1], torch.arange(4.0))
    assert staged[0].data_ptr() != big.data_ptr() and staged[1].data_ptr() != small.data_ptr()


def test_buffers_the_codec_made_are_sent_without_another_copy() -> None:
    made, users = torch.zeros(4, dtype=torch.uint8), torch.ones(4, dtype=torch.uint8)
    staged = tensorpipe.TensorPipeTransport._staged([made, users], None, frozenset({0}))
    assert staged[0] is made
    assert staged[1].data_ptr() != users.data_ptr() and torch.equal(staged[1], users)


def test_peer_errors_read_without_cpp_locations() -> None:
    reason = tensorpipe._describe(RuntimeError(
        "eof (this error originated at tensorpipe/transport/shm/connection_impl.cc:259)\nmore"
    ))
    assert reason == "is unreachable: eof"


def test_nothing_is_delivered_after_a_goodbye_or_a_loss() -> None:
    delivered: list[tuple[int, bytes]] = []
    lost: list[tuple[int, str]] = []
    transport = _transport(delivered)
    causes: list[LostCause] = []
    transport._ctx.peer_lost = lambda rank, cause, detail="": (
        lost.append((rank, lost_reason(cause, detail))), causes.append(cause))
    transport._watches = {}
    transport._send_seq[1] = iter(range(100))
    transport._arrive(1, 0, Frame(b"f0"))
    transport._arrive(1, 2, Frame(b"f2"))  # sent after the goodbye: must be dropped
    transport._arrive(1, 1, Frame(tensorpipe._GOODBYE.header))
    transport._arrive(1, 3, Frame(b"f3"))
    assert delivered == [(1, b"f0")]
    assert lost == [(1, "has shut down")] and causes == [LostCause.DEPARTED]
    assert not transport._inboxes[1].waiting and not transport._inboxes[1].delivering
    with pytest.raises(PeerLostError, match=r"^has shut down$"):
        transport.send(1, Frame(b"late"))


def test_a_send_to_a_lost_peer_says_why_it_was_lost() -> None:
    transport = _transport([])
    transport._ctx.peer_lost = lambda rank, cause, detail="": None
    transport._watches = {}
    transport._lose(1, LostCause.CONNECTION_LOST, "eof")
    with pytest.raises(PeerLostError, match=r"^is unreachable: eof$") as lost:
        transport.send(1, Frame(b"late"))
    assert lost.value.cause is LostCause.CONNECTION_LOST
