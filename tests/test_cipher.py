"""rpcx._wire.cipher on its own: which pairs encrypt, frames in and out, what is refused.

The same on live worlds, per backend, is in the conformance kit
(``rpcx/testing/conformance_cipher.py``).
"""

from __future__ import annotations

import pathlib
import threading

import pytest
import torch

import rpcx
from rpcx._util import memory
from rpcx._wire import auth, cipher
from rpcx.errors import ProtocolError, RpcError
from rpcx.testing import remote
from rpcx.testing.world import world
from rpcx.transport import Frame

pytestmark = pytest.mark.skipif(not cipher.aead_available(),
                                reason="encryption needs the 'cryptography' package")

KEY = b"k" * 32
NAMES = ["w0", "w1"]


def _pair(encrypted: bool = True, key: bytes = KEY, nonces: list[bytes] | None = None,
          ) -> tuple[cipher.FrameCipher, cipher.FrameCipher, list[Frame], list[str]]:
    nonces = nonces or [auth.new_nonce(), auth.new_nonce()]
    exchanges = [cipher.KeyExchange(), cipher.KeyExchange()]
    sender = cipher.FrameCipher(key, 0, nonces, NAMES, [False, encrypted],
                                _shared(exchanges[0], exchanges))
    receiver = cipher.FrameCipher(KEY, 1, nonces, NAMES, [encrypted, False],
                                  _shared(exchanges[1], exchanges))
    delivered: list[Frame] = []
    refused: list[str] = []
    receiver_deliver = receiver.guarding(lambda src, frame: delivered.append(frame),
                                         lambda src, why: refused.append(why))
    sender.deliver_to_receiver = receiver_deliver  # type: ignore[attr-defined]
    return sender, receiver, delivered, refused


def _shared(mine: cipher.KeyExchange, everyone: list[cipher.KeyExchange]) -> list[bytes]:
    return [mine.shared(other.public) for other in everyone]


def test_the_option_and_the_environment_name_the_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cipher.ENCRYPT_ENV, raising=False)
    assert cipher.resolve_encrypt(rpcx.RpcBackendOptions()) is None
    monkeypatch.setenv(cipher.ENCRYPT_ENV, "1")
    assert cipher.resolve_encrypt(rpcx.RpcBackendOptions()) == "hosts"
    assert cipher.resolve_encrypt(rpcx.RpcBackendOptions(encrypt="always")) == "always"
    assert cipher.resolve_encrypt(rpcx.RpcBackendOptions(encrypt=False)) is None
    monkeypatch.setenv(cipher.ENCRYPT_ENV, "sometimes")
    with pytest.raises(ValueError, match="RPCX_ENCRYPT is 'sometimes'"):
        cipher.resolve_encrypt(rpcx.RpcBackendOptions())
    assert cipher.encrypted_pairs(0, [b"a", b"a", b"b"], "hosts") == [False, False, True]
    assert cipher.encrypted_pairs(0, [b"a", b"a", b"b"], "always") == [True, True, True]


def test_a_frame_arrives_whole_and_crosses_unreadable() -> None:
    sender, _, delivered, refused = _pair()
    secret = b"the codec's header, with a secret in it"
    tensor = torch.arange(1000, dtype=torch.float32)
    empty = torch.empty(0)
    sealed = sender.seal(1, Frame(secret, [tensor, empty]))
    assert b"secret" not in bytes(sealed.header)
    plain_bytes = bytes(tensor.view(torch.uint8).tolist())
    assert plain_bytes[:64] not in bytes(sealed.buffers[0].tolist())
    assert [b.numel() for b in sealed.buffers] == [4000 + cipher.TAG, cipher.TAG]
    assert sealed.owned == frozenset({0, 1})  # copies made by the cipher
    sender.deliver_to_receiver(0, sealed)  # type: ignore[attr-defined]
    assert not refused
    (frame,) = delivered
    assert frame.header == secret
    assert torch.equal(frame.buffers[0].view(torch.float32), tensor)
    assert frame.buffers[1].numel() == 0


@pytest.mark.parametrize("damage", ["header", "tensor", "drop a buffer", "swap buffers"])
def test_an_altered_frame_is_refused(damage: str) -> None:
    sender, receiver, delivered, refused = _pair()
    sealed = sender.seal(1, Frame(b"header", [torch.ones(64), torch.zeros(64)]))
    if damage == "header":
        sealed.header = sealed.header[:-1] + bytes([sealed.header[-1] ^ 1])
    elif damage == "tensor":
        sealed.buffers[1][7] ^= 1
    elif damage == "drop a buffer":
        sealed.buffers = sealed.buffers[:1]
    else:
        sealed.buffers = sealed.buffers[::-1]
    with pytest.raises(ProtocolError, match="failed authentication"):
        sender.deliver_to_receiver(0, sealed)  # type: ignore[attr-defined]
    assert not delivered and len(refused) == 1 and receiver.refused == 1


def test_a_replayed_frame_runs_once() -> None:
    sender, _, delivered, refused = _pair()
    sealed = sender.seal(1, Frame(b"header", []))
    copy = Frame(sealed.header, list(sealed.buffers))
    sender.deliver_to_receiver(0, sealed)  # type: ignore[attr-defined]
    with pytest.raises(ProtocolError, match="replayed"):
        sender.deliver_to_receiver(0, copy)  # type: ignore[attr-defined]
    assert len(delivered) == 1 and refused


@pytest.mark.parametrize("who", ["another key", "another session", "the key, not the pair's",
                                 "sealed, not encrypted"])
def test_frames_not_encrypted_for_this_pair_and_session_are_refused(who: str) -> None:
    nonces = [auth.new_nonce(), auth.new_nonce()]
    _, _, delivered, refused = sender_pair = _pair(nonces=nonces)
    # (a key exchange of the stranger's own: it never saw the pair's private halves)
    shared = _shared(cipher.KeyExchange(), [cipher.KeyExchange(), cipher.KeyExchange()])
    if who == "another key":
        stranger: auth.FrameGuard = cipher.FrameCipher(b"x" * 32, 0, nonces, NAMES,
                                                       [False, True], shared)
    elif who == "another session":
        stranger = cipher.FrameCipher(KEY, 0, [auth.new_nonce(), nonces[1]], NAMES,
                                      [False, True], shared)
    elif who == "the key, not the pair's":  # a member of the world, or a past one
        stranger = cipher.FrameCipher(KEY, 0, nonces, NAMES, [False, True], shared)
    else:
        stranger = auth.FrameGuard(KEY, 0, nonces, NAMES)
    frame = stranger.seal(1, Frame(b"header", [torch.ones(8)]))
    with pytest.raises(ProtocolError, match=r"did not decrypt|not an encrypted frame"):
        sender_pair[0].deliver_to_receiver(0, frame)  # type: ignore[attr-defined]
    assert not delivered and refused


def test_a_pair_on_one_host_is_sealed_not_encrypted() -> None:
    sender, _, delivered, refused = _pair(encrypted=False)
    sealed = sender.seal(1, Frame(b"plain header", [torch.ones(4)]))
    assert sealed.header.endswith(b"plain header")  # the guard's MAC, then the header
    sender.deliver_to_receiver(0, sealed)  # type: ignore[attr-defined]
    assert delivered[0].header == b"plain header" and not refused


def test_init_rpc_says_encryption_needs_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.AUTH_KEY_ENV, raising=False)
    options = rpcx.TensorPipeRpcBackendOptions(init_method="file:///nonexistent/x",
                                               encrypt=True)
    with pytest.raises(RpcError, match=r"encryption \(RPCX_ENCRYPT\) needs a world key"):
        rpcx.init_rpc("w0", backend="loopback", rank=0, world_size=1,
                      rpc_backend_options=options)


@pytest.mark.parametrize("modes", [("always", None), ("always", "hosts")])
def test_workers_that_disagree_on_encryption_say_so(
    tmp_path: pathlib.Path, modes: tuple[str, str | None],
) -> None:
    url = f"file://{tmp_path / 'rendezvous'}"
    errors: dict[str, BaseException] = {}

    def join(name: str, rank: int, encrypt: str | None) -> None:
        options = rpcx.TensorPipeRpcBackendOptions(init_method=url, rpc_timeout=30,
                                                   auth_key=KEY, encrypt=encrypt)
        try:
            rpcx.init_rpc(name, backend="loopback", rank=rank, world_size=2,
                          rpc_backend_options=options)
        except BaseException as exc:
            errors[name] = exc
        else:
            rpcx.shutdown(graceful=False)

    other = threading.Thread(target=join, args=("w1", 1, modes[1]))
    other.start()
    join("w0", 0, modes[0])
    other.join(30)
    assert not other.is_alive()
    second = "does not encrypt" if modes[1] is None else "encrypts between hosts"
    assert (f"this worker encrypts every pair (RPCX_ENCRYPT=always) and rank 1 ('w1') "
            f"{second}") in str(errors["w0"])
    assert (f"this worker {second}") in str(errors["w1"])
    assert "and rank 0 ('w0') encrypts every pair" in str(errors["w1"])
    assert "RPCX_ENCRYPT (or the encrypt option) the same on every worker" in str(errors["w1"])


def test_parts_larger_than_a_piece_go_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    # (AES-GCM calls take under 2 GiB: a part over PIECE_BYTES goes in pieces)
    monkeypatch.setattr(cipher, "PIECE_BYTES", 64)
    for size in range(0, 400):
        assert cipher.plain_size(cipher.sealed_size(size)) == size
    assert cipher.plain_size(cipher.TAG - 1) is None
    assert cipher.plain_size(64 + cipher.TAG + 1) is None  # (one byte needs a tag of its own)
    sender, _, delivered, refused = _pair()
    header = bytes(range(200))
    buffers = [torch.arange(n, dtype=torch.uint8) for n in (0, 64, 65, 300)]
    sealed = sender.seal(1, Frame(header, [b.clone() for b in buffers]))
    assert [b.numel() for b in sealed.buffers] == [16, 80, 97, 300 + 5 * 16]
    sender.deliver_to_receiver(0, sealed)  # type: ignore[attr-defined]
    assert not refused
    assert delivered[0].header == header
    assert all(torch.equal(got, want) for got, want in zip(delivered[0].buffers, buffers,
                                                             strict=True))
    swapped = sender.seal(1, Frame(b"h", [torch.arange(200, dtype=torch.uint8)]))
    first, second = swapped.buffers[0][:80].clone(), swapped.buffers[0][80:160].clone()
    swapped.buffers[0][:80], swapped.buffers[0][80:160] = second, first  # two pieces swapped
    with pytest.raises(ProtocolError, match="buffer 0 did not decrypt"):
        sender.deliver_to_receiver(0, swapped)  # type: ignore[attr-defined]


def _as_received(sealed: Frame) -> Frame:
    """``sealed`` as a socket transport delivers it: each buffer in fresh memory of the
    transport's own, which the receiver may write over (``owned``)."""
    return Frame(sealed.header, [b.clone() for b in sealed.buffers],
                 owned=frozenset(range(len(sealed.buffers))))


@pytest.mark.parametrize("pieces", [False, True])
def test_a_large_buffer_of_the_transports_own_is_decrypted_where_it_lies(
    monkeypatch: pytest.MonkeyPatch, pieces: bool,
) -> None:
    monkeypatch.setattr(cipher, "IN_PLACE_MIN", 1000)
    monkeypatch.setattr(cipher, "_CHUNK", 100)  # (several chunks a piece, ends mid-block)
    monkeypatch.setattr(cipher._scratch, "view", None, raising=False)
    if pieces:
        monkeypatch.setattr(cipher, "PIECE_BYTES", 400)  # (a tag every 400 bytes)
    sender, _, delivered, refused = _pair()
    plain = [torch.arange(n, dtype=torch.int32).view(torch.uint8) for n in (300, 700, 10)]
    received = _as_received(sender.seal(1, Frame(b"h", [b.clone() for b in plain])))
    addresses = [b.data_ptr() for b in received.buffers]
    sender.deliver_to_receiver(0, received)  # type: ignore[attr-defined]
    assert not refused
    (frame,) = delivered
    assert all(torch.equal(got, want) for got, want in zip(frame.buffers, plain, strict=True))
    # 1200 and 2800 bytes: in place; 40 bytes: into a buffer of their own
    assert [b.data_ptr() == a for b, a in zip(frame.buffers, addresses, strict=True)] == [
        True, True, False]


@pytest.mark.parametrize("owned", [False, True])
def test_a_bit_flipped_in_a_large_buffer_is_refused_in_place_or_not(
    monkeypatch: pytest.MonkeyPatch, owned: bool,
) -> None:
    monkeypatch.setattr(cipher, "IN_PLACE_MIN", 1000)
    monkeypatch.setattr(cipher, "PIECE_BYTES", 400)
    sender, receiver, delivered, refused = _pair()
    received = _as_received(sender.seal(1, Frame(b"h", [torch.ones(1000)])))
    received.buffers[0][2500] ^= 1  # (in the fourth piece of ten)
    if not owned:  # (a shared-memory segment, a library's message: never written)
        received.owned = frozenset()
    before = received.buffers[0].clone()
    with pytest.raises(ProtocolError, match="buffer 0 did not decrypt"):
        sender.deliver_to_receiver(0, received)  # type: ignore[attr-defined]
    assert not delivered and len(refused) == 1 and receiver.refused == 1
    assert torch.equal(received.buffers[0], before) is not owned


@pytest.mark.skipif(memory._storage_use_count is None,
                    reason="this torch does not count a storage's users")
def test_encrypted_copies_are_used_again_once_nothing_holds_them() -> None:
    sender, _, delivered, refused = _pair()
    size = 5 << 20  # (over ReusedBuffers' smallest)
    first = sender.seal(1, Frame(b"h", [torch.full((size,), 1, dtype=torch.uint8)]))
    address = first.buffers[0].data_ptr()
    kept = first.buffers[0].clone()
    # Held (a transport still writing it, a receiver in this process): not used again.
    second = sender.seal(1, Frame(b"h", [torch.full((size,), 2, dtype=torch.uint8)]))
    addresses = {address, second.buffers[0].data_ptr()}
    assert len(addresses) == 2
    assert torch.equal(first.buffers[0], kept)
    for sealed in (first, second):  # (received into the transport's memory: copies)
        sender.deliver_to_receiver(0, _as_received(sealed))  # type: ignore[attr-defined]
    del first, second, sealed
    third = sender.seal(1, Frame(b"h", [torch.full((size,), 3, dtype=torch.uint8)]))
    assert third.buffers[0].data_ptr() in addresses
    # Delivered as it is, owned buffers and all (no transport of rpcx's does that; one
    # may): the receiver decrypts in place, and the buffer stays its own while it holds
    # it.
    sender.deliver_to_receiver(0, third)  # type: ignore[attr-defined]
    assert delivered[-1].buffers[0].data_ptr() in addresses
    fourth = sender.seal(1, Frame(b"h", [torch.full((size,), 4, dtype=torch.uint8)]))
    assert fourth.buffers[0].data_ptr() in addresses - {delivered[-1].buffers[0].data_ptr()}
    sender.deliver_to_receiver(0, _as_received(fourth))  # type: ignore[attr-defined]
    assert not refused
    assert [int(frame.buffers[0][size // 2]) for frame in delivered] == [1, 2, 3, 4]
    assert int(delivered[2].buffers[0].min()) == 3  # (not written over by the fourth)
    assert sender.send_buffers.kept_bytes == 2 * cipher.sealed_size(size)


@pytest.mark.parametrize(("backend", "in_place"), [("tcp", True), ("shm", False)])
def test_what_a_socket_backend_reads_from_its_socket_is_decrypted_in_place(
    tmp_path: pathlib.Path, backend: str, in_place: bool,
) -> None:
    # tcp reads each buffer from its socket into memory of its own (Frame.owned); shm
    # hands large buffers over in shared segments, which a receiver must never write.
    with world(backend, size=2, init_method=f"file://{tmp_path / 'rendezvous'}",
               rpc_timeout=30, auth_key=KEY, encrypt="always"):
        sent = [torch.full((6 << 20,), fill, dtype=torch.uint8) for fill in range(3)]
        back = [rpcx.rpc_sync("worker1", remote.echo, args=(t,), timeout=30) for t in sent]
        assert all(torch.equal(got, want) for got, want in zip(back, sent, strict=True))
        decrypted, _ = rpcx.rpc_sync("worker1", remote.cipher_counts, timeout=30)
        here, _ = remote.cipher_counts()
    assert (decrypted, here) == ((3, 3) if in_place else (0, 0))


def test_ciphertext_has_storage_of_exactly_its_size() -> None:
    # (a transport may send a view's whole storage: nothing beyond the ciphertext may go)
    sender, _, _, _ = _pair()
    sealed = sender.seal(1, Frame(b"h", [torch.ones((40 << 20) // 4)]))  # over 32 MiB
    (buffer,) = sealed.buffers
    assert buffer.untyped_storage().nbytes() == buffer.numel() == (40 << 20) + cipher.TAG


def test_a_session_record_of_another_version_is_named_as_such() -> None:
    from rpcx._wire.sessions import SessionRecord

    record = SessionRecord(auth.new_nonce(), b"h" * 16, 2, cipher.KeyExchange().public)
    assert SessionRecord.read(record.to_bytes(), "rank 1", "me", 2) == record
    older = auth.new_nonce() + b"h" * 16 + cipher.KeyExchange().public  # (no magic, no mode)
    with pytest.raises(RpcError, match="rank 1 published a session record this version of "
                                       "rpcx cannot read"):
        SessionRecord.read(older, "rank 1", "me", 2)


@pytest.mark.parametrize("piece", [None, 64], ids=["one piece", "in pieces"])
def test_a_frame_of_a_header_alone_arrives_whole_or_is_refused_if_altered(
    monkeypatch: pytest.MonkeyPatch, piece: int | None,
) -> None:
    if piece is not None:
        monkeypatch.setattr(cipher, "PIECE_BYTES", piece)
    sender, _, delivered, refused = _pair()
    header = bytes(range(200))
    sender.deliver_to_receiver(0, sender.seal(1, Frame(header, [])))  # type: ignore[attr-defined]
    assert delivered[0].header == header and not refused
    altered = sender.seal(1, Frame(header, []))
    altered.header = altered.header[:20] + bytes([altered.header[20] ^ 1]) + altered.header[21:]
    with pytest.raises(ProtocolError, match="the header did not decrypt"):
        sender.deliver_to_receiver(0, altered)  # type: ignore[attr-defined]
    assert len(delivered) == 1


def test_a_frame_held_back_is_refused_unless_its_send_overlapped_the_later_one() -> None:
    # Two sends that overlapped (two sending threads; a call passing a bulk transfer)
    # may reach the wire in either order: taken once each, in any order. A frame whose
    # send had returned before the later one was sealed, held back by someone on the
    # path and delivered after it, is refused; so is one behind the window.
    sender, _, delivered, refused = _pair()
    deliver = sender.deliver_to_receiver  # type: ignore[attr-defined]
    held, _ = sender.sealing(1, Frame(b"held", []))  # (still being sent)
    again = Frame(bytes(held.header), list(held.buffers))  # (the receiver opens in place)
    deliver(0, sender.seal(1, Frame(b"later", [])))
    deliver(0, held)
    with pytest.raises(ProtocolError, match="replayed"):
        deliver(0, again)
    assert [f.header for f in delivered] == [b"later", b"held"] and refused

    sender, _, delivered, refused = _pair()
    deliver = sender.deliver_to_receiver  # type: ignore[attr-defined]
    held, token = sender.sealing(1, Frame(b"held", []))
    sender.sent(1, token)  # its send returned: what is sealed next comes after it
    deliver(0, sender.seal(1, Frame(b"later", [])))
    with pytest.raises(ProtocolError, match="reordered or held back"):
        deliver(0, held)
    assert [f.header for f in delivered] == [b"later"] and refused

    sender, _, delivered, refused = _pair()
    deliver = sender.deliver_to_receiver  # type: ignore[attr-defined]
    stale, _ = sender.sealing(1, Frame(b"stale", []))  # (in flight all along)
    for _ in range(4097):  # (the window keeps the last 4096 numbers)
        deliver(0, sender.seal(1, Frame(b"x", [])))
    with pytest.raises(ProtocolError, match="replayed or out of range"):
        deliver(0, stale)
    assert len(delivered) == 4097 and refused
