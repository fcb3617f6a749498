"""Connections made when a pair first talks (``SocketRpcBackendOptions.connect_on_demand``).

A world whose pairs connect on demand starts with no connection; a pair connects when
one of them first sends to the other, once, even when both dial at the same moment; a
worker gone before anyone talked to it is reported lost by whoever tries; the heartbeat
watches connected peers only; a world whose workers disagree on the option is refused
at start. The whole conformance suite also runs on demand (``nox -s tests``: the
``tcp`` pass sets ``RPCX_CONNECT_ON_DEMAND=1``); among it, a shutdown barrier that
finishes although a worker left without a word to workers not connected to it
(``TestHungPeer``).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

import rpcx
from rpcx._core import context as _context
from rpcx._core.heartbeat import Heartbeat
from rpcx.backends.socket_options import CONNECT_ON_DEMAND_ENV, SocketRpcBackendOptions
from rpcx.testing import remote
from rpcx.testing import world as world_module
from rpcx.testing.processes import worker_context
from rpcx.testing.world import world
from rpcx.transport_kit.sockets import CONNECTING_THREADS

BACKENDS = ["auto", "tcp"]
BOUND = 30.0


def _connections(names: list[str]) -> dict[str, int]:
    """Each worker's ``connected_peers``, asked from worker0 (which connects it to
    each), worker0's own last."""
    found = {name: rpcx.rpc_sync(name, remote.connected_peers, timeout=BOUND)
             for name in names if name != "worker0"}
    return {"worker0": remote.connected_peers(), **found}


@pytest.mark.parametrize("backend", BACKENDS)
def test_pairs_connect_when_they_first_talk(backend: str) -> None:
    with world(backend, size=4, connect_on_demand=True) as w:
        assert remote.connected_peers() == 0  # init_rpc connected nobody
        # Asking each worker connects it to worker0, and to no one else.
        assert _connections(w.names) == {"worker0": 3, "worker1": 1, "worker2": 1,
                                         "worker3": 1}
        assert rpcx.rpc_sync("worker1", remote.call_with,
                             args=(rpcx.rpc_sync, "worker2", remote.add, (2, 3))) == 5
        assert _connections(w.names) == {"worker0": 3, "worker1": 2, "worker2": 2,
                                         "worker3": 1}
        routes = rpcx.debug_info()["routes"]
        assert set(routes) == {"worker1", "worker2", "worker3"}  # known before connecting


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pair_that_dials_each_other_at_once_ends_with_one_connection(backend: str) -> None:
    # Every worker calls every other at the same moment, twice over: each pair dials
    # both ways at once; the lower rank's connection wins, and nothing is lost.
    size = 6
    with world(backend, size=size, connect_on_demand=True) as w:
        for round_ in range(2):
            gate = f"on-demand-{round_}"
            futures = [rpcx.rpc_async(name, remote.call_all, args=(w.names, gate, BOUND),
                                      timeout=BOUND) for name in w.names[1:]]
            for name in w.names[1:]:  # (the first round connects worker0 to each here)
                rpcx.rpc_sync(name, remote.set_event, args=(gate,))
            mine = remote.call_all(w.names)
            assert [mine, *(f.wait() for f in futures)] == [size - 1] * size
        assert set(_connections(w.names).values()) == {size - 1}
        # Each of the 15 connections was dialed by one worker and admitted by the other:
        # no pair has two, and none was dropped.
        counts = [remote.pairings(), *(rpcx.rpc_sync(name, remote.pairings, timeout=BOUND)
                                       for name in w.names[1:])]
        pairs = size * (size - 1) // 2
        assert sum(c.get("dialed", 0) for c in counts) == pairs, counts
        assert sum(c.get("admitted", 0) for c in counts) == pairs, counts
        for name in w.names:
            lost = (rpcx.debug_info() if name == "worker0"
                    else rpcx.rpc_sync(name, rpcx.debug_info, timeout=BOUND))["lost_peers"]
            assert lost == {}, (name, lost)
        # A few connector threads dialed for all of a worker's pairs, and what queued
        # meanwhile (small frames) was written at once: no writer thread per peer.
        for name in w.names[1:]:
            threads = rpcx.rpc_sync(name, remote.thread_names, timeout=BOUND)
            connecting = [t for t in threads if t.endswith("-connect")]
            assert len(connecting) <= CONNECTING_THREADS, threads
            assert not [t for t in threads if f"rpcx-{name}-send-" in t], threads


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_worker_gone_before_anyone_talked_to_it_is_reported_lost(backend: str) -> None:
    with world(backend, size=3, connect_on_demand=True, rpc_timeout=BOUND):
        pid = rpcx.rpc_sync("worker2", os.getpid)
        os.kill(pid, signal.SIGKILL)
        # worker0 was connected to it: it hears of the end at once.
        assert _context.current_agent().wait_lost(2, BOUND), "worker0 never heard it end"
        # worker1 never talked to it: its first call finds it gone, within the bound.
        started = time.monotonic()
        error = rpcx.rpc_sync("worker1", remote.call_error, args=("worker2", remote.add, 1, 1))
        assert error is not None
        kind, message = error
        assert kind == "PeerLostError", error
        assert "worker 'worker2'" in message and "could not connect" in message, message
        assert time.monotonic() - started < BOUND
        # ... and later calls fail at once with the same words.
        again = rpcx.rpc_sync("worker1", remote.call_error, args=("worker2", remote.add, 1, 1))
        assert again is not None and "could not connect" in again[1]


def test_a_silent_peer_without_a_connection_is_not_watched() -> None:
    pinged: list[int] = []
    silent: list[int] = []
    connected = {1: True, 2: False}
    beat = Heartbeat("w0", [1, 2], 3, interval=1.0, timeout=4.0, ping=pinged.append,
                     on_silent=lambda rank, quiet: silent.append(rank),
                     on_heard=lambda rank, quiet: None, connected=connected.__getitem__)
    beat._start_at(0.0)
    for tick in range(1, 21):  # 5 s of ticks, nothing heard from anyone
        beat._step(tick * 0.25)
    assert 2 not in pinged and 2 not in silent  # no connection: nothing to hear
    assert 1 in pinged and silent == [1]
    connected[2] = True  # connected at 5 s: its silence counts from then
    for tick in range(21, 37):  # until 9 s: 4 s connected and silent
        beat._step(tick * 0.25)
    assert 2 in pinged and silent == [1, 2]


def test_the_environment_variable_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONNECT_ON_DEMAND_ENV, raising=False)
    assert SocketRpcBackendOptions().connect_on_demand is False
    monkeypatch.setenv(CONNECT_ON_DEMAND_ENV, "1")
    assert SocketRpcBackendOptions().connect_on_demand is True
    assert SocketRpcBackendOptions(connect_on_demand=False).connect_on_demand is False
    # TensorPipe's options, converted (a program that only swapped its imports)
    options: Any = rpcx.TensorPipeRpcBackendOptions(rpc_timeout=5)
    from rpcx.options import converted_options
    assert converted_options(options, SocketRpcBackendOptions).connect_on_demand is True


def test_a_world_whose_workers_disagree_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
) -> None:
    # Two workers started with the variable connect on demand; worker0 is told not to.
    monkeypatch.setenv(CONNECT_ON_DEMAND_ENV, "1")
    init_method = f"file://{tmp_path}/rendezvous"
    spawn = worker_context()
    others = [spawn.Process(target=world_module._serve,
                            args=(rank, 3, init_method, "auto", {"rpc_timeout": BOUND}),
                            daemon=True) for rank in (1, 2)]
    for process in others:
        process.start()
    try:
        with pytest.raises(RuntimeError) as err:
            rpcx.init_rpc("worker0", backend="auto", rank=0, world_size=3,
                          rpc_backend_options=SocketRpcBackendOptions(
                              init_method=init_method, rpc_timeout=BOUND,
                              connect_on_demand=False))
        message = str(err.value)
        assert "worker 'worker0' (rank 0) connects its peers up front" in message, message
        assert "'worker1', 'worker2' connect on demand" in message, message
        for process in others:  # they refuse it too, and end
            process.join(BOUND)
            assert process.exitcode not in (0, None), process.exitcode
    finally:
        for process in others:
            if process.is_alive():
                process.kill()
