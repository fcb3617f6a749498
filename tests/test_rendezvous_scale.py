"""The rendezvous grows gently: a worker's store operations do not grow with the world.

Every worker of a world of N publishes its own keys and reads everyone's with one
``multi_get`` per gather, so what it writes and reads is the same at 2 workers and at
32; only its polls for keys not there yet (one ``check`` of all of them each, paced)
depend on how long it waits for the others. Counted on every operation of the
rendezvous (rpcx's ``BoundedStore``, over ``init_rpc`` and ``shutdown`` of an in-process
world); a transport's own use of the store it is handed is not counted here.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from rpcx._world import store as _store
from rpcx.testing.world import world

POLL = "check"  # one look for every key still missing


@pytest.fixture
def store_operations(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    """Every store operation rpcx makes from now on, counted by kind."""
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    run = _store.BoundedStore._run

    def counted(self: _store.BoundedStore, what: str, call: str, args: Any,
                timeout: float | None, again: bool = True) -> Any:
        with lock:
            counts[call] += 1  # (the store method's name)
        return run(self, what, call, args, timeout, again)

    monkeypatch.setattr(_store.BoundedStore, "_run", counted)
    yield counts


def _per_worker(counts: collections.Counter[str], size: int) -> dict[str, float]:
    return {kind: count / size for kind, count in counts.items()}


def test_store_operations_per_worker_do_not_grow_with_the_world(
        store_operations: collections.Counter[str]) -> None:
    seen = {}
    for size in (2, 16, 32):
        store_operations.clear()
        with world("loopback", size=size):
            pass
        seen[size] = _per_worker(store_operations, size)
    writes_and_reads = {size: {k: v for k, v in ops.items() if k != POLL}
                        for size, ops in seen.items()}
    assert writes_and_reads[2] == writes_and_reads[16] == writes_and_reads[32], seen
    assert writes_and_reads[32].get("multi_get", 0) >= 1, seen  # (it was counted at all)
    assert sum(writes_and_reads[32].values()) <= 16, seen
    # (Polls are not bounded here: how many depends on how long the others take.)
