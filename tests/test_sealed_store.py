"""The store's values that steer a keyed world, sealed (rpcx._world.sealed): a stray
client's barrier key or address is ignored, named in a log line, and waited past; a
worker's own barrier key that a stray overwrote is published again. An in-process store,
threads for workers."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from torch._C._distributed_c10d import HashStore

from rpcx._wire.auth import ValueSeal
from rpcx._world import rendezvous, sealed
from rpcx._world.store import BoundedStore
from rpcx.errors import AuthenticationError, RpcTimeoutError

KEY = b"sealed-store-test-key-0123456789ab"
BOUND = 10.0


class _Logged(logging.Handler):
    """Sets ``seen`` once a record containing ``text`` is logged under rpcx."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.seen, self.lines = text, threading.Event(), []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        self.lines.append(line)
        if self.text in line:
            self.seen.set()


@pytest.fixture
def logged() -> object:
    handlers: list[_Logged] = []

    def watch(text: str) -> _Logged:
        handler = _Logged(text)
        logging.getLogger("rpcx.rendezvous").addHandler(handler)
        handlers.append(handler)
        return handler

    yield watch
    for handler in handlers:
        logging.getLogger("rpcx.rendezvous").removeHandler(handler)
    sealed._warned.clear()


def _session() -> tuple[BoundedStore, BoundedStore]:
    """(a keyed worker's view of a session, a stray client's view of the same)."""
    store = BoundedStore(HashStore(), "an in-process store").prefixed("rpcx/s0")
    return store.with_seal(ValueSeal(KEY)), store


def _barrier(store: BoundedStore, rank: int, passed: list[int]) -> None:
    rendezvous.barrier(store, "ready", rank, 3, timeout=BOUND, is_gone=lambda r: False,
                       describe=lambda ranks: str(ranks), waiter=f"w{rank}")
    passed.append(rank)


def test_a_stray_barrier_key_is_ignored_logged_and_the_barrier_waits_for_the_worker(
        logged) -> None:  # type: ignore[no-untyped-def]
    keyed, stray = _session()
    stray.set("ready/2", b"1")  # as if worker 2 had arrived
    stray.set("ready/1", b"forged")
    warned = logged("'rpcx/s0/ready/2'")
    passed: list[int] = []
    early = [threading.Thread(target=_barrier, args=(keyed, rank, passed)) for rank in (0, 1)]
    for thread in early:
        thread.start()
    assert warned.seen.wait(BOUND), warned.lines  # named in a log line...
    assert passed == []  # ... and the barrier did not pass on it
    late = threading.Thread(target=_barrier, args=(keyed, 2, passed))
    late.start()
    for thread in [*early, late]:
        thread.join(BOUND)
    assert sorted(passed) == [0, 1, 2]


def test_a_workers_own_barrier_key_overwritten_by_a_stray_is_published_again(
        logged) -> None:  # type: ignore[no-untyped-def]
    keyed, stray = _session()
    warned = logged("'rpcx/s0/ready/1'")
    passed: list[int] = []
    first = [threading.Thread(target=_barrier, args=(keyed, rank, passed)) for rank in (0, 1)]
    for thread in first:
        thread.start()
    # both published (a look each 10 ms, bounded)
    assert keyed.wait_for(["ready/0", "ready/1"], time.monotonic() + BOUND) == []
    stray.set("ready/1", b"1")  # over worker 1's genuine key, while it waits for worker 2
    last = threading.Thread(target=_barrier, args=(keyed, 2, passed))
    last.start()
    for thread in [*first, last]:
        thread.join(BOUND)
    assert sorted(passed) == [0, 1, 2]
    assert ValueSeal(KEY).open("rpcx/s0/ready/1", stray.get("ready/1")) == b"1"
    assert warned.seen.is_set(), warned.lines  # (whoever read it first named it)


def test_a_barrier_key_never_made_genuine_times_out_naming_the_rank() -> None:
    keyed, stray = _session()
    for rank in (1, 2):
        stray.set(f"ready/{rank}", b"1")
    with pytest.raises(RpcTimeoutError, match=r"missing: \[1, 2\]"):
        rendezvous.barrier(keyed, "ready", 0, 3, timeout=0.5, is_gone=lambda r: False,
                           describe=lambda ranks: str(ranks), waiter="w0")


def test_a_stray_address_is_ignored_until_the_worker_publishes_its_own(
        logged) -> None:  # type: ignore[no-untyped-def]
    keyed, stray = _session()
    reader = rendezvous.prefixed(keyed, "transport", BOUND)
    writer = rendezvous.prefixed(keyed, "transport", BOUND)
    stray.prefixed("transport").set("tcp/1", b'{"tcp": ["203.0.113.9", 1]}')
    warned = logged("'rpcx/s0/transport/tcp/1'")
    found: list[bytes] = []
    thread = threading.Thread(target=lambda: found.append(reader.get("tcp/1")))
    thread.start()
    assert warned.seen.wait(BOUND), warned.lines
    assert found == []
    writer.set("tcp/1", b'{"tcp": ["127.0.0.1", 4242]}')
    thread.join(BOUND)
    assert found == [b'{"tcp": ["127.0.0.1", 4242]}']
    # what a transport writes is sealed under its whole key: no other key opens it
    raw = stray.prefixed("transport").get("tcp/1")
    assert ValueSeal(KEY).open("rpcx/s0/transport/tcp/1", raw) == found[0]
    assert ValueSeal(KEY).open("rpcx/s1/transport/tcp/1", raw) is None


def test_an_address_never_made_genuine_fails_naming_the_key() -> None:
    keyed, stray = _session()
    stray.prefixed("transport").set("tcp/1", b"forged")
    reader = rendezvous.prefixed(keyed, "transport", 0.3)
    with pytest.raises(AuthenticationError, match="'rpcx/s0/transport/tcp/1' is not sealed"):
        reader.get("tcp/1")


def test_counters_pass_through_and_compare_set_works_on_sealed_values() -> None:
    keyed, stray = _session()
    store = rendezvous.prefixed(keyed, "transport", BOUND)
    assert store.add("count", 2) == 2 and store.add("count", 1) == 3
    assert stray.prefixed("transport").get("count") == b"3"  # (a counter: unsealed)
    assert store.compare_set("token", "", "mine") == b"mine"
    raw = stray.prefixed("transport").get("token")
    assert ValueSeal(KEY).open("rpcx/s0/transport/token", raw) == b"mine"
    assert store.compare_set("token", "other", "theirs") == b"mine"
    assert store.compare_set("token", "mine", "") == b""
    assert store.check(["count", "token"])


def test_process_marks_a_stray_forged_are_not_learnt() -> None:
    keyed, stray = _session()
    sealed.publish(keyed, "process/1", b"genuine mark")
    stray.set("process/2", b"forged mark")
    assert sealed.read(keyed, ["process/1", "process/2"]) == [b"genuine mark", None]
    # without a key nothing is sealed or checked
    sealed.publish(stray, "process/3", b"plain")
    assert sealed.read(stray, ["process/3"]) == [b"plain"]


def test_compare_set_expecting_no_value_replaces_a_forged_one(logged) -> None:  # type: ignore[no-untyped-def]
    keyed, stray = _session()
    stray.prefixed("transport").set("rpcIsStaticGroup", b"false")  # (torch's agent's key)
    warned = logged("'rpcx/s0/transport/rpcIsStaticGroup'")
    store = rendezvous.prefixed(keyed, "transport", BOUND)
    assert store.compare_set("rpcIsStaticGroup", "", "true") == b"true"
    assert warned.seen.is_set(), warned.lines
    # one that expects a value is not given the forged one as if it matched
    stray.prefixed("transport").set("other", b"x")
    assert store.compare_set("other", "x", "y") == b"x"
    assert stray.prefixed("transport").get("other") == b"x"


def test_compare_set_expecting_none_takes_a_key_set_empty_through_the_view() -> None:
    # torch's token pattern: set(k, "") to free it, then compare_set(k, "", mine)
    keyed, _ = _session()
    store = rendezvous.prefixed(keyed, "transport", BOUND)
    store.set("token", "")
    assert store.compare_set("token", "", "mine") == b"mine"
    assert store.compare_set("token", "", "theirs") == b"mine"  # (held: not taken)


def test_multi_get_is_one_store_operation_and_waits_only_for_forged_keys() -> None:
    # A world's transports read every peer's address with one multi_get: sealing must
    # not make that one operation per key (N workers, N² operations on the one store).
    seal = ValueSeal(KEY)

    class Counting:
        def __init__(self) -> None:
            self.values: dict[str, bytes] = {}
            self.calls: list[str] = []

        def multi_get(self, keys: list[str]) -> list[bytes]:
            self.calls.append("multi_get")
            return [self.values[k] for k in keys]

        def get(self, key: str) -> bytes:
            self.calls.append("get")
            self.values[key] = seal.seal("p/" + key, b"late")  # (the owner writes it now)
            return self.values[key]

    inner = Counting()
    store = sealed.SealedStore(inner, seal, "p/", BOUND)
    inner.values = {f"a/{r}": seal.seal(f"p/a/{r}", b"%d" % r) for r in range(8)}
    assert store.multi_get([f"a/{r}" for r in range(8)]) == [b"%d" % r for r in range(8)]
    assert inner.calls == ["multi_get"]
    inner.values["a/3"] = b"forged"
    assert store.multi_get(["a/2", "a/3"]) == [b"2", b"late"]
    assert inner.calls == ["multi_get", "multi_get", "get"]
