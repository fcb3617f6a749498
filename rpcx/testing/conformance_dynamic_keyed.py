"""Conformance: a dynamic world with a world key, every pair encrypted.

Workers that join later prove the key before anything of theirs runs: a joiner checks
the members' sealed session records and publishes its own before it enters, and each
member keys the pair with a newcomer from that record when its connection arrives. What
must hold: calls between old and new workers send nothing in clear; a joiner with
another key, with none, or with other encryption settings is refused, naming why, and
the world goes on; frames a newcomer alters or replays run nothing; a worker that takes
a rank again gets keys of its own.

This process is rank 0 (it hosts the store); the others are processes it starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import rpcx
from rpcx._wire import cipher
from rpcx.registry import resolve_backend
from rpcx.testing import remote
from rpcx.testing.conformance_auth import assert_refused
from rpcx.testing.conformance_cipher import PATTERN, patterned
from rpcx.testing.fixtures import WorldKeeper
from rpcx.testing.world import DynamicWorld, dynamic_world

__all__ = ["TestKeyedDynamicWorld"]

KEY = "conformance-key-" + "0123456789abcdef"
OTHER_KEY = "another-world-key-0123456789abcdef"
BOUND = 60.0


@pytest.mark.rpcx_requires(
    "dynamic", reason="it cannot admit workers after the world started")
@pytest.mark.skipif(not cipher.aead_available(),
                    reason="encryption needs the 'cryptography' package (45 or newer)")
class TestKeyedDynamicWorld:
    """A dynamic world whose workers hold ``KEY`` and encrypt every pair."""

    @pytest.fixture
    def keyed(self, rpcx_backend: str, rpc_world_keeper: WorldKeeper,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[DynamicWorld]:
        """``lead`` (this process, rank 0), then ``late2`` at rank 2 and ``late1`` at 1."""
        for variable in ("RPCX_AUTH_KEY", cipher.ENCRYPT_ENV):  # (the options decide)
            monkeypatch.delenv(variable, raising=False)
        rpc_world_keeper.close()
        with dynamic_world(rpcx_backend, name="lead", rpc_timeout=BOUND, auth_key=KEY,
                           encrypt="always") as world:
            assert world.join("late2", 2) == ("joined", "late2")
            assert world.join("late1", 1) == ("joined", "late1")
            yield world

    def test_old_and_new_workers_call_each_other_with_nothing_in_clear(
            self, keyed: DynamicWorld) -> None:
        names = ["lead", "late1", "late2"]
        for name in names:
            rpcx.rpc_sync(name, remote.spy_on_the_wire)
        for tensor in (patterned(1), patterned(4096)):  # in the header; beside it
            assert torch.equal(rpcx.rpc_sync("late1", remote.echo, args=(tensor,)), tensor)
            relayed = rpcx.rpc_sync("late2", remote.call_and_wait, args=(
                rpcx.rpc_async, "late1", remote.echo, (tensor,)), timeout=BOUND)
            assert torch.equal(relayed, tensor)
            back = rpcx.rpc_sync("late1", remote.call_and_wait, args=(
                rpcx.rpc_async, "lead", remote.echo, (tensor,)), timeout=BOUND)
            assert torch.equal(back, tensor)
        for name in names:
            assert rpcx.rpc_sync(name, rpcx.debug_info)["encrypted_peers"] == 2, name
            parts, found = rpcx.rpc_sync(name, remote.wire_has, args=(PATTERN,))
            assert parts > 0, f"{name} sent nothing through its transport"
            assert not found, f"{name} sent the tensor's bytes in clear"

    @pytest.mark.parametrize("settings", [
        ({"auth_key": OTHER_KEY}, "not sealed with this worker's world key"),
        ({"auth_key": None, "encrypt": False}, "this worker has none"),
        ({"encrypt": False}, "this worker does not encrypt and rank 0 ('lead') encrypts "
                             "every pair"),
    ], ids=["another-key", "no-key", "not-encrypting"])
    def test_a_joiner_without_the_key_or_the_settings_is_refused(
            self, keyed: DynamicWorld, settings: tuple[dict[str, Any], str]) -> None:
        options, reason = settings
        outcome = keyed.join("stranger", 3, **options)
        assert outcome[:2] == ("refused", "RpcError"), outcome
        assert reason in outcome[2], outcome
        # the world is as it was, and a genuine worker takes the rank
        assert [w.name for w in rpcx.get_worker_infos()] == ["lead", "late1", "late2"]
        assert keyed.join("late3", 3) == ("joined", "late3")
        assert rpcx.rpc_sync("late2", remote.call_and_wait, args=(
            rpcx.rpc_async, "late3", remote.add, (2, 3)), timeout=BOUND) == 5

    def test_frames_a_newcomer_alters_or_replays_run_nothing(
            self, keyed: DynamicWorld) -> None:
        # late3 -> late2: a genuine frame sent twice; late2 -> late1: a bit flipped in a
        # tensor's ciphertext. Each receiver refuses, and reports the sender lost (which
        # strikes it off the store's roster); lead, connected to all, goes on.
        tensor, replayed = "RPCX_KIT_dyn_tensor", "RPCX_KIT_dyn_replayed"
        assert keyed.join("late3", 3) == ("joined", "late3")
        rpcx.rpc_sync("late3", remote.send_unauthenticated_call, args=(2, "replayed", replayed))
        assert_refused("late2", "late3", "replayed")
        assert rpcx.rpc_sync("late2", remote.tally_of, args=(replayed,)) == 1  # the genuine one
        rpcx.rpc_sync("late2", remote.send_altered_encrypted_call, args=(1, "tensor", tensor))
        assert_refused("late1", "late2", "altered in transit")
        assert rpcx.rpc_sync("late1", remote.tally_of, args=(tensor,)) == 0
        for name in ("late1", "late2", "late3"):
            assert rpcx.rpc_sync(name, remote.add, args=(1, 1), timeout=BOUND) == 2

    def test_a_rank_taken_again_is_keyed_anew(
            self, keyed: DynamicWorld, rpcx_backend: str) -> None:
        if not resolve_backend(rpcx_backend).capabilities.reuses_ranks:
            pytest.skip(f"backend {rpcx_backend!r} does not let a rank be taken again")
        keyed.leave("late1")
        assert rpcx.rpc_sync("late2", remote.wait_lost, args=(1, BOUND)), \
            "late1's departure never reached late2"
        assert keyed.join("again1", 1) == ("joined", "again1")
        rpcx.rpc_sync("late2", remote.spy_on_the_wire)
        tensor = patterned(4096)
        assert torch.equal(rpcx.rpc_sync("again1", remote.echo, args=(tensor,)), tensor)
        relayed = rpcx.rpc_sync("late2", remote.call_and_wait, args=(
            rpcx.rpc_async, "again1", remote.echo, (tensor,)), timeout=BOUND)
        assert torch.equal(relayed, tensor)
        parts, found = rpcx.rpc_sync("late2", remote.wire_has, args=(PATTERN, 1))
        assert parts > 0 and not found
        assert rpcx.rpc_sync("again1", rpcx.debug_info)["encrypted_peers"] == 2
