"""A large world starts and stops without a line of noise: no c10d warning, nothing else.

rpcx waited on its rendezvous store in 250 ms slices, and each slice that timed out made
torch's TCPStore print two c10d warning lines (12 in one 16-worker start-up and shutdown
here, 266 in a 32-worker one elsewhere). Its waits now look for keys instead.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rpcx.registry import DEFAULT_BACKEND

WORKERS = 16
RUN_BOUND = 240.0

_PROGRAM = textwrap.dedent('''
    import os
    import rpcx

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpcx.init_rpc(f"worker{rank}", rank=rank, world_size=size)
    assert rpcx.rpc_sync(f"worker{(rank + 1) % size}", max, args=(rank, 0)) == rank
    rpcx.shutdown()
''')


@pytest.mark.commands
@pytest.mark.timeout(RUN_BOUND + 30)
def test_a_16_worker_start_up_and_shutdown_print_nothing(
    rpcx_backend: str, tmp_path: Path
) -> None:
    if rpcx_backend != DEFAULT_BACKEND:
        pytest.skip("the store waits are rpcx's own, the same on every backend: checked "
                    f"once, on the default backend ({DEFAULT_BACKEND}), on a tcp store as "
                    "torchrun's")
    program = tmp_path / "world.py"
    program.write_text(_PROGRAM)
    # `rpcx launch` hosts a TCPStore, as torchrun's agent does, and prefixes each line a
    # worker prints with its name.
    run = subprocess.run(
        [sys.executable, "-m", "rpcx", "launch", "-n", str(WORKERS), "--backend",
         rpcx_backend, str(program)],
        capture_output=True, text=True, timeout=RUN_BOUND,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "c10d" not in output, output
    assert output == "", output
