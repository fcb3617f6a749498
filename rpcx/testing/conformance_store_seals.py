"""Conformance: with a world key, a stray store client's barrier keys and addresses are
ignored, and the world forms.

A keyed world starts once on a ``file://`` store, and the test reads from the store's
file every key whose value the world sealed: its barrier keys, its process marks and
everything its transport published (addresses; gloo's and torch's own too, which go
through the same sealed view). Then, before a second world starts on a fresh store, a
plain store client writes a forged value under each of those keys. The second world
must form and serve calls between every pair, and every key it wrote again must hold its
genuine value. (Names, device maps and session records are refused rather than waited
past: ``TestAuthentication``'s stray store client.)
"""

from __future__ import annotations

import os
import re
import struct
import tempfile
from collections.abc import Iterator

import pytest
from torch._C._distributed_c10d import FileStore

import rpcx
from rpcx._wire import auth
from rpcx.testing import remote
from rpcx.testing.fixtures import WorldKeeper
from rpcx.testing.world import world

__all__ = ["TestStrayStoreValues", "store_file_entries"]

KEY = "conformance-key-" + "0123456789abcdef"
BOUND = 30.0
# all_gather's values: a forged one fails init_rpc naming the rank, by design.
_GATHERED = re.compile(r"/(name|devices|auth)/\d+$")
_LENGTH = struct.Struct("<I")


def store_file_entries(path: str) -> dict[str, bytes]:
    """Every key of a torch ``FileStore``'s file and its latest value (the file is a log
    of length-prefixed keys and values; a regular key starts with ``/``)."""
    with open(path, "rb") as file:
        data = file.read()
    entries, at, pending = {}, 0, None
    while at + _LENGTH.size <= len(data):
        (size,) = _LENGTH.unpack_from(data, at)
        item = data[at + _LENGTH.size:at + _LENGTH.size + size]
        at += _LENGTH.size + size
        if pending is None:
            pending = item.decode(errors="replace")
        else:
            if pending.startswith("/"):
                entries[pending[1:]] = item
            pending = None
    return entries


@pytest.mark.rpcx_requires("multi_process", reason="an in-process world has no store "
                           "other processes can reach")
class TestStrayStoreValues:
    """A keyed world, and a store client without the key writing over its keys."""

    @pytest.fixture
    def own_worlds(self, rpc_world_keeper: WorldKeeper) -> Iterator[str]:
        """A fresh directory for ``file://`` stores; no other world runs meanwhile."""
        rpc_world_keeper.close()
        with tempfile.TemporaryDirectory(prefix="rpcx-stray-") as directory:
            yield directory

    def test_forged_barrier_keys_and_addresses_are_ignored_and_the_world_forms(
            self, rpcx_backend: str, own_worlds: str) -> None:
        first = os.path.join(own_worlds, "first")
        with world(rpcx_backend, size=3, init_method="file://" + first, rpc_timeout=BOUND,
                   auth_key=KEY):
            written = store_file_entries(first)
        steering = sorted(key for key, value in written.items()
                          if auth.is_sealed(value) and not _GATHERED.search(key))
        assert "rpcx/s0//ready/1" in steering, steering  # the barrier init_rpc waits at
        assert any("/transport/" in key for key in steering), steering
        second = os.path.join(own_worlds, "second")
        stray = FileStore(second, -1)
        for key in steering:
            stray.set(key, '{"tcp": ["203.0.113.9", 9], "forged": true}')
        with world(rpcx_backend, size=3, init_method="file://" + second, rpc_timeout=BOUND,
                   auth_key=KEY) as started:
            for caller in started.names:
                for callee in started.names:
                    assert rpcx.rpc_sync(caller, remote.call_and_wait, args=(
                        rpcx.rpc_async, callee, remote.add, (2, 3)), timeout=BOUND) == 5
            after = store_file_entries(second)
        seal = auth.ValueSeal(KEY.encode())
        rewritten = [key for key in steering if auth.is_sealed(after.get(key, b""))]
        assert rewritten, "the second world wrote none of the first one's keys"
        for key in rewritten:  # (a seal's label is the key with every prefix, one "/"
            # between them; torch's PrefixStore puts another)
            assert seal.open(key.replace("//", "/"), after[key]) is not None, key
        del stray
