"""What every benchmark run sets and records about the machine, in one place."""

from __future__ import annotations

import os
import pathlib
import platform
import subprocess


def set_worker_environment() -> None:
    """Environment every worker of every system inherits (unless already set).

    torch's C++ warnings (TensorPipe's "pipe closed" at every shutdown, for one) would
    drown the progress lines; TORCH_CPP_LOG_LEVEL=WARNING brings them back. And every
    worker runs with one intra-op thread, as torchrun sets for several processes per
    host: with more, OpenMP workers spinning between parallel regions take the CPU the
    RPC threads need (on 2 cores, the DDP + RPC epoch took torch 47-54 ms and rpcx/gloo
    166-210 ms with the default, 34-37 and 66 ms with 1).
    """
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def machine_facts() -> dict[str, object]:
    """Versions, commit and machine of this run, for its JSON."""
    import torch

    return {
        "torch": torch.__version__, "rpcx": _rpcx_version(), "git_commit": _git_commit(),
        "cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(), "platform": platform.platform(),
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=pathlib.Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _rpcx_version() -> str | None:
    try:
        import rpcx
    except ImportError:
        return None
    return str(rpcx.__version__)
