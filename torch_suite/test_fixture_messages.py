"""The fixture's error regexes match the errors rpcx really raises, and nothing else.

torch's suites assert ``assertRaisesRegex(RuntimeError, fixture.get_timeout_error_regex())``
and the like; if rpcx's wording changed, those tests would fail for the wrong reason, and a
regex loose enough to match anything would let them pass for the wrong reason. These run
on loopback, in a fresh process of their own.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
import time

import pytest
import torch

import rpcx
from torch_suite.fixture import SHUTDOWN_ERRORS, TIMEOUT_ERROR

WAIT = 30.0  # bound on every wait below; the world itself takes well under a second


def _collect(out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """In a fresh process (the pytest process must stay thread-free to fork workers)."""
    caught: dict[str, tuple[str, str]] = {}
    timed_out, w1_gone, finished = threading.Event(), threading.Event(), threading.Event()

    def record(key: str, exc: BaseException) -> None:
        caught[key] = (type(exc).__name__, str(exc))

    def run(rank: int, world_size: int) -> None:
        rpcx.init_rpc(f"w{rank}", rank=rank, world_size=world_size)
        if rank == 1:  # leaves once w0's call to w2 has timed out
            assert timed_out.wait(WAIT)
            rpcx.shutdown(graceful=False)
            w1_gone.set()
            return
        if rank == 2:  # serves w0's slow call, and stays until w0 is done
            assert finished.wait(WAIT)
            rpcx.shutdown(graceful=False)
            return
        try:
            try:
                rpcx.rpc_sync("w2", time.sleep, args=(0.5,), timeout=0.05)
            except rpcx.RpcError as exc:
                record("timeout", exc)
            timed_out.set()
            assert w1_gone.wait(WAIT)
            try:
                rpcx.rpc_sync("w1", torch.add, args=(torch.ones(1), 1))
            except rpcx.RpcError as exc:
                record("peer", exc)
            rpcx.shutdown(graceful=False)
            try:
                rpcx.rpc_sync("w2", torch.add, args=(torch.ones(1), 1))
            except rpcx.RpcError as exc:
                record("local", exc)
        finally:
            timed_out.set()
            finished.set()

    rpcx.spawn(run, args=(3,), nprocs=3, backend="loopback")
    out.put(caught)


@pytest.fixture(scope="module")
def errors() -> dict[str, tuple[str, str]]:
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=_collect, args=(out,))
    process.start()
    try:
        caught: dict[str, tuple[str, str]] = out.get(timeout=120)
    finally:
        process.join(WAIT)
        if process.is_alive():
            process.kill()
    assert set(caught) == {"timeout", "peer", "local"}, caught
    return caught


def test_timeout_regex_matches_rpcx_timeouts_only(errors: dict[str, tuple[str, str]]) -> None:
    assert errors["timeout"][0] == "RpcTimeoutError"
    assert re.search(TIMEOUT_ERROR, errors["timeout"][1])
    assert not re.search(TIMEOUT_ERROR, errors["peer"][1])
    assert not re.search(TIMEOUT_ERROR, "RPC ran for more than 50 milliseconds")


def test_shutdown_regex_matches_dead_peers_and_local_shutdown(
    errors: dict[str, tuple[str, str]],
) -> None:
    shutdown = "|".join(f"({regex})" for regex in SHUTDOWN_ERRORS)
    assert errors["peer"][0] == "PeerLostError"
    assert re.search(shutdown, errors["peer"][1])
    assert errors["local"][0] == "RpcShutdownError"
    assert re.search(shutdown, errors["local"][1])
    assert not re.search(shutdown, errors["timeout"][1])
    assert not re.search(shutdown, "ValueError: Expected error")
