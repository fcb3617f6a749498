"""A dynamic world's record in the store after a worker was killed (``kill -9``) in the
middle of it: holding the membership token, or listed on the roster. Real processes die
here (so that the kernel can say they are gone); the store is an in-process one."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest
from torch._C._distributed_c10d import HashStore

from rpcx._util.process_watch import local_mark
from rpcx._world.dynamic import DynamicWorld
from rpcx._world.store import BoundedStore
from rpcx.errors import RpcTimeoutError

BOUND = 30.0


def _dead_mark() -> str:
    """The process mark (hex) of a process that ran and is gone."""
    done = subprocess.run(
        [sys.executable, "-c", "from rpcx._util.process_watch import local_mark; "
                               "print(local_mark().hex())"],
        capture_output=True, text=True, timeout=BOUND, check=True)
    return done.stdout.strip()


def _world(store: BoundedStore, name: str, rank: int) -> DynamicWorld:
    return DynamicWorld(store, name, rank, BOUND)


def _holder(name: str, mark: str) -> str:
    return json.dumps({"name": name, "purpose": "join", "rank": 5, "nonce": "x",
                       "process": mark})


def test_a_token_whose_holder_died_is_taken_over(caplog: pytest.LogCaptureFixture) -> None:
    store = BoundedStore(HashStore(), "an in-process store")
    world = _world(store, "next", 1)
    world.store.set("token", _holder("victim", _dead_mark()))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, "rpcx.rendezvous"), world.token("join", 5.0):
        held = json.loads(world.store.get("token"))
        assert held["name"] == "next" and held["purpose"] == "join"
    assert time.monotonic() - started < 5.0
    assert "worker 'victim' (rank 5) died holding" in caplog.text
    assert world.store.get("token") == b""  # given back


def test_a_token_whose_holder_lives_is_waited_for_and_named() -> None:
    store = BoundedStore(HashStore(), "an in-process store")
    world = _world(store, "next", 1)
    world.store.set("token", _holder("slow", local_mark().hex()))
    with pytest.raises(RpcTimeoutError, match="worker 'slow' holds its membership token "
                                               r"\(to join\) all that time"), \
            world.token("join", 0.3):
        pass


def test_a_joiner_strikes_off_members_whose_processes_are_gone() -> None:
    store = BoundedStore(HashStore(), "an in-process store")
    alive, killed = _world(store, "alive", 0), _world(store, "killed", 1)
    with alive.token("join"):
        alive.enter(alive.roster())
    with killed.token("join"):
        killed.enter(killed.roster())
    killed.store.set("process/1", bytes.fromhex(_dead_mark()))  # as if killed (kill -9)
    newcomer = _world(store, "new", 1)
    with newcomer.token("join"):
        roster = newcomer.strike_off_the_dead(newcomer.roster())
        assert roster == {0: "alive"}
        newcomer.enter(roster)  # rank 1 is free again
    assert newcomer.roster() == {0: "alive", 1: "new"}
    assert newcomer.member(1) == "new"


def test_a_member_strikes_off_a_lost_worker_once() -> None:
    store = BoundedStore(HashStore(), "an in-process store")
    for rank, name in enumerate(["a", "b", "c"]):
        world = _world(store, name, rank)
        with world.token("join"):
            world.enter(world.roster())
    a, c = _world(store, "a", 0), _world(store, "c", 2)
    a.strike_off(1, "b", BOUND)
    assert a.roster() == {0: "a", 2: "c"}
    c.strike_off(1, "b", BOUND)  # seen by another member too: nothing more to do
    assert c.roster() == {0: "a", 2: "c"}
    # A worker that took the rank since is not struck off by a late report of the old.
    d = _world(store, "d", 1)
    with d.token("join"):
        d.enter(d.roster())
    c.strike_off(1, "b", BOUND)
    assert c.roster() == {0: "a", 1: "d", 2: "c"}


def test_with_a_key_an_earlier_holders_mark_put_back_strikes_no_one_off() -> None:
    # Rank 1's first holder was killed; a second worker took the rank. A store client
    # without the key puts back the first holder's genuine (sealed) mark, whose process
    # is gone: a joiner must not strike the live second holder off. The real death of
    # a holder is still seen.
    from rpcx._wire.auth import ValueSeal

    keyed = BoundedStore(HashStore(), "an in-process store").with_seal(
        ValueSeal(b"world-key-0123456789abcdef"))
    first = _world(keyed, "first", 1)
    with first.token("join"):
        first.enter(first.roster())
    dead = bytes.fromhex(_dead_mark())
    sealed_dead = keyed.seal.seal("rpcx/dynamic/process/1@1", dead)  # (its own, as if)
    first.store.set("process/1", sealed_dead)
    with first.token("leave"):
        first.leave()
    second = _world(keyed, "second", 1)
    with second.token("join"):
        second.enter(second.roster())
    first.store.set("process/1", sealed_dead)  # put back by a store client
    newcomer = _world(keyed, "new", 2)
    with newcomer.token("join"):
        assert newcomer.strike_off_the_dead(newcomer.roster()) == {1: "second"}
    # the second holder's own mark saying its process is gone is believed
    first.store.set("process/1", keyed.seal.seal("rpcx/dynamic/process/1@2", dead))
    with newcomer.token("join"):
        assert newcomer.strike_off_the_dead(newcomer.roster()) == {}
