"""Rank 0 leaves a dynamic world whose store is hosted outside it (torchrun's agent
store: ``TORCHELASTIC_USE_AGENT_STORE=True``, as torchrun sets it), and the world goes
on: the others keep calling each other, a new worker joins, and another takes rank 0."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore

from rpcx.testing.processes import worker_context

BOUND = 60.0


def _worker(name: str, rank: int, port: int, answers: Any, orders: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    os.environ.pop("WORLD_SIZE", None)  # a dynamic world
    import rpcx
    from rpcx.testing import remote

    rpcx.init_rpc(name, rank=rank, rpc_backend_options=rpcx.TensorPipeRpcBackendOptions(
        init_method="env://", rpc_timeout=BOUND))
    answers.put((name, "joined", [w.name for w in rpcx.get_worker_infos()]))
    while True:
        order = orders.get(timeout=4 * BOUND)
        if order == "leave":
            rpcx.shutdown()
            answers.put((name, "left"))
            return
        answers.put((name, "called", {w.name: rpcx.rpc_sync(w.name, remote.worker_name)
                                      for w in rpcx.get_worker_infos()}))


@pytest.mark.timeout(300)
def test_rank_0_leaves_a_world_whose_store_it_does_not_host() -> None:
    # (port 0: the OS picks it as the store binds; a port found free first can be taken
    # by another test before the store listens, EADDRINUSE in CI)
    store = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=BOUND),
                     wait_for_workers=False)  # torchrun's agent, in the test's place
    port = store.port
    context = worker_context()
    answers = context.Queue()
    orders: dict[str, Any] = {}
    processes = []

    def start(name: str, rank: int) -> tuple[Any, ...]:
        orders[name] = context.Queue()
        processes.append(context.Process(target=_worker, daemon=True,
                                         args=(name, rank, port, answers, orders[name])))
        processes[-1].start()
        answer: tuple[Any, ...] = answers.get(timeout=BOUND * 2)
        return answer

    def order(name: str, what: str) -> tuple[Any, ...]:
        orders[name].put(what)
        answer: tuple[Any, ...] = answers.get(timeout=BOUND)
        return answer

    try:
        assert start("first", 0) == ("first", "joined", ["first"])
        assert start("b", 1) == ("b", "joined", ["first", "b"])
        assert start("c", 2) == ("c", "joined", ["first", "b", "c"])
        assert order("first", "leave") == ("first", "left")
        assert order("b", "call") == ("b", "called", {"b": "b", "c": "c"})
        assert start("d", 3) == ("d", "joined", ["b", "c", "d"])
        assert start("new0", 0) == ("new0", "joined", ["new0", "b", "c", "d"])
        assert order("c", "call") == ("c", "called", {n: n for n in ("new0", "b", "c", "d")})
        for name in ("b", "new0", "c", "d"):
            assert order(name, "leave") == (name, "left")
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
        del store
