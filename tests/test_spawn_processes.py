"""rpcx.spawn with a multi-process backend sets torch's threads per worker as torchrun does."""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

import rpcx


def _report_threads(rank: int, out: str) -> None:
    pathlib.Path(out, str(rank)).write_text(
        f"{torch.get_num_threads()} {os.environ.get('OMP_NUM_THREADS')}"
    )


def _spawned_threads(tmp_path: pathlib.Path, nprocs: int) -> set[str]:
    rpcx.spawn(_report_threads, args=(str(tmp_path),), nprocs=nprocs, backend="gloo")
    return {path.read_text() for path in tmp_path.iterdir()}


def test_several_workers_get_one_intra_op_thread_each(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _spawned_threads(tmp_path, 2) == {"1 1"}


def test_omp_num_threads_when_set_wins(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert _spawned_threads(tmp_path, 2) == {"2 2"}


def _meet_through_env(rank: int, out: str) -> None:
    # The default init_method, env://, with nothing set by the program.
    rpcx.init_rpc(f"w{rank}", rank=rank, world_size=2, backend="gloo")
    peer = rpcx.rpc_sync(f"w{1 - rank}", os.getpid)
    rpcx.shutdown()
    pathlib.Path(out, str(rank)).write_text(
        f"{os.environ['MASTER_ADDR']} {peer != os.getpid()}")


def test_workers_meet_on_this_host_without_master_addr(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As torchrun --standalone: 127.0.0.1 and a free port, where the parent set none.
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    rpcx.spawn(_meet_through_env, args=(str(tmp_path),), nprocs=2, backend="gloo")
    assert {path.read_text() for path in tmp_path.iterdir()} == {"127.0.0.1 True"}
