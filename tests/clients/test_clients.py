"""Libraries built on torch.distributed.rpc (TorchRL, PyG, fairscale), run unchanged on
rpcx.

Each program in this directory is written for torch.distributed.rpc (the libraries
import it themselves; so do the programs). It runs once on torch and once per
multi-process rpcx backend with ``RPCX_FOR_TORCH=1`` in its environment, and must print
the same result (collected observations, sampled data, the effect of a weight update,
features fetched from another worker, a pipeline's outputs and training losses).
``nox -s clients`` installs the libraries and runs these; where a library is not
installed, its cases skip.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rpcx.cli.doctor import startup_hook
from rpcx.registry import available_backends

if os.environ.get("RPCX_REQUIRE_CLIENTS"):  # nox -s clients: nothing may skip
    import fairscale  # noqa: F401
    import torch_geometric  # noqa: F401
    import torchrl  # noqa: F401

    if startup_hook() is None:
        raise RuntimeError("rpcx-for-torch.pth is not installed in this environment")

HERE = Path(__file__).resolve().parent
BACKENDS = sorted(name for name, spec in available_backends().items()
                  if not spec.capabilities.in_process)
CASES = [  # (library, program, mode)
    ("torchrl", "torchrl_collector.py", "sync"),  # RPCCollector, with a weight update
    ("torchrl", "torchrl_collector.py", "async"),
    ("torchrl", "torchrl_replay_buffer.py", ""),  # RemoteTensorDictReplayBuffer
    ("torchrl", "torchrl_replay_buffer.py", "dynamic"),  # ... in a dynamic world
    ("torch_geometric", "pyg_rpc.py", ""),  # PyG's distributed RPC layer
    ("fairscale", "fairscale_pipeline.py", ""),  # DistributedPipeline: fairscale's scenarios
]
# Programs that write their result to the path they are given first (then the mode).
WRITES_RESULT = {"torchrl_replay_buffer.py", "pyg_rpc.py"}

pytestmark = pytest.mark.skipif(
    startup_hook() is None,
    reason="rpcx-for-torch.pth is not installed here (pip install -e . installs it)",
)


def run(program: str, mode: str, backend: str | None, tmp: Path,
        **environment: str) -> dict[str, Any]:
    """Run ``program`` on torch (``backend=None``) or on rpcx's ``backend`` (with
    ``environment`` added to its environment); its result."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RPCX_FOR_TORCH", "RPCX_BACKEND", "RPCX_AUTH_KEY", "RPCX_ENCRYPT")}
    if backend is not None:
        env.update(RPCX_FOR_TORCH="1", RPCX_BACKEND=backend, **environment)
    args = [mode] if program not in WRITES_RESULT else [
        str(tmp / "result.json"), *([mode] if mode else [])]
    done = subprocess.run([sys.executable, str(HERE / program), *args], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=240)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (
        f"{program} {mode} on {backend or 'torch'} failed (exit {done.returncode}):\n"
        f"{done.stdout}\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    return result


@pytest.fixture(scope="session")
def on_torch(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], dict[str, Any]]:
    """The program's result on torch.distributed.rpc itself, run once per case for the
    whole run: the first pytest worker to need it runs it and keeps it in a file the
    others read (holding a lock on that file while it runs, so they wait for it)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # (this run's, the same for every xdist worker)

    def result_on_torch(program: str, mode: str) -> dict[str, Any]:
        kept = shared / f"on-torch-{program}-{mode or 'plain'}.json"
        with open(kept.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # (bounded by the test's timeout)
            if kept.exists():
                result: dict[str, Any] = json.loads(kept.read_text())
                return result
            with tempfile.TemporaryDirectory() as tmp:
                result = run(program, mode, None, Path(tmp))
            assert result.pop("rpc") == "torch.distributed.rpc.api", "torch's run ran on rpcx"
            kept.write_text(json.dumps(result))
            return result

    return result_on_torch


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("library", "program", "mode"), CASES)
def test_same_results_as_on_torch(library: str, program: str, mode: str, backend: str,
                                  tmp_path: Path,
                                  on_torch: Callable[[str, str], dict[str, Any]]) -> None:
    pytest.importorskip(library, reason=f"{library} is not installed (nox -s clients "
                                        "installs it)")
    if backend == "tensorpipe":
        pytest.importorskip("numpy", reason="torch's TensorPipe agent needs numpy")
    if mode == "dynamic" and not available_backends()[backend].capabilities.dynamic:
        pytest.skip(f"backend {backend!r} cannot admit workers after start (a dynamic "
                    "world; the conformance kit checks its refusal)")
    result = run(program, mode, backend, tmp_path)
    assert result.pop("rpc") == "rpcx._services.calls", (
        "the switch did not reach TorchRL's processes")
    assert result.pop("encrypted_peers", 0) == 0
    assert result == on_torch(program, mode)


DYNAMIC_BACKENDS = [name for name in BACKENDS if available_backends()[name].capabilities.dynamic]


@pytest.mark.parametrize("backend", DYNAMIC_BACKENDS)
def test_a_dynamic_replay_buffer_with_a_key_encrypts_and_gives_torchs_results(
        backend: str, tmp_path: Path, on_torch: Callable[[str, str], dict[str, Any]]) -> None:
    # TorchRL's dynamic replay-buffer world, every worker holding a world key and
    # encrypting every pair (RPCX_ENCRYPT=always: the three run on one host).
    pytest.importorskip("torchrl", reason="torchrl is not installed (nox -s clients "
                                          "installs it)")
    pytest.importorskip("cryptography", reason="encryption needs the 'cryptography' package")
    if backend == "tensorpipe":
        pytest.importorskip("numpy", reason="torch's TensorPipe agent needs numpy")
    result = run("torchrl_replay_buffer.py", "dynamic", backend, tmp_path,
                 RPCX_AUTH_KEY="torchrl-replay-buffer-" + "0123456789abcdef",
                 RPCX_ENCRYPT="always")
    assert result.pop("rpc") == "rpcx._services.calls", (
        "the switch did not reach TorchRL's processes")
    assert result.pop("encrypted_peers") == 2  # the trainer, with the buffer and collector
    assert result == on_torch("torchrl_replay_buffer.py", "dynamic")
