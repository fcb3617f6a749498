"""Session records in a dynamic world with a key: a member keys each newcomer from the
sealed record it published, refuses one without a genuine record (nothing keyed, no
proof answered), and a worker that takes a rank again gets keys of its own. The store
is an in-process one; no transport runs here (the conformance kit's
``TestKeyedDynamicWorld`` runs the same across processes on every dynamic backend)."""

from __future__ import annotations

import pytest
import torch
from torch._C._distributed_c10d import HashStore

from rpcx._core.dynamic_join import _DynamicSessions
from rpcx._wire import auth, cipher
from rpcx._wire.sessions import Sessions
from rpcx._world.dynamic import DynamicWorld
from rpcx._world.store import BoundedStore
from rpcx.errors import ProtocolError, RpcError
from rpcx.options import RpcBackendOptions
from rpcx.transport import Frame

KEY = b"sessions-test-key-0123456789abcdef"
BOUND = 10.0
needs_cipher = pytest.mark.skipif(not cipher.aead_available(),
                                  reason="encryption needs the 'cryptography' package")


def _joiner(store: BoundedStore, name: str, rank: int, key: bytes | None = KEY,
            encrypt: str | None = "always") -> _DynamicSessions:
    """A worker that publishes its record and enters as joining does (under no token:
    one at a time here)."""
    world = DynamicWorld(store.with_seal(auth.ValueSeal(key) if key else None), name, rank,
                         BOUND)
    sessions = _DynamicSessions(world, key, encrypt, RpcBackendOptions())
    roster = world.roster()
    sessions.meet(roster)
    world.enter(roster)
    return sessions


def _started(sessions: _DynamicSessions, size: int) -> tuple[auth.FrameGuard,
                                                             auth.ConnectionAuth]:
    guard, connections = sessions.start([f"w{r}" for r in range(size)])
    assert guard is not None and connections is not None
    return guard, connections


def _delivered(guard: auth.FrameGuard, src: int, frame: Frame) -> list[Frame]:
    got: list[Frame] = []
    refused: list[str] = []
    check = guard.guarding(lambda _src, f: got.append(f), lambda _src, why: refused.append(why))
    try:
        check(src, frame)
    except ProtocolError:
        assert refused or src in guard._refused_from
    return got


@pytest.fixture
def store() -> BoundedStore:
    return BoundedStore(HashStore(), "an in-process store")


@needs_cipher
def test_a_member_keys_a_newcomer_from_its_record_and_a_later_holder_anew(
        store: BoundedStore) -> None:
    lead = _joiner(store, "w0", 0)
    lead_guard, lead_proofs = _started(lead, 1)
    late = _joiner(store, "w1", 1)
    late_guard, late_proofs = _started(late, 2)
    # the newcomer's connection arrives: the member reads its record, then keys the pair
    lead_proofs.renew(1)
    challenge = auth.ConnectionAuth.challenge()
    assert lead_proofs.check("tcp connect", 1, 0, challenge,
                             late_proofs.proof("tcp connect", 1, 0, challenge))
    lead.admit(1)
    tensor = torch.arange(1000, dtype=torch.float32)
    frame = late_guard.seal(0, Frame(b"call", [tensor.clone()]))
    assert frame.buffers[0].numel() != tensor.numel() * 4 or not torch.equal(
        frame.buffers[0].view(torch.float32)[:1000], tensor)  # (encrypted, not in clear)
    (got,) = _delivered(lead_guard, 1, frame)
    assert got.header == b"call" and torch.equal(got.buffers[0].view(torch.float32), tensor)
    back = lead_guard.seal(1, Frame(b"answer", []))
    assert _delivered(late_guard, 0, back)[0].header == b"answer"
    # the worker leaves; another takes rank 1 and publishes a record of its own
    DynamicWorld(store.with_seal(auth.ValueSeal(KEY)), "w1", 1, BOUND).leave()
    again = _joiner(store, "again", 1)
    again_guard, _ = _started(again, 2)
    old_frame = late_guard.seal(0, Frame(b"old", []))  # (the one that left, still sending)
    lead_guard.forget(1)  # (what the transport's loss report does: its keys go)
    assert _delivered(lead_guard, 1, Frame(bytes(old_frame.header), [])) == []
    lead.admit(1)
    assert _delivered(lead_guard, 1, old_frame) == []  # its keys verify nothing any more
    lead.admit(1)  # (a refusal is the old holder's: the next one starts clean)
    assert _delivered(lead_guard, 1, again_guard.seal(0, Frame(b"new", [])))[0].header == b"new"


def test_a_newcomer_without_a_genuine_record_is_refused_and_nothing_is_keyed(
        store: BoundedStore) -> None:
    lead = _joiner(store, "w0", 0, encrypt=None)
    lead_guard, lead_proofs = _started(lead, 1)
    # a stray store client writes a record for rank 1 under another key, and a name
    stray = DynamicWorld(store, "intruder", 1, BOUND).store  # (no key: plain values)
    forged = Sessions(b"another-key-0123456789abcdef", 1, "intruder", None)
    stray.set("session/1", auth.ValueSeal(b"another-key-0123456789abcdef").seal(
        "rpcx/dynamic/session/1", forged.mine.to_bytes()))
    stray.set("member/1", "intruder")
    with pytest.raises(RpcError, match="session record of rank 1 is not sealed with this "
                                       "worker's world key"):
        lead_proofs.renew(1)
    with pytest.raises(RpcError, match="not sealed"):
        lead.admit(1)
    keyed_world = DynamicWorld(store.with_seal(auth.ValueSeal(KEY)), "w0", 0, BOUND)
    with pytest.raises(RpcError, match="the name of rank 1 in the store is not sealed"):
        keyed_world.member(1)  # (what the agent admits the newcomer as)
    assert not lead_proofs.check("tcp connect", 1, 0, b"c" * 16, b"p" * 32)
    frame = Frame(b"\0" * 48 + b"call", [])
    assert _delivered(lead_guard, 1, frame) == []
    # one that published nothing (it runs without a key) is named as such
    stray.set("session/1", b"")
    with pytest.raises(RpcError, match="rank 1 published no session record"):
        lead.admit(1)


def test_a_joiner_meets_members_with_another_key_or_settings_and_is_told_why(
        store: BoundedStore) -> None:
    _joiner(store, "w0", 0, encrypt=None)
    with pytest.raises(RpcError, match="its roster in the store is not sealed with this "
                                       "worker's world key"):
        _joiner(store, "w1", 1, key=b"another-key-0123456789abcdef", encrypt=None)
    with pytest.raises(RpcError, match=r"members hold a world key .* this worker has none"):
        _joiner(store, "w1", 1, key=None, encrypt=None)
    if cipher.aead_available():
        with pytest.raises(RpcError, match=r"this worker encrypts every pair .* and rank 0 "
                                           r"\('w0'\) does not encrypt"):
            _joiner(store, "w1", 1, encrypt="always")
    keyed = DynamicWorld(store.with_seal(auth.ValueSeal(KEY)), "w", 5, BOUND)
    assert keyed.roster() == {0: "w0"}  # none of them entered
