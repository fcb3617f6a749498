"""Conformance: a dynamic world (``init_rpc`` without ``world_size``), as torch has it.

Workers join a running world one at a time, in any rank order, and leave with
``shutdown()``. What must hold: calls, RRefs and distributed autograd between old and new
workers both ways; ``get_worker_infos`` follows who is in; a worker that left is
unknown by name, calls to it fail naming it, and its rank can be taken again; a name or
rank in use, and a static worker joining a dynamic world, are refused with the reason.
A backend that cannot admit workers after start (its capabilities lack ``dynamic``)
refuses a dynamic world at once, naming the backends that can.

This process is rank 0 (it hosts the store); the others are processes it starts.
"""

from __future__ import annotations

import queue
import uuid
from collections.abc import Iterator
from typing import cast

import pytest
import torch

import rpcx
import rpcx.autograd as dist_autograd
from rpcx._core import context as _context
from rpcx._core.agent import RpcAgent
from rpcx.errors import PeerLostError, RpcError, UnknownWorkerError
from rpcx.registry import resolve_backend
from rpcx.testing import remote, training
from rpcx.testing.fixtures import WorldKeeper
from rpcx.testing.soak import leftover_problems, settled_leftovers
from rpcx.testing.world import DynamicWorld, _options, dynamic_world, free_port

__all__ = ["TestDynamicDeviceMaps", "TestDynamicWorld", "TestDynamicWorldRefused"]

BOUND = 60.0


@pytest.mark.rpcx_requires(
    "dynamic", reason="it cannot admit workers after the world started")
class TestDynamicWorld:
    """Workers join and leave a world that runs."""

    @pytest.fixture
    def grown(self, rpcx_backend: str, rpc_world_keeper: WorldKeeper
              ) -> Iterator[DynamicWorld]:
        """A dynamic world of this process (``lead``, rank 0) and, joined in that order,
        ``late2`` at rank 2 and ``late1`` at rank 1."""
        rpc_world_keeper.close()  # (one worker per process: the shared world goes first)
        with dynamic_world(rpcx_backend, name="lead", rpc_timeout=BOUND) as world:
            assert [w.name for w in rpcx.get_worker_infos()] == ["lead"]
            assert world.join("late2", 2) == ("joined", "late2")
            assert world.join("late1", 1) == ("joined", "late1")
            yield world

    def test_calls_rrefs_and_autograd_between_old_and_new_workers(
            self, grown: DynamicWorld) -> None:
        assert rpcx.get_worker_infos() == [
            rpcx.WorkerInfo("lead", 0), rpcx.WorkerInfo("late1", 1),
            rpcx.WorkerInfo("late2", 2)]
        assert rpcx.get_worker_info("late1").id == 1
        # the old worker calls the new ones, they call it and each other
        assert rpcx.rpc_sync("late2", remote.add, args=(torch.ones(2), 1)).tolist() == [2, 2]
        assert rpcx.rpc_sync("late1", remote.worker_name) == "late1"
        assert rpcx.rpc_sync("late2", remote.call_with,
                             args=(rpcx.get_worker_infos,)) == rpcx.get_worker_infos()
        route = remote.chain(["late1", "late2", "lead"], 0)  # nested: each waits on the next
        assert route == (3, ["lead", "late1", "late2", "lead"])
        # an RRef owned by one newcomer, used by the other
        counter = rpcx.remote("late2", remote.Counter, args=(5,))
        assert rpcx.rpc_sync("late1", remote.rref_increment, args=(counter, 2)) == 7
        key = uuid.uuid4().hex
        rpcx.rpc_sync("late1", remote.hold, args=(key, counter))
        assert rpcx.rpc_sync("late1", remote.held_to_here, args=(key,)).count == 7
        rpcx.rpc_sync("late1", remote.drop, args=(key,))
        # distributed autograd through both newcomers
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        with dist_autograd.context() as ctx:
            y = rpcx.rpc_sync("late1", training.square_then_call, args=(x, ["late2"]))
            dist_autograd.backward(ctx, [y.sum()])
            grads = dist_autograd.get_gradients(ctx)
        assert torch.equal(grads[x], 4 * x.detach() ** 3)  # d/dx x**4

    def test_a_worker_leaves_and_another_joins(self, grown: DynamicWorld) -> None:
        agent = cast(RpcAgent, _context.current_agent())
        grown.leave("late1")
        assert agent.wait_lost(1, BOUND), "late1's departure never reached lead"
        assert [w.name for w in rpcx.get_worker_infos()] == ["lead", "late2"]
        with pytest.raises(UnknownWorkerError, match="late1"):
            rpcx.get_worker_info("late1")
        with pytest.raises((UnknownWorkerError, PeerLostError), match="late1"):
            rpcx.rpc_sync(rpcx.WorkerInfo("late1", 1), remote.add, args=(1, 1))
        # the others carry on, and see it gone too
        assert rpcx.rpc_sync("late2", remote.call_with, args=(rpcx.get_worker_infos,)) == [
            rpcx.WorkerInfo("lead", 0), rpcx.WorkerInfo("late2", 2)]
        # a new worker joins at a new rank, and everybody reaches it
        assert grown.join("late3", 3) == ("joined", "late3")
        assert rpcx.rpc_sync("late3", remote.worker_name) == "late3"
        assert rpcx.rpc_sync("late2", remote.call_with,
                             args=(remote.chain, ["late3"], 0)) == (1, ["late2", "late3"])

    def test_a_killed_worker_is_struck_off_and_every_change_is_told(
            self, grown: DynamicWorld, rpcx_backend: str) -> None:
        # kill -9 leaves no goodbye and no word in the store: the world must go on
        # without it, newcomers must not try to reach it, and its rank must free up.
        agent = cast(RpcAgent, _context.current_agent())
        changes: queue.Queue[rpcx.MembershipChange] = queue.Queue()
        stop_watching = rpcx.on_membership_change(changes.put)

        def told() -> tuple[str, str, list[str]]:
            change = changes.get(timeout=BOUND)
            return change.kind, change.worker.name, [w.name for w in change.members]

        grown.kill("late1")
        assert agent.wait_lost(1, BOUND), "late1's death never reached lead"
        assert told() == ("lost", "late1", ["lead", "late2"])
        with pytest.raises(UnknownWorkerError,
                           match=r"'late1': worker 'late1' \(rank 1\) is unreachable"):
            rpcx.rpc_sync("late1", remote.add, args=(1, 1))
        with pytest.raises(UnknownWorkerError,  # (an RRef's owner() is a WorkerInfo)
                           match=r"'late1': worker 'late1' \(rank 1\) is unreachable"):
            rpcx.rpc_sync(rpcx.WorkerInfo("late1", 1), remote.add, args=(1, 1))
        assert grown.join("late3", 3) == ("joined", "late3")
        assert told() == ("joined", "late3", ["lead", "late2", "late3"])
        if resolve_backend(rpcx_backend).capabilities.reuses_ranks:
            assert grown.join("again1", 1) == ("joined", "again1")
            assert told() == ("joined", "again1", ["lead", "again1", "late2", "late3"])
            assert rpcx.rpc_sync("late2", remote.call_with,
                                 args=(remote.chain, ["again1"], 0)) == (1, ["late2", "again1"])
        grown.leave("late3")
        assert told()[:2] == ("left", "late3")
        stop_watching()
        assert rpcx.rpc_sync("late2", remote.add, args=(2, 2)) == 4
        assert changes.empty()

    def test_what_a_killed_worker_was_being_sent_is_freed_whoever_takes_its_rank(
            self, grown: DynamicWorld, rpcx_backend: str) -> None:
        # late1 asks late2 for two RRefs and dies before either answer is sent: one
        # answer is encoded once late2 has seen it die, the other once "again1" has
        # taken its rank. Neither may leave late2 holding a reference for a worker that
        # will never delete it (the churn's "owned rrefs left").
        if not resolve_backend(rpcx_backend).capabilities.reuses_ranks:
            pytest.skip(f"backend {rpcx_backend!r} does not let a rank be taken again")
        agent = cast(RpcAgent, _context.current_agent())
        before, after = uuid.uuid4().hex, uuid.uuid4().hex
        for key in (before, after):
            rpcx.rpc_sync("late1", remote.fire, args=("late2", remote.answer_later, key))
        grown.kill("late1")
        assert agent.wait_lost(1, BOUND), "late1's death never reached lead"
        assert rpcx.rpc_sync("late2", remote.wait_lost, args=(1, BOUND)), \
            "late1's death never reached late2"
        rpcx.rpc_sync("late2", remote.answer_with_rref, args=(before,))
        assert grown.join("again1", 1) == ("joined", "again1")
        assert rpcx.rpc_sync("late2", remote.call_with,  # (late2 meets again1)
                             args=(remote.chain, ["again1"], 0)) == (1, ["late2", "again1"])
        rpcx.rpc_sync("late2", remote.answer_with_rref, args=(after,))
        left = settled_leftovers("lead", ["late2", "again1"], BOUND)
        assert not leftover_problems(left), left

    def test_a_rank_left_is_taken_again_or_refused_as_declared(
            self, grown: DynamicWorld, rpcx_backend: str) -> None:
        agent = cast(RpcAgent, _context.current_agent())
        grown.leave("late1")
        assert agent.wait_lost(1, BOUND), "late1's departure never reached lead"
        outcome = grown.join("again1", 1)
        if not resolve_backend(rpcx_backend).capabilities.reuses_ranks:
            assert outcome[:2] == ("refused", "RpcError")
            assert "cannot take rank 1" in outcome[2] and "held it before" in outcome[2]
            return
        assert outcome == ("joined", "again1")
        assert rpcx.rpc_sync("again1", remote.worker_name) == "again1"
        assert rpcx.rpc_sync("late2", remote.call_with,
                             args=(remote.chain, ["again1"], 0)) == (1, ["late2", "again1"])

    def test_a_taken_name_or_rank_and_a_static_worker_are_refused(
            self, grown: DynamicWorld) -> None:
        outcome = grown.join("late1", 3)
        assert outcome[0] == "refused" and "'late1'" in outcome[2] and "taken" in outcome[2]
        outcome = grown.join("other", 2)
        assert outcome[0] == "refused" and "rank 2" in outcome[2] and "late2" in outcome[2]
        outcome = grown.join("static", 3, world_size=4)
        assert outcome[:2] == ("refused", "RuntimeError")
        assert "mixes statically and dynamically initialized members" in outcome[2]
        # the world is as it was
        assert [w.name for w in rpcx.get_worker_infos()] == ["lead", "late1", "late2"]
        assert rpcx.rpc_sync("late2", remote.worker_name) == "late2"


@pytest.mark.rpcx_requires(
    "dynamic", reason="it cannot admit workers after the world started")
class TestDynamicDeviceMaps:
    """Device maps in a dynamic world: checked as each worker joins, routed both ways."""

    def test_maps_are_checked_and_routed_as_workers_join(
            self, rpcx_backend: str, rpc_world_keeper: WorldKeeper) -> None:
        rpc_world_keeper.close()
        cpu = {torch.device("cpu"): torch.device("cpu")}
        if resolve_backend(rpcx_backend).capabilities.cuda_direct:
            options = _options(rpcx_backend, f"tcp://127.0.0.1:{free_port()}",
                               {"device_maps": {"late1": {"cpu": "cpu"}}})
            with pytest.raises(RpcError, match="device maps in a dynamic world are not "
                                               f"supported on the {rpcx_backend!r} backend"):
                rpcx.init_rpc("lead", backend=rpcx_backend, rank=0,
                              rpc_backend_options=options)
            return
        with dynamic_world(rpcx_backend, name="lead", rpc_timeout=BOUND,
                           device_maps={"late1": {"cpu": "cpu"}}) as world:
            agent = cast(RpcAgent, _context.current_agent())
            assert agent.routes.for_request(1) is None  # (late1 is not there yet)
            assert world.join("late1", 1, device_maps={"lead": {"cpu": "cpu"}}) == (
                "joined", "late1")
            assert agent.routes.for_request(1) == cpu  # lead's map, held for late1
            assert agent.routes.for_response(1) == cpu  # late1's map to lead, inverted
            assert agent.routes.names[1] == "late1"
            # a map to a device its peer lacks (whatever GPUs this machine has) is refused
            past = f"cuda:{torch.cuda.device_count()}"
            outcome = world.join("late2", 2, device_maps={"lead": {"cpu": "cpu",
                                                                   "cuda:0": past}})
            assert outcome[:2] == ("refused", "RpcError"), outcome
            assert "invalid device maps" in outcome[2] and "CUDA device" in outcome[2]
            assert rpcx.rpc_sync("late1", remote.add, args=(torch.ones(2), 1)).tolist() == [
                2, 2]


class TestDynamicWorldRefused:
    """What a dynamic world refuses before anything starts."""

    def test_a_backend_that_cannot_admit_workers_refuses_at_once(
            self, rpcx_backend: str, rpc_world_keeper: WorldKeeper) -> None:
        if resolve_backend(rpcx_backend).capabilities.dynamic:
            pytest.skip(f"backend {rpcx_backend!r} admits workers after start")
        rpc_world_keeper.close()
        options = _options(rpcx_backend, f"tcp://127.0.0.1:{free_port()}", {})
        with pytest.raises(RpcError, match="cannot admit workers after the world started"):
            rpcx.init_rpc("alone", backend=rpcx_backend, rank=0, rpc_backend_options=options)

    def test_a_dynamic_worker_needs_its_rank(
            self, rpcx_backend: str, rpc_world_keeper: WorldKeeper) -> None:
        rpc_world_keeper.close()
        options = _options(rpcx_backend, f"tcp://127.0.0.1:{free_port()}", {})
        with pytest.raises(ValueError, match="rank parameter missing"):
            rpcx.init_rpc("alone", backend=rpcx_backend, rpc_backend_options=options)
