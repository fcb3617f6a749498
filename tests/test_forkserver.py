"""Workers forked from a server that imported torch (rpcx._util.forkserver) behave as spawned
ones: the starter's environment and output at the time it starts them, their own random
numbers, exit handlers run; rpcx.spawn starts its workers that way unless told not to."""

from __future__ import annotations

import atexit
import os
import pathlib
import sys
from typing import Any

import pytest
import torch

import rpcx
from rpcx.testing import processes
from rpcx.testing.processes import START_METHOD_ENV, worker_context

BOUND = 60.0

pytestmark = pytest.mark.skipif(processes.start_method() != "forkserver",
                                reason="forkserver is not this run's start method")


def _report(answers: Any) -> None:
    answers.put({"pid": os.getpid(), "parent": os.getppid(),
                 "variable": os.environ.get("RPCX_TEST_FORKSERVER_VARIABLE"),
                 "draw": torch.randint(2**62, (1,)).item()})


def _say(words: str) -> None:
    print(f"{words} on stdout", flush=True)
    print(f"{words} on stderr", file=sys.stderr, flush=True)


def _exit_with_a_handler(path: str) -> None:
    atexit.register(pathlib.Path(path).write_text, "the handler ran")


def _run(target: Any, *args: Any) -> int:
    process = worker_context().Process(target=target, args=args, daemon=True)
    process.start()
    process.join(BOUND)
    assert not process.is_alive(), f"the worker did not end within {BOUND:g} s"
    return int(process.exitcode)


def test_a_worker_takes_the_environment_its_starter_has_when_it_starts_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    answers = worker_context().Queue()
    monkeypatch.delenv("RPCX_TEST_FORKSERVER_VARIABLE", raising=False)
    assert _run(_report, answers) == 0  # (the server is running from here on)
    first = answers.get(timeout=BOUND)
    monkeypatch.setenv("RPCX_TEST_FORKSERVER_VARIABLE", "set after the server started")
    assert _run(_report, answers) == 0
    second = answers.get(timeout=BOUND)
    assert first["variable"] is None
    assert second["variable"] == "set after the server started"
    # Forked from the server, not this process.
    assert first["parent"] == second["parent"] != os.getpid()
    assert first["draw"] != second["draw"], "two workers drew the same random number"


def test_a_worker_writes_where_its_starter_writes_now(
        capfd: pytest.CaptureFixture[str]) -> None:
    assert _run(_say, "a forked worker") == 0
    out, err = capfd.readouterr()
    assert "a forked worker on stdout" in out
    assert "a forked worker on stderr" in err


def test_a_worker_runs_its_exit_handlers(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "exit"
    assert _run(_exit_with_a_handler, str(marker)) == 0
    assert marker.read_text() == "the handler ran"


def test_an_unknown_start_method_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_METHOD_ENV, "teleport")
    with pytest.raises(ValueError, match=r"\$RPCX_TEST_START_METHOD='teleport'"):
        processes.start_method()


def _spawned(rank: int, out: str) -> None:
    pathlib.Path(out, str(rank)).write_text(
        f"{os.getppid()} {os.environ.get('RPCX_TEST_FORKSERVER_VARIABLE')} "
        f"{torch.randint(2**62, (1,)).item()}")


@pytest.mark.parametrize("start_method", [None, "spawn"])
def test_rpcx_spawn_forks_its_workers_from_the_server_by_default(
        start_method: str | None, tmp_path: pathlib.Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RPCX_TEST_FORKSERVER_VARIABLE", "the-starter-s")
    rpcx.spawn(_spawned, args=(str(tmp_path),), nprocs=2, backend="auto",
               start_method=start_method)
    reports = [(tmp_path / str(rank)).read_text().split() for rank in range(2)]
    parents = {report[0] for report in reports}
    assert [report[1] for report in reports] == ["the-starter-s"] * 2
    assert reports[0][2] != reports[1][2], "two workers drew the same random number"
    if start_method is None:  # the fork server's children
        assert len(parents) == 1 and str(os.getpid()) not in parents
    else:
        assert parents == {str(os.getpid())}
