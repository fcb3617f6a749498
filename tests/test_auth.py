"""rpcx._wire.auth on its own: sealed store values, frame MACs, replay windows, connection proofs.

The same checks on live worlds, per backend, are in the conformance kit
(``rpcx/testing/conformance_auth.py``).
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import rpcx
from rpcx._util.recent import RecentIds
from rpcx._wire import auth
from rpcx._world import rendezvous
from rpcx.errors import AuthenticationError, ProtocolError
from rpcx.transport import Frame

KEY = b"k" * 32
NAMES = ["w0", "w1", "w2"]


def _nonces() -> list[bytes]:
    return [auth.new_nonce() for _ in NAMES]


class Receiver:
    """A guarded ``deliver`` for rank 1 that records what got through and what was refused."""

    def __init__(self, guard: auth.FrameGuard) -> None:
        self.delivered: list[tuple[int, Frame]] = []
        self.refused: list[tuple[int, str]] = []
        self.deliver = guard.guarding(lambda src, f: self.delivered.append((src, f)),
                                      lambda src, why: self.refused.append((src, why)))


def _pair(payload: bool = False) -> tuple[auth.FrameGuard, auth.FrameGuard, Receiver]:
    nonces = _nonces()
    sender = auth.FrameGuard(KEY, 0, nonces, NAMES, payload=payload)
    receiver_guard = auth.FrameGuard(KEY, 1, nonces, NAMES, payload=payload)
    return sender, receiver_guard, Receiver(receiver_guard)


def _frame(text: bytes = b"header", *buffers: torch.Tensor) -> Frame:
    return Frame(text, list(buffers))


# ------------------------------------------------------------------------- key


def test_the_option_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.AUTH_KEY_ENV, "from-the-environment-0123")
    assert auth.resolve_key(rpcx.RpcBackendOptions()) == b"from-the-environment-0123"
    options = rpcx.TensorPipeRpcBackendOptions(auth_key=b"from-the-options-0123456")
    assert auth.resolve_key(options) == b"from-the-options-0123456"
    monkeypatch.delenv(auth.AUTH_KEY_ENV)
    assert auth.resolve_key(rpcx.RpcBackendOptions()) is None


def test_an_empty_key_is_an_error_and_a_short_one_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(auth.AUTH_KEY_ENV, "")
    with pytest.raises(ValueError, match="RPCX_AUTH_KEY is empty"):
        auth.resolve_key(rpcx.RpcBackendOptions())
    with caplog.at_level(logging.WARNING, "rpcx.auth"):
        assert auth.resolve_key(rpcx.RpcBackendOptions(auth_key="short")) == b"short"
    assert "5 bytes long" in caplog.text


def test_the_key_never_shows_in_repr() -> None:
    options = rpcx.TensorPipeRpcBackendOptions(auth_key="do-not-print-me-0123456789")
    assert "do-not-print-me" not in repr(options)
    assert "auth_key=<set>" in repr(options)
    with pytest.raises(TypeError, match="auth_key must be str or bytes"):
        rpcx.RpcBackendOptions(auth_key=123)  # type: ignore[arg-type]


# ----------------------------------------------------------------- store values


def test_sealed_values_open_only_with_the_key_and_label() -> None:
    seal = auth.ValueSeal(KEY)
    sealed = seal.seal("name/1", b"worker1")
    assert seal.open("name/1", sealed) == b"worker1"
    assert seal.open("name/2", sealed) is None  # moved to another rank's slot
    assert auth.ValueSeal(b"another key, 32 bytes long......").open("name/1", sealed) is None
    assert seal.open("name/1", b"worker1") is None  # never sealed
    tampered = sealed[:-1] + b"2"
    assert seal.open("name/1", tampered) is None


def test_all_gather_names_the_rank_whose_value_fails() -> None:
    store = rendezvous.in_process_store("test-auth-gather")
    try:
        seal = auth.ValueSeal(KEY)
        store.set("tag/1", b"unsealed, as a stray store client writes it")
        with pytest.raises(AuthenticationError, match="authentication failed for rank 1"):
            rendezvous.all_gather(store, "tag", 0, 2, b"mine", 5.0, what="test", seal=seal)
        store.set("tag/1", auth.ValueSeal(b"x" * 32).seal("tag/1", b"other key"))
        with pytest.raises(AuthenticationError, match=r"rank 1.*another RPCX_AUTH_KEY"):
            rendezvous.all_gather(store, "tag", 0, 2, b"mine", 5.0, what="test", seal=seal)
        # A worker without a key is told the world has one.
        store.set("tag/1", seal.seal("tag/1", b"sealed"))
        with pytest.raises(AuthenticationError, match="this worker has none"):
            rendezvous.all_gather(store, "tag", 0, 2, b"mine", 5.0, what="test")
    finally:
        rendezvous.release_in_process_store("test-auth-gather")


# ----------------------------------------------------------------------- frames


def test_a_genuine_frame_is_delivered_as_the_codec_wrote_it() -> None:
    sender, _, receiver = _pair()
    tensor = torch.arange(6, dtype=torch.float32)
    sealed = sender.seal(1, _frame(b"the header", tensor))
    assert sealed.header.endswith(b"the header") and len(sealed.header) > len(b"the header")
    receiver.deliver(0, sealed)
    ((src, frame),) = receiver.delivered
    assert src == 0 and frame.header == b"the header" and frame.buffers[0] is tensor
    assert not receiver.refused


@pytest.mark.parametrize("damage", ["tag", "sequence", "header", "buffer size", "no MAC"])
def test_a_damaged_frame_is_refused_and_its_source_reported(damage: str) -> None:
    sender, guard, receiver = _pair()
    sealed = sender.seal(1, _frame(b"the header", torch.zeros(4)))
    header, buffers = bytearray(sealed.header), list(sealed.buffers)
    if damage == "tag":
        header[8] ^= 1
    elif damage == "sequence":
        header[0] ^= 1
    elif damage == "header":
        header[-1] ^= 1
    elif damage == "buffer size":
        buffers = [torch.zeros(5)]
    else:
        header = bytearray(b"a frame from a stray socket")
    with pytest.raises(ProtocolError, match="failed authentication"):
        receiver.deliver(0, Frame(bytes(header), buffers))
    assert not receiver.delivered
    assert receiver.refused == [(0, receiver.refused[0][1])]
    assert "failed authentication" in receiver.refused[0][1]
    assert guard.refused == 1


def test_after_a_refusal_that_source_is_refused_for_good_and_others_are_not() -> None:
    nonces = _nonces()
    guard = auth.FrameGuard(KEY, 1, nonces, NAMES)
    receiver = Receiver(guard)
    from_0 = auth.FrameGuard(KEY, 0, nonces, NAMES)
    from_2 = auth.FrameGuard(KEY, 2, nonces, NAMES)
    with pytest.raises(ProtocolError):
        receiver.deliver(0, _frame(b"x" * 50))
    with pytest.raises(ProtocolError, match="failed authentication"):
        receiver.deliver(0, from_0.seal(1, _frame()))  # genuine, but the link is condemned
    receiver.deliver(2, from_2.seal(1, _frame(b"from two")))
    assert [f.header for _, f in receiver.delivered] == [b"from two"]
    assert [src for src, _ in receiver.refused] == [0]  # reported once
    assert guard.refused == 2


def test_a_replayed_frame_is_refused() -> None:
    sender, _, receiver = _pair()
    sealed = sender.seal(1, _frame(b"once"))
    copy = Frame(sealed.header, [])
    receiver.deliver(0, sealed)
    with pytest.raises(ProtocolError, match="replayed"):
        receiver.deliver(0, copy)
    assert len(receiver.delivered) == 1


def test_frames_raced_out_of_order_by_two_senders_are_accepted_once_each() -> None:
    sender, _, receiver = _pair()
    # (sends that overlap: none has returned when the others are sealed)
    frames = [sender.sealing(1, _frame(str(i).encode()))[0] for i in range(6)]
    second = Frame(frames[1].header, [])  # (delivering a frame strips its header)
    for i in (0, 2, 3, 1, 5, 4):
        receiver.deliver(0, frames[i])
    assert sorted(f.header for _, f in receiver.delivered) == [str(i).encode() for i in range(6)]
    with pytest.raises(ProtocolError, match="replayed"):
        receiver.deliver(0, second)


def test_a_frame_sent_before_another_and_delivered_after_it_is_refused() -> None:
    sender, guard, receiver = _pair()
    first, token = sender.sealing(1, _frame(b"first"))
    sender.sent(1, token)  # its send returned: the next frame is sealed after it
    second, _ = sender.sealing(1, _frame(b"second"))
    receiver.deliver(0, second)  # someone on the path held the first one back
    with pytest.raises(ProtocolError, match="reordered or held back in transit"):
        receiver.deliver(0, first)
    assert [f.header for _, f in receiver.delivered] == [b"second"]
    assert "reordered" in receiver.refused[0][1] and guard.refused == 1
    # the same two in order, and a third that overlapped the second: all taken
    sender, _, receiver = _pair()
    first, token = sender.sealing(1, _frame(b"first"))
    sender.sent(1, token)
    second, _ = sender.sealing(1, _frame(b"second"))  # (still being sent ...)
    third, _ = sender.sealing(1, _frame(b"third"))  # (... when this one is sealed)
    for frame in (first, third, second):
        receiver.deliver(0, frame)
    assert [f.header for _, f in receiver.delivered] == [b"first", b"third", b"second"]


def test_a_frame_numbers_floor_comes_from_the_oldest_send_still_under_way() -> None:
    sender, _, receiver = _pair()
    a, token_a = sender.sealing(1, _frame(b"a"))
    b, token_b = sender.sealing(1, _frame(b"b"))
    sender.sent(1, token_b)  # b returned, a still under way: c may pass a, not b
    c, _ = sender.sealing(1, _frame(b"c"))
    receiver.deliver(0, b)
    receiver.deliver(0, c)
    receiver.deliver(0, a)  # (overlapped b and c: taken)
    assert [f.header for _, f in receiver.delivered] == [b"b", b"c", b"a"]
    sender.sent(1, token_a)
    d, _ = sender.sealing(1, _frame(b"d"))
    e, _ = sender.sealing(1, _frame(b"e"))
    receiver.deliver(0, e)
    receiver.deliver(0, d)  # (d and e overlap: taken either way)
    assert len(receiver.delivered) == 5 and not receiver.refused


def test_frames_of_another_session_or_direction_are_refused() -> None:
    old_sender, _, _ = _pair()  # the same key, other nonces: a recording of another run
    _, _, receiver = _pair()
    with pytest.raises(ProtocolError, match="bad or missing MAC"):
        receiver.deliver(0, old_sender.seal(1, _frame()))
    nonces = _nonces()
    guard_1 = auth.FrameGuard(KEY, 1, nonces, NAMES)
    reflected = guard_1.seal(0, _frame())  # 1 -> 0, sent back to 1 as if from 0
    with pytest.raises(ProtocolError, match="bad or missing MAC"):
        Receiver(guard_1).deliver(0, reflected)


def test_sequence_numbers_are_accepted_once_in_any_order() -> None:
    window = RecentIds()
    assert window.add(1) and window.add(3)
    assert window.add(3 + (1 << 16) + 1)  # far ahead: it carried a valid MAC
    assert window.add(2) and not window.add(2) and not window.add(3)


def test_payload_authentication_covers_the_tensor_bytes() -> None:
    for payload, accepted in ((False, True), (True, False)):
        sender, _, receiver = _pair(payload=payload)
        sealed = sender.seal(1, _frame(b"h", torch.arange(8, dtype=torch.int64)))
        changed = sealed.buffers[0].clone()
        changed[3] = 99
        tampered = Frame(sealed.header, [changed])
        if accepted:
            receiver.deliver(0, tampered)
        else:
            with pytest.raises(ProtocolError, match="bad or missing MAC"):
                receiver.deliver(0, tampered)
    sender, _, receiver = _pair(payload=True)
    strided = torch.arange(16, dtype=torch.float32).reshape(4, 4).t()  # not contiguous
    receiver.deliver(0, sender.seal(1, _frame(b"h", strided)))
    assert len(receiver.delivered) == 1


def test_concurrent_senders_never_reuse_a_sequence_number() -> None:
    sender, _, receiver = _pair()
    sealed: list[Frame] = []
    lock = threading.Lock()

    def send(n: int) -> None:
        for _ in range(n):
            frame, token = sender.sealing(1, _frame())
            with lock:  # (the wire)
                sealed.append(frame)
            sender.sent(1, token)

    threads = [threading.Thread(target=send, args=(500,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for frame in sealed:
        receiver.deliver(0, frame)
    assert len(receiver.delivered) == 2000 and not receiver.refused


# ------------------------------------------------------------------- connections


def test_connection_proofs_bind_purpose_ranks_session_and_challenge() -> None:
    nonces = _nonces()
    ours, theirs = auth.ConnectionAuth(KEY, nonces), auth.ConnectionAuth(KEY, nonces)
    challenge = ours.challenge()
    proof = theirs.proof("shm connect", 2, 0, challenge)
    assert ours.check("shm connect", 2, 0, challenge, proof)
    wrong: list[tuple[str, int, int, bytes]] = [
        ("shm accept", 2, 0, challenge), ("shm connect", 1, 0, challenge),
        ("shm connect", 2, 0, ours.challenge()), ("shm connect", 7, 0, challenge),
    ]
    for purpose, src, dst, asked in wrong:
        assert not ours.check(purpose, src, dst, asked, proof)
    assert not auth.ConnectionAuth(KEY, _nonces()).check("shm connect", 2, 0, challenge, proof)
    assert not auth.ConnectionAuth(b"y" * 32, nonces).check(
        "shm connect", 2, 0, challenge, proof)
