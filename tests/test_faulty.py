"""The fault injector, ``backend="faulty:<name>"``: it drops, duplicates and delays the
frames it is told to; and rpcx under it: a duplicated request runs once, a duplicated
reply is taken once (RRefs in it neither leak nor are freed early).

On a lossy transport (this one) bookkeeping is acknowledged and sent again until
answered (rpcx._core.retransmit): lost or duplicated RRef and autograd messages change nothing,
and a lost reply is sent again from the one the callee kept.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid

import pytest
import torch

import rpcx
from rpcx import autograd as dist_autograd
from rpcx._core import context as _context
from rpcx.errors import BackendNotFoundError
from rpcx.faulty import FAULTS_ENV, Faults
from rpcx.registry import resolve_backend
from rpcx.testing import remote, training
from rpcx.testing.stopping import stopped
from rpcx.testing.world import world

BOUND = 30.0


def _faults(monkeypatch: pytest.MonkeyPatch, **fields: object) -> None:
    monkeypatch.setenv(FAULTS_ENV, json.dumps(fields))


def _injected() -> dict[tuple[str, str], int]:
    return dict(_context.current_agent()._transport.injected)  # type: ignore[attr-defined]


def test_faulty_names_wrap_any_backend() -> None:
    spec = resolve_backend("faulty:loopback")
    inner = resolve_backend("loopback")
    assert spec.name == "faulty:loopback"
    assert spec.capabilities == dataclasses.replace(inner.capabilities, lossy=True)
    assert spec.options_type is inner.options_type
    with pytest.raises(BackendNotFoundError, match="no-such"):
        resolve_backend("faulty:no-such")


@pytest.mark.parametrize(("faults", "message"), [
    (Faults(drop={"NOT_A_KIND": 1.0}), "unknown message kind 'NOT_A_KIND'"),
    (Faults(duplicate={"CALL": 1.5}), "no probability"),
    (Faults(delay_seconds=-1), "delay_seconds"),
    (Faults(drop={"reply:NOT_A_KIND": 1.0}), "unknown message kind 'NOT_A_KIND'"),
    (Faults(drop={"reply:RESULT": 1.0}), "a reply answers a request, never a RESULT"),
    (Faults(duplicate={"reply:RREF_FETCH": 2.0}), "no probability"),
])
def test_faults_are_validated(faults: Faults, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        faults.validate()


def test_a_malformed_environment_variable_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAULTS_ENV, '{"dorp": {}}')
    with pytest.raises(ValueError, match="RPCX_FAULTS is not a Faults description"):
        Faults.from_environment()


def test_dropped_calls_time_out_and_other_kinds_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    _faults(monkeypatch, drop={"CALL": 1.0})
    with world("faulty:loopback", size=2):
        with pytest.raises(rpcx.RpcTimeoutError):
            rpcx.rpc_sync("worker1", remote.add, args=(1, 2), timeout=0.5)
        rref = rpcx.remote("worker1", remote.Counter, args=(5,))  # REMOTE_CALL: not dropped
        assert rref.to_here(timeout=BOUND).count == 5
        assert _injected() == {("drop", "CALL"): 1}


def test_duplicated_requests_run_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A duplicated request frame is dropped unread by its (caller, request id).
    _faults(monkeypatch, duplicate={"CALL": 1.0})
    key = uuid.uuid4().hex
    # gloo: worker1 serves worker0's requests in the order they arrive (on the receiving
    # thread), so the second copy has been handled before the remote() that reads the tally.
    with world("faulty:gloo", size=2, rpc_timeout=BOUND):
        assert rpcx.rpc_sync("worker1", remote.tally, args=(key,), timeout=BOUND) == 1
        tallied = rpcx.remote("worker1", remote.tally_of, args=(key,))  # not duplicated
        assert tallied.to_here(timeout=BOUND) == 1
        assert _injected() == {("duplicate", "CALL"): 1}


@pytest.mark.parametrize("encrypt", [None, "always"])
def test_duplicated_requests_run_once_under_a_world_key(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, encrypt: str | None,
) -> None:
    # The seals sit under the injector, and seal in place: each copy is sealed on its
    # own (a fresh number, not a seal over a seal, which the receiver would drop as a
    # frame of no known kind), and the receiver drops the second by its request id.
    caplog.set_level(logging.WARNING, logger="rpcx")
    if encrypt is not None:
        pytest.importorskip("cryptography.hazmat.primitives.ciphers.aead")
    _faults(monkeypatch, duplicate={"CALL": 1.0})
    key = uuid.uuid4().hex
    with world("faulty:loopback", size=2, rpc_timeout=BOUND, auth_key="k" * 32,
               encrypt=encrypt):
        big = torch.arange(1 << 20, dtype=torch.float32)  # (beside the header: encrypted)
        assert rpcx.rpc_sync("worker1", remote.tally, args=(key, big), timeout=BOUND) == 1
        assert rpcx.rpc_sync("worker1", remote.tally_of, args=(key,), timeout=BOUND) == 1
        assert _injected() == {("duplicate", "CALL"): 2}
        assert rpcx.debug_info()["refused_frames"] == 0
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_duplicated_rref_traffic_neither_leaks_nor_frees_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every request and reply of an RRef's life sent twice: values are created once,
    # replies carrying RRefs are taken once, and the owner frees the value exactly when
    # the last reference goes.
    kinds = ("CALL", "REMOTE_CALL", "RESULT", "RREF_FETCH", "RREF_FORKS", "RREF_DELETE")
    _faults(monkeypatch, duplicate=dict.fromkeys(kinds, 1.0))
    with world("faulty:gloo", size=3, rpc_timeout=BOUND):
        baseline = rpcx.rpc_sync("worker1", remote.tracked_live)
        held = rpcx.remote("worker1", remote.Tracked, args=("held",))
        assert held.to_here(timeout=BOUND).get() == "held"
        assert rpcx.rpc_sync("worker1", remote.tracked_live) == baseline + 1
        passed = rpcx.rpc_sync("worker2", remote.wrap_in_rref, args=(7,))  # an RRef back
        assert passed.to_here(timeout=BOUND) == 7
        assert rpcx.rpc_sync("worker2", remote.rref_to_here, args=(held,)).get() == "held"
        del held
        remote.rref_settle()
        rpcx.rpc_sync("worker2", remote.rref_settle)
        assert rpcx.rpc_sync("worker1", remote.tracked_live) == baseline
        assert passed.to_here(timeout=BOUND) == 7  # still alive: not freed early
        injected = _injected()
        assert injected[("duplicate", "REMOTE_CALL")] >= 1
        assert injected[("duplicate", "CALL")] >= 3


def test_delayed_frames_arrive_late_and_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    _faults(monkeypatch, delay={"CALL": 1.0}, delay_seconds=0.3)
    with world("faulty:loopback", size=2):
        started = time.monotonic()
        calls = [rpcx.rpc_async("worker1", remote.echo, args=(i,)) for i in range(3)]
        assert [c.wait() for c in calls] == [0, 1, 2]
        assert time.monotonic() - started >= 0.9  # three delays, one after another


def test_drops_across_processes_are_reproducible(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every worker reads $RPCX_FAULTS; with a seed, which frames go repeats run to run.
    _faults(monkeypatch, drop={"CALL": 0.5}, seed=7)
    outcomes = []
    for _ in range(2):
        with world("faulty:gloo", size=2, rpc_timeout=BOUND):
            results = []
            for i in range(12):
                try:
                    results.append(rpcx.rpc_sync("worker1", remote.echo, args=(i,),
                                                 timeout=0.3))
                except rpcx.RpcTimeoutError:
                    results.append(None)
            outcomes.append(results)
    assert outcomes[0] == outcomes[1]
    assert None in outcomes[0] and any(r is not None for r in outcomes[0])


def test_faults_are_injected_in_a_world_with_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    # The seals go under the injector: it reads each frame's kind before sealing, and
    # what it duplicates is sealed anew (refused as a replay, it would end the peer).
    monkeypatch.setenv("RPCX_AUTH_KEY", "faulty-test-key-0123456789abcdef")
    _faults(monkeypatch, drop={"CALL": 1.0}, duplicate={"REMOTE_CALL": 1.0})
    with world("faulty:loopback", size=2):
        assert rpcx.debug_info()["authenticated"] is True
        with pytest.raises(rpcx.RpcTimeoutError):
            rpcx.rpc_sync("worker1", remote.add, args=(1, 2), timeout=0.5)
        rref = rpcx.remote("worker1", remote.Counter, args=(5,))
        assert rref.to_here(timeout=BOUND).count == 5
        assert _injected() == {("drop", "CALL"): 1, ("duplicate", "REMOTE_CALL"): 1}
        assert rpcx.debug_info()["refused_frames"] == 0
        assert rpcx.debug_info()["lost_peers"] == {}


def test_lost_rref_bookkeeping_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # Half of every RRef bookkeeping message lost (the copies too): each is sent again
    # until answered, so values are neither freed early nor leaked.
    kinds = ("RREF_FETCH", "RREF_FORKS", "RREF_DELETE", "RREF_CONFIRM")
    _faults(monkeypatch, drop=dict.fromkeys(kinds, 0.5), seed=3)
    with world("faulty:gloo", size=3, rpc_timeout=BOUND):
        baseline = rpcx.rpc_sync("worker1", remote.tracked_live)
        held = rpcx.remote("worker1", remote.Tracked, args=("held",))
        for _ in range(6):  # forks announced to worker1, confirmed to worker2, deleted
            assert rpcx.rpc_sync("worker2", remote.rref_to_here, args=(held,)).get() == "held"
        assert held.to_here(timeout=BOUND).get() == "held"
        del held
        for name in ("worker0", "worker2", "worker1"):
            rpcx.rpc_sync(name, remote.rref_settle)
        assert rpcx.rpc_sync("worker1", remote.tracked_live) == baseline
        dropped = {kind for (fault, kind) in _injected() if fault == "drop"}
        assert {"RREF_FORKS", "RREF_DELETE"} <= dropped, dropped
        assert rpcx.debug_info()["resent_frames"] > 0


def test_duplicated_and_lost_gradients_count_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # One-way autograd messages (a chain of passes and its end) duplicated or lost: on a
    # lossy transport they are acknowledged requests, so each is handled exactly once.
    kinds = ("AUTOGRAD_CHAIN", "AUTOGRAD_CHAIN_END", "AUTOGRAD_BACKWARD", "AUTOGRAD_RUN")
    _faults(monkeypatch, duplicate=dict.fromkeys(kinds, 1.0), drop=dict.fromkeys(kinds, 0.3),
            seed=5)
    with world("faulty:gloo", size=3, rpc_timeout=BOUND):
        w = torch.tensor([1.0, 2.0], requires_grad=True)
        for _ in range(5):
            with dist_autograd.context() as context_id:
                y = rpcx.rpc_sync("worker1", training.square_then_call, args=(w, ["worker2"]))
                dist_autograd.backward(context_id, [y.sum()])
                grads = dist_autograd.get_gradients(context_id)
            assert torch.equal(grads[w], 4 * w.detach() ** 3), grads[w]  # d(w^4)/dw
        faults = {fault for fault, kind in _injected() if kind.startswith("AUTOGRAD_CHAIN")}
        assert faults == {"drop", "duplicate"}, _injected()


def test_copies_of_a_fetch_fork_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every RRef fetch sent twice: a copy is answered from the kept reply, never served
    # again (that would fork the RRefs inside the value for a reply dropped unread).
    _faults(monkeypatch, duplicate={"RREF_FETCH": 1.0}, drop={"RREF_FETCH": 0.3}, seed=2)
    with world("faulty:gloo", size=4, rpc_timeout=BOUND):
        baseline = rpcx.rpc_sync("worker2", remote.tracked_live)
        for _ in range(10):
            inner = rpcx.remote("worker2", remote.Tracked, args=("inner",))
            outer = rpcx.rpc_sync("worker3", remote.wrap_in_rref, args=(inner,))
            del inner
            assert remote.unwrap_twice(outer).get() == "inner"  # fetched from here
            del outer
        for name in ("worker0", "worker1", "worker3", "worker2"):
            rpcx.rpc_sync(name, remote.rref_settle)
        owner = rpcx.rpc_sync("worker2", remote.rref_settle)
        assert owner["owned"] == 0 and owner["references_to_owned"] == 0, owner
        assert rpcx.rpc_sync("worker2", remote.tracked_live) == baseline
        assert _injected()[("duplicate", "RREF_FETCH")] >= 10


# Worker1's generator with this seed never draws more than 5 drops at 40% in a row (in
# its first 1,000 rolls): a fetch sees at least 9 answers within FETCH_TIMEOUT, so with
# the kept reply sent again each fetch completes, however the rolls fall between them.
REPLY_LOSS_SEED = 23
FETCH_TIMEOUT = 5.0


def test_lost_replies_to_fetches_are_answered_again_from_the_kept_reply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 40% of the answers to RRef fetches lost, and of their copies sent again: the fetch
    # is sent again, and the owner, which already served it, sends the reply it kept
    # (serving again would fork the RRefs inside the value). Without that answer a fetch
    # whose reply was lost waits out its timeout.
    _faults(monkeypatch, drop={"reply:RREF_FETCH": 0.4}, seed=REPLY_LOSS_SEED)
    with world("faulty:loopback", size=2, rpc_timeout=BOUND):
        for i in range(20):
            rref = rpcx.remote("worker1", remote.echo, args=(i,))  # its RESULT: not lost
            assert rref.to_here(timeout=FETCH_TIMEOUT) == i
        # Only the fetches' replies were hit (at worker1, the owner), several times.
        hit = rpcx.rpc_sync("worker1", _injected)
        assert list(hit) == [("drop", "reply:RREF_FETCH")], hit
        assert hit[("drop", "reply:RREF_FETCH")] >= 3, hit
        assert _injected() == {}
        assert rpcx.debug_info()["resent_frames"] > 0


CALL_TIMEOUT = 1.0


def test_a_duplicated_call_to_a_stopped_worker_fails_within_its_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The duplicate of a call is sent after the original, with the call's deadline: gloo's
    # send gives up waiting for a peer that reads nothing at that deadline, for the copy
    # too. A copy without it waited for worker1 to read again, holding the caller.
    _faults(monkeypatch, duplicate={"CALL": 1.0})
    with world("faulty:gloo", size=2, rpc_timeout=BOUND):
        pid = rpcx.rpc_sync("worker1", remote.process_id)
        big = torch.ones(8 << 20)  # 32 MiB: far more than the kernel takes unread
        agent = _context.current_agent()
        outcome: list[BaseException | None] = []

        def call() -> None:  # on a thread of its own: a send that hangs cannot hang the test
            _context.bind_agent(agent)
            try:
                rpcx.rpc_sync("worker1", remote.tensor_sum, args=(big,), timeout=CALL_TIMEOUT)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        caller = threading.Thread(target=call)
        with stopped(pid):
            started = time.monotonic()
            caller.start()
            caller.join(CALL_TIMEOUT + 2.0)
            took = time.monotonic() - started
        caller.join(BOUND)
        assert took < CALL_TIMEOUT + 1.0, took
        assert len(outcome) == 1 and isinstance(outcome[0], rpcx.RpcTimeoutError), outcome
        assert _injected()[("duplicate", "CALL")] >= 2
        # Both copies arrive late, once worker1 runs again; calls to it work.
        assert rpcx.rpc_sync("worker1", remote.add, args=(1, 2), timeout=BOUND) == 3
