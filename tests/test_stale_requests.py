"""A request of a worker that died is not served once another worker has taken its rank
(rpcx._core.call_path): a ``remote()`` still queued here when its sender was killed would
register the dead creator's reference under the new worker's rank, and the value would
stay here for good (the churn's "owned rrefs left")."""

from __future__ import annotations

import threading
from typing import Any, cast

import pytest

import rpcx
from rpcx._core import context as _context
from rpcx._core.agent import RpcAgent
from rpcx.messages import MessageKind
from rpcx.testing import remote
from rpcx.testing.soak import leftover_problems, settled_leftovers
from rpcx.testing.world import dynamic_world

BOUND = 60.0


@pytest.mark.timeout(180)
def test_a_queued_remote_call_of_a_worker_whose_rank_was_taken_is_not_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with dynamic_world("auto", name="lead", rpc_timeout=BOUND) as world:
        agent = cast(RpcAgent, _context.current_agent())
        calls = agent._calls
        serve = calls.serve
        parked: list[tuple[Any, ...]] = []
        arrived = threading.Event()

        def park_remote_calls_of_rank_1(*args: Any) -> None:
            src, kind = args[0], args[1]
            if src == 1 and kind == MessageKind.REMOTE_CALL:
                parked.append(args)  # queued here, not run yet
                arrived.set()
                return
            serve(*args)

        monkeypatch.setattr(calls, "serve", park_remote_calls_of_rank_1)
        assert world.join("late1", 1) == ("joined", "late1")
        rpcx.rpc_sync("late1", remote.fire_remote, args=("lead", remote.Counter, 5))
        assert arrived.wait(BOUND), "late1's remote() never reached lead"
        world.kill("late1")
        assert agent.wait_lost(1, BOUND), "late1's death never reached lead"
        assert world.join("again1", 1) == ("joined", "again1")
        assert rpcx.rpc_sync("again1", remote.worker_name) == "again1"  # (lead met it)
        monkeypatch.setattr(calls, "serve", serve)
        for args in parked:
            serve(*args)  # late1's remote(), served after again1 took its rank
        left = settled_leftovers("lead", ["again1"], BOUND)
        assert not leftover_problems(left), left
