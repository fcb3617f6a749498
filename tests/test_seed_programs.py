"""The programs users start from (../shared/seeds) run on rpcx with only their imports changed.

Each program lives in ``tests/seed_programs/`` as torch wrote it, on torch's RPC. A test
rewrites its ``torch.distributed.rpc`` imports to ``rpcx`` and nothing else in the
program (the fixed port it rendezvous on is replaced by one from the OS, so that tests
can run side by side), runs it on the session's backend and checks what it prints.

The RL tutorial needs numpy and gym: numpy is the program's own dependency (the
tensorpipe session runs this module again after reinstalling it), and gym is the
stand-in ``tests/seed_programs/gym`` with gym's old API, which the program was written
for, over the RL example's CartPole.
"""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

from rpcx.registry import resolve_backend

pytest.importorskip("numpy", reason="the seed programs import numpy themselves")

SEEDS = pathlib.Path(__file__).resolve().parent / "seed_programs"
# The gym stand-in's CartPole is the RL example's.
CARTPOLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "rl"
RUN_TIMEOUT = 300.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _on_rpcx(source: str) -> str:
    """``source`` with its torch RPC imports pointed at rpcx: the only change."""
    changed = source.replace("import torch.distributed.rpc as rpc", "import rpcx as rpc")
    changed = changed.replace("from torch.distributed.rpc import", "from rpcx import")
    assert changed != source and "torch.distributed.rpc" not in changed
    return changed


def _run(source: str, tmp_path: pathlib.Path, backend: str | None, *args: str,
         env: dict[str, str] | None = None) -> str:
    script = tmp_path / "main.py"
    script.write_text(source.replace("'29500'", f"'{_free_port()}'"))
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(SEEDS), str(CARTPOLE), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    full_env.pop("RPCX_BACKEND", None)
    if backend is not None:
        full_env["RPCX_BACKEND"] = backend
    out = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True,
        timeout=RUN_TIMEOUT, env=full_env, cwd=tmp_path,
    )
    assert out.returncode == 0, f"the program failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _multi_process(backend: str) -> None:
    caps = resolve_backend(backend).capabilities
    if caps.in_process or not caps.multi_process:
        pytest.skip("the program starts its workers as processes (mp.spawn)")


# The RL tutorial: an agent and observers; the observers call the agent through RRef
# proxies, and the agent starts episodes by sending a proxy's method as the function
# of rpc_async. Its policy is not seeded, so the check is that it learns: the reward
# threshold is lowered (the gym stand-in reads it) so that a run takes seconds.
RL = "rpc_tutorial_rl.py"
RL_ENV = {"RPCX_SEED_REWARD_THRESHOLD": "12"}


def _check_rl(out: str, observers: int) -> None:
    assert "This will run until reward threshold of 12.0 is reached" in out, out
    solved = re.search(r"Solved! Running reward is now (\S+)!", out)
    assert solved and float(solved.group(1)) > 12.0, out
    assert re.search(r"Episode \d+\tLast reward: \d+\.\d\d\tAverage reward: ", out), out
    assert observers >= 1


@pytest.mark.parametrize("world_size", [2, 3])
def test_rl_tutorial_runs_on_rpcx(
    rpcx_backend: str, tmp_path: pathlib.Path, world_size: int
) -> None:
    _multi_process(rpcx_backend)
    source = _on_rpcx((SEEDS / RL).read_text())
    out = _run(source, tmp_path, rpcx_backend, "--world_size", str(world_size),
               "--log_interval", "1", env=RL_ENV)
    _check_rl(out, world_size - 1)


def test_rl_tutorial_runs_on_torch(rpcx_backend: str, tmp_path: pathlib.Path) -> None:
    # The program itself is right: the same check on torch.distributed.rpc (once, in
    # the gloo session; it does not depend on rpcx's backend).
    if rpcx_backend != "gloo":
        pytest.skip("run once, in the gloo session")
    out = _run((SEEDS / RL).read_text(), tmp_path, None, "--log_interval", "1", env=RL_ENV)
    _check_rl(out, 1)
