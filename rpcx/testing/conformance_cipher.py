"""Conformance: an encrypted world (``encrypt="always"``) runs as before, sends nothing
in clear, and refuses altered, replayed and unencrypted frames.

Each test starts a world of its own, so the module's shared world is closed first. The
cipher sits above the transport (a decorator, like the world key's seals), so every
backend takes these tests; without the ``cryptography`` package they skip.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator

import pytest
import torch

import rpcx
from rpcx._util import memory
from rpcx._wire import cipher
from rpcx.testing import remote
from rpcx.testing.conformance_auth import assert_refused
from rpcx.testing.fixtures import WorldKeeper
from rpcx.testing.world import world

__all__ = ["TestEncryption"]

KEY = "conformance-key-" + "0123456789abcdef"
BOUND = 30.0
# Bytes no frame would hold by chance: a tensor made of them, sent in a call and
# returned, must not appear in anything a worker hands its transport.
PATTERN = bytes(range(7, 7 + 64))
HUGE = 6 << 20  # over the cipher's sizes for reused buffers and decryption in place


def patterned(repeats: int) -> torch.Tensor:
    """A tensor of ``PATTERN`` repeated ``repeats`` times."""
    return torch.frombuffer(bytearray(PATTERN * repeats), dtype=torch.uint8)


@pytest.mark.skipif(not cipher.aead_available(),
                    reason="encryption needs the 'cryptography' package (45 or newer)")
class TestEncryption:
    """A world whose workers hold ``KEY`` and encrypt every pair."""

    @pytest.fixture
    def own_worlds(self, rpc_world_keeper: WorldKeeper) -> Iterator[str]:
        """A fresh ``file://`` rendezvous; this process runs no other world meanwhile."""
        rpc_world_keeper.close()
        with tempfile.TemporaryDirectory(prefix="rpcx-cipher-") as directory:
            yield "file://" + os.path.join(directory, "rendezvous")

    def test_calls_run_as_before_and_nothing_crosses_in_clear(
        self, rpcx_backend: str, own_worlds: str,
    ) -> None:
        with world(rpcx_backend, size=3, init_method=own_worlds, rpc_timeout=BOUND,
                   auth_key=KEY, encrypt="always") as started:
            for name in started.names:
                rpcx.rpc_sync(name, remote.spy_on_the_wire)
            small, large = patterned(1), patterned(4096)  # in the header; beside it
            for tensor in (small, large):
                back = rpcx.rpc_sync("worker1", remote.echo, args=(tensor,), timeout=BOUND)
                assert torch.equal(back, tensor)
                relayed = rpcx.rpc_sync("worker1", remote.call_and_wait, args=(
                    rpcx.rpc_async, "worker2", remote.echo, (tensor,)), timeout=BOUND)
                assert torch.equal(relayed, tensor)
            rref = rpcx.remote("worker2", remote.echo, args=(large,))
            assert torch.equal(rref.to_here(timeout=BOUND), large)
            # Tensors of megabytes: each side's encrypted copies are used again once
            # sent, and buffers received into the transport's own memory are decrypted
            # where they lie; what earlier calls returned must stay as it came.
            huge = [patterned(HUGE // len(PATTERN)) + fill for fill in range(3)]
            returned = [rpcx.rpc_sync("worker1", remote.echo, args=(tensor,),
                                      timeout=BOUND) for tensor in huge]
            held = rpcx.remote("worker2", remote.echo, args=(huge[0],))
            returned.append(rpcx.rpc_sync("worker2", remote.echo, args=(huge[1],),
                                          timeout=BOUND))
            assert torch.equal(held.to_here(timeout=BOUND), huge[0])
            for got, want in zip(returned, [*huge, huge[1]], strict=True):
                assert torch.equal(got, want)
            if memory.reuses_buffers():  # (each sent several: one was used again)
                for name in ("worker0", "worker1"):
                    _, reused = rpcx.rpc_sync(name, remote.cipher_counts, timeout=BOUND)
                    assert reused > 0, f"{name} used no encrypted send buffer again"
            assert rpcx.debug_info()["encrypted_peers"] == 2
            for name in started.names:
                parts, found = rpcx.rpc_sync(name, remote.wire_has, args=(PATTERN,))
                assert parts > 0, f"{name} sent nothing through its transport"
                assert not found, f"{name} sent the tensor's bytes in clear"

    def test_altered_replayed_and_plain_frames_run_nothing(
        self, rpcx_backend: str, own_worlds: str,
    ) -> None:
        # worker2 -> worker1: a bit flipped in a tensor's ciphertext; worker3 -> worker1:
        # a bit flipped in the header's; worker3 -> worker2: an unencrypted call;
        # worker4 -> worker1 (below): a genuine frame sent twice. Each receiver refuses,
        # reports the sender lost, and keeps serving worker0.
        with world(rpcx_backend, size=5, init_method=own_worlds, rpc_timeout=BOUND,
                   auth_key=KEY, encrypt="always") as started:
            markers = {how: f"RPCX_KIT_{how}_{uuid.uuid4().hex}"
                       for how in ("tensor", "header", "plain", "replayed")}
            rpcx.rpc_sync("worker2", remote.send_altered_encrypted_call,
                          args=(1, "tensor", markers["tensor"]))
            rpcx.rpc_sync("worker3", remote.send_altered_encrypted_call,
                          args=(1, "header", markers["header"]))
            rpcx.rpc_sync("worker3", remote.send_altered_encrypted_call,
                          args=(2, "plain", markers["plain"]))
            for victim, sender, problem in (("worker1", "worker2", "altered in transit"),
                                            ("worker1", "worker3", "did not decrypt"),
                                            ("worker2", "worker3", "did not decrypt")):
                assert_refused(victim, sender, problem)
            assert rpcx.rpc_sync("worker1", remote.tally_of, args=(markers["tensor"],)) == 0
            assert rpcx.rpc_sync("worker1", remote.tally_of, args=(markers["header"],)) == 0
            assert rpcx.rpc_sync("worker2", remote.tally_of, args=(markers["plain"],)) == 0
            rpcx.rpc_sync("worker4", remote.send_unauthenticated_call,
                          args=(1, "replayed", markers["replayed"]))
            assert_refused("worker1", "worker4", "replayed")
            # worker4 -> worker2: a genuine frame held back and delivered after a later one
            reordered = f"RPCX_KIT_reordered_{uuid.uuid4().hex}"
            rpcx.rpc_sync("worker4", remote.send_altered_encrypted_call,
                          args=(2, "reordered", reordered))
            assert_refused("worker2", "worker4", "reordered")
            assert rpcx.rpc_sync("worker2", remote.wait_for_tally,
                                 args=(reordered + "_later", 1, BOUND)) == 1
            assert rpcx.rpc_sync("worker2", remote.tally_of, args=(reordered,)) == 0
            assert rpcx.rpc_sync("worker1", remote.tally_of,
                                 args=(markers["replayed"],)) == 1  # the genuine one, once
            for name in started.names[1:]:
                assert rpcx.rpc_sync(name, remote.add, args=(2, 3), timeout=BOUND) == 5
