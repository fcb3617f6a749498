"""The programs users start from (../shared/seeds) run on rpcx with only their imports changed.

Each program lives in ``tests/seed_programs/<name>/`` as torch wrote it, on torch's RPC
(each file's header says where it comes from and what the seed's fragments left out).
A test copies it, rewrites its ``torch.distributed`` RPC imports (rpc, autograd, optim,
nn) to rpcx's and changes nothing else (the fixed ports it rendezvous on are replaced
by ports from the OS, so that tests can run side by side), runs it on the session's
backend (the default backend, auto, in ``nox -s tests``; tensorpipe in ``nox -s seeds``)
and checks what it prints. ``nox -s seeds`` also runs the same program on
torch.distributed.rpc to show the check holds there too. None of the programs is seeded
(the RL policy, the RNN's uninitialised batches, the DDP program's random batches), so
outputs are checked for what the program promises, not compared number for number.

- ``rl_tutorial``: the RPC tutorial's reinforcement learning (seed 003). It needs numpy
  (its own import: the tensorpipe pass of ``nox -s tests``, which runs without numpy,
  skips this module)
  and gym: ``tests/seed_programs/gym`` is a stand-in with gym's old API, which the
  program was written for, over the RL example's CartPole.
- ``rnn_tutorial``: the tutorial's distributed RNN (seed 003), one GPU as printed.
- ``ddp_rpc/tutorial.py`` and ``ddp_rpc/example.py``: DDP + RPC (seeds 001 and 000).
  They put each trainer's Linear on a GPU.

Where the machine has fewer GPUs than a program uses, it runs on CPU through
``tests/seed_programs/cuda_on_cpu`` (``.cuda()`` keeps tensors where they are, DDP drops
``device_ids``): the RPC code is the program's own either way.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from rpcx.registry import DEFAULT_BACKEND
from rpcx.testing.world import free_port

# Whole programs in fresh interpreters: nox -s programs runs them (and CI), not nox -s tests.
pytestmark = pytest.mark.program

pytest.importorskip("numpy", reason="the seed programs import numpy themselves")

SEEDS = pathlib.Path(__file__).resolve().parent / "seed_programs"
CUDA_ON_CPU = SEEDS / "cuda_on_cpu"
# The gym stand-in's CartPole is the RL example's.
CARTPOLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "rl"
RUN_TIMEOUT = 300.0
FIXED_PORTS = ("29500", "29501")  # what the programs rendezvous on, as torch wrote them

# The only change a program gets to run on rpcx: its torch RPC imports, as the migration
# guide (docs/migration.md) tells users to change them.
IMPORTS_TO_RPCX = (
    ("import torch.distributed.rpc as rpc", "import rpcx as rpc"),
    ("from torch.distributed.rpc import", "from rpcx import"),
    ("import torch.distributed.autograd as dist_autograd", "import rpcx.autograd as dist_autograd"),
    ("from torch.distributed.optim import", "from rpcx.optim import"),
    ("from torch.distributed.nn import", "from rpcx.nn import"),
)
TORCH_RPC_MODULES = re.compile(r"torch\.distributed\.(rpc|autograd|optim|nn)\b")


@dataclass(frozen=True)
class SeedProgram:
    """One program: where it lives, how it is run and what its output must show."""

    directory: str  # under tests/seed_programs; every .py in it is part of the program
    script: str
    gpus: int  # GPUs the program uses as printed
    check: Callable[[str], None]
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)



def _on_rpcx(source: str) -> str:
    """``source`` with its torch RPC imports pointed at rpcx: the only change."""
    for torch_import, rpcx_import in IMPORTS_TO_RPCX:
        source = source.replace(torch_import, rpcx_import)
    assert not TORCH_RPC_MODULES.search(source), "an import this test does not rewrite"
    return source


def _copy(program: SeedProgram, into: pathlib.Path, on_rpcx: bool) -> pathlib.Path:
    """The program's files in ``into``, on fresh ports, imports rewritten if ``on_rpcx``."""
    ports = {fixed: str(free_port()) for fixed in FIXED_PORTS}
    rewritten = 0
    for source_file in sorted((SEEDS / program.directory).glob("*.py")):
        source = original = source_file.read_text()
        if on_rpcx:
            source = _on_rpcx(source)
            rewritten += source != original
        for fixed, port in ports.items():
            source = source.replace(fixed, port)
        (into / source_file.name).write_text(source)
    assert rewritten or not on_rpcx, "nothing was rewritten: not a torch RPC program?"
    return into / program.script


def _run(program: SeedProgram, tmp_path: pathlib.Path, backend: str | None,
         *args: str) -> str:
    script = _copy(program, tmp_path, on_rpcx=backend is not None)
    path = [str(SEEDS), str(CARTPOLE)]
    # Unbuffered: each print reaches the pipe as whole writes, so the lines of workers
    # printing at once may interleave but are never cut mid-word by a buffer flush.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **program.env)
    if torch.cuda.device_count() < program.gpus:
        path.insert(0, str(CUDA_ON_CPU))
        env["RPCX_SEED_CUDA_ON_CPU"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([*path, *filter(None, [env.get("PYTHONPATH")])])
    env.pop("RPCX_BACKEND", None)
    if backend is not None:
        env["RPCX_BACKEND"] = backend
    out = subprocess.run(
        [sys.executable, str(script), *program.args, *args], capture_output=True, text=True,
        timeout=RUN_TIMEOUT, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, f"the program failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _check_rl(out: str) -> None:
    # Its policy is not seeded, so the check is that it learns: the reward threshold is
    # lowered (the gym stand-in reads it) so that a run takes seconds.
    assert "This will run until reward threshold of 12.0 is reached" in out, out
    solved = re.search(r"Solved! Running reward is now (\S+)!", out)
    assert solved and float(solved.group(1)) > 12.0, out
    assert re.search(r"Episode \d+\tLast reward: \d+\.\d\d\tAverage reward: ", out), out


def _check_rnn(out: str) -> None:
    assert re.findall(r"^Training epoch (\d+)$", out, re.M) == [str(e) for e in range(10)], out


def _check_ddp(out: str) -> None:
    # Each of the two trainers trains 100 epochs; their lines interleave (two prints may
    # share a line), so the lines are not anchored.
    epochs = sorted(int(e) for e in re.findall(r"Training done for epoch (\d+)", out))
    assert epochs == sorted(list(range(100)) * 2), out


# The RL tutorial: an agent and observers; the observers call the agent through RRef
# proxies, and the agent starts episodes by sending a proxy's method as the function
# of rpc_async.
RL = SeedProgram("rl_tutorial", "main.py", gpus=0, check=_check_rl,
                 args=("--log_interval", "1"), env={"RPCX_SEED_REWARD_THRESHOLD": "12"})
# The RNN tutorial: remote modules called through a helper, an LSTM between them,
# distributed autograd and DistributedOptimizer over remote and local parameters.
RNN = SeedProgram("rnn_tutorial", "main.py", gpus=1, check=_check_rnn)
# DDP + RPC: a master hands the parameter server's EmbeddingBag (an RRef, or a
# RemoteModule) to two trainers that train a DDP Linear over a gloo process group.
# The tutorial sends the master's rank as the trainers' device: cuda:2 on both.
DDP_TUTORIAL = SeedProgram("ddp_rpc", "tutorial.py", gpus=3, check=_check_ddp)
DDP_EXAMPLE = SeedProgram("ddp_rpc", "example.py", gpus=2, check=_check_ddp)
PROGRAMS = {"rl": RL, "rnn": RNN, "ddp_tutorial": DDP_TUTORIAL, "ddp_example": DDP_EXAMPLE}


# The programs start their workers as processes themselves (mp.spawn).
needs_processes = pytest.mark.rpcx_requires(
    "multi_process", reason="the program starts its workers as processes (mp.spawn)"
)


# The programs exercise the API, not the transport (the conformance kit covers each
# backend): they run on the default backend in ``nox -s tests`` (what a user who only
# changes the imports gets) and on tensorpipe in ``nox -s seeds``.
SEED_BACKENDS = (DEFAULT_BACKEND, "tensorpipe")


def _on_a_seed_backend(rpcx_backend: str) -> None:
    if rpcx_backend not in SEED_BACKENDS:
        pytest.skip(f"the seed programs run on {' and '.join(SEED_BACKENDS)} (they test "
                    "the API; the conformance kit tests each backend)")


@needs_processes
@pytest.mark.parametrize("world_size", [2, 3])
def test_rl_tutorial_runs_on_rpcx(
    rpcx_backend: str, tmp_path: pathlib.Path, world_size: int
) -> None:
    _on_a_seed_backend(rpcx_backend)
    RL.check(_run(RL, tmp_path, rpcx_backend, "--world_size", str(world_size)))


@needs_processes
@pytest.mark.parametrize("name", ["rnn", "ddp_tutorial", "ddp_example"])
def test_seed_program_runs_on_rpcx(rpcx_backend: str, tmp_path: pathlib.Path, name: str) -> None:
    _on_a_seed_backend(rpcx_backend)
    program = PROGRAMS[name]
    program.check(_run(program, tmp_path, rpcx_backend))


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_seed_program_runs_on_torch(
    rpcx_backend: str, tmp_path: pathlib.Path, name: str, request: pytest.FixtureRequest
) -> None:
    # The program and its check are right: the same run on torch.distributed.rpc (with
    # --seeds-on-torch, in the default backend's session: it does not depend on rpcx's
    # backend; it
    # checks the checks, so it runs when they change, not in every run of the suite).
    if not request.config.getoption("--seeds-on-torch"):
        pytest.skip("checks the checks on torch itself: nox -s seeds")
    if rpcx_backend != DEFAULT_BACKEND:
        pytest.skip(f"run once, in the default backend's session ({DEFAULT_BACKEND})")
    program = PROGRAMS[name]
    program.check(_run(program, tmp_path, None))


def test_only_imports_change() -> None:
    # The rewrite touches import lines and nothing else, in every program file.
    for source_file in SEEDS.glob("*/*.py"):
        if source_file.parent == CUDA_ON_CPU:
            continue
        before = source_file.read_text().splitlines()
        after = _on_rpcx(source_file.read_text()).splitlines()
        assert len(before) == len(after)
        for old, new in zip(before, after, strict=True):
            if old != new:
                assert old.lstrip().startswith(("import ", "from ")), (source_file, old)


def test_cuda_on_cpu_shim_runs_the_sitecustomize_it_shadows(tmp_path: pathlib.Path) -> None:
    shadowed = tmp_path / "sitecustomize.py"
    shadowed.write_text("import os\nos.environ['SHADOWED_SITECUSTOMIZE_RAN'] = 'yes'\n")
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('SHADOWED_SITECUSTOMIZE_RAN'))"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(CUDA_ON_CPU), str(tmp_path)])},
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert out.stdout.strip() == "yes", out.stderr

