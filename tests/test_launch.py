"""rpcx.launch: the same program under rpcx.spawn and under torchrun."""

from __future__ import annotations

import logging
import os
import pathlib
import socket

import pytest

import rpcx
from rpcx.testing.world import free_port


def _world(worker: rpcx.LaunchedWorker, backend: str, token: str) -> tuple[int, int, str, str]:
    """Join the world through the worker's rendezvous, call the next worker, leave."""
    rpcx.init_rpc(f"w{worker.rank}", rank=worker.rank, world_size=worker.world_size,
                  backend=backend, rpc_backend_options=rpcx.TensorPipeRpcBackendOptions(
                      init_method=worker.init_method(), rpc_timeout=60))
    peer = f"w{(worker.rank + 1) % worker.world_size}"
    answer = rpcx.rpc_sync(peer, str.upper, args=(token,))
    rpcx.shutdown()
    return worker.rank, worker.world_size, answer, worker.init_method("ddp")


def test_spawned_workers_meet_and_rank_0s_result_comes_back(rpcx_backend: str) -> None:
    rank, world_size, answer, other = rpcx.launch(
        _world, args=(rpcx_backend, "hello"), nprocs=3, backend=rpcx_backend
    )
    assert (rank, world_size, answer) == (0, 3, "HELLO")
    assert other.startswith("file://") and other.endswith("ddp")  # one file per rendezvous


def _here(worker: rpcx.LaunchedWorker, pid: int) -> tuple[rpcx.LaunchedWorker, bool]:
    return worker, os.getpid() == pid



@pytest.fixture
def as_if_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process, as torchrun's rank 1 of 2 would see its environment."""
    for var, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(var, value)


@pytest.mark.usefixtures("as_if_torchrun")
def test_under_torchrun_this_process_is_the_worker() -> None:
    assert rpcx.under_torchrun()
    worker, in_this_process = rpcx.launch(_here, args=(os.getpid(),), nprocs=2)
    assert in_this_process
    assert worker == rpcx.LaunchedWorker(rank=1, world_size=2, rendezvous=None)
    assert worker.init_method() == worker.init_method("ddp") == "env://"
    worker, _ = rpcx.launch(_here, args=(os.getpid(),))  # nprocs may be left out
    assert worker.world_size == 2


@pytest.mark.usefixtures("as_if_torchrun")
def test_under_torchrun_a_different_world_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"runs 4 workers, but torchrun started 2.*"
                                         r"--nproc-per-node 4"):
        rpcx.launch(_here, args=(0,), nprocs=4)


def test_outside_torchrun_nprocs_is_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert not rpcx.under_torchrun()
    with pytest.raises(ValueError, match="nprocs >= 1"):
        rpcx.launch(_here, args=(0,))


def _meet(rank: int, answers: str) -> None:
    """Join a world of two through env:// (spawn's), call the other worker, leave."""
    rpcx.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=rpcx.RpcBackendOptions(
        init_method="env://", rpc_timeout=60))
    answer = rpcx.rpc_sync(f"w{1 - rank}", str.upper, args=(f"from {rank}",))
    rpcx.shutdown()
    with open(os.path.join(answers, f"{rank}.txt"), "w") as out:
        out.write(answer)


def test_spawn_under_a_launcher_says_so_and_its_world_meets_nobody_else(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: pathlib.Path,
) -> None:
    # This process as torchrun's rank 0 of 2, its store taken by something that is not
    # rpcx's (torchrun's agent): the spawned world must get a store of its own.
    with socket.socket() as launchers_store:
        launchers_store.bind(("127.0.0.1", 0))
        launchers_store.listen()
        for var, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                           "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(launchers_store.getsockname()[1])}.items():
            monkeypatch.setenv(var, value)
        with caplog.at_level(logging.WARNING, logger="rpcx"):
            rpcx.spawn(_meet, args=(str(tmp_path),), nprocs=2, backend="tcp")
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("a launcher started" in m and "2 separate worlds" in m for m in said), said
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["FROM 0", "FROM 1"]
