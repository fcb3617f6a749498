"""The examples run unchanged on loopback and the default backend (and the torch-style one
on torch)."""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from rpcx.registry import DEFAULT_BACKEND

# Whole programs in fresh interpreters: nox -s programs runs them (and CI), not nox -s tests.
pytestmark = pytest.mark.program

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _run(script: pathlib.Path, backend: str | None, *args: str, timeout: float = 240) -> str:
    env = dict(os.environ)
    env.pop("RPCX_BACKEND", None)
    if backend is not None:
        env["RPCX_BACKEND"] = backend
    out = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True,
        timeout=timeout, env=env, cwd=script.parent,
    )
    assert out.returncode == 0, f"{script.name} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


# The examples exercise the API above the transport, which the conformance kit checks on
# every backend: they run where users run them, on loopback and the default backend,
# and ddp_rpc on GPUs on tensorpipe too (device-to-device CUDA).
EXAMPLE_BACKENDS = ("loopback", DEFAULT_BACKEND)


@pytest.fixture(autouse=True)
def _where_users_run_them(request: pytest.FixtureRequest) -> None:
    if "rpcx_backend" not in request.fixturenames:
        return
    backend = request.getfixturevalue("rpcx_backend")
    if backend in EXAMPLE_BACKENDS or (
            backend == "tensorpipe" and request.node.name.startswith("test_ddp_rpc_on_gpus")):
        return
    pytest.skip(f"the examples run on {' and '.join(EXAMPLE_BACKENDS)} (they test the "
                "API; the conformance kit tests each backend)")


def test_demo(rpcx_backend: str) -> None:
    out = _run(EXAMPLES / "demo.py", rpcx_backend)
    assert f"on the {rpcx_backend!r} backend" in out
    found = re.search(r"sum of squares over 2 workers: (\S+) \(local check: (\S+)\)", out)
    assert found and found.group(1) == found.group(2), out
    assert "accumulator on worker1: [3.0, 3.0, 3.0, 3.0]" in out
    assert "remote error kept its type: ValueError(cannot take the square root of -4.0)" in out
    assert out.rstrip().endswith("done")


# torch's own init_rpc gathers the workers' device maps with all_gather_object, which
# reads the gathered bytes through ``Tensor.numpy()``: without numpy (the tensorpipe
# session uninstalls it, to prove rpcx does not need it), torch's side would fail. This
# preamble replaces just that helper with the same bytes read without numpy; the rest is
# torch's RPC, unchanged. It runs in every process of the program (mp.spawn re-imports
# the script as ``__mp_main__``).
_TORCH_WITHOUT_NUMPY = """\
import io as _io
import torch.distributed.distributed_c10d as _c10d


def _tensor_to_object(tensor, tensor_size, group):
    data = bytes(tensor.cpu()[:tensor_size].tolist())
    return _c10d._unpickler(_io.BytesIO(data)).load()


_c10d._tensor_to_object = _tensor_to_object
"""


def _have_numpy() -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def torch_output(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The torch-style example run on torch.distributed.rpc itself, imports swapped back."""
    source = (EXAMPLES / "torch_style.py").read_text()
    source = source.replace("import rpcx as mp ", "import torch.multiprocessing as mp ")
    source = source.replace("import rpcx as rpc ", "import torch.distributed.rpc as rpc ")
    source = source.replace("from rpcx import", "from torch.distributed.rpc import")
    assert "rpcx" not in source.split("# was:")[0].split("---")[-1]
    if not _have_numpy():
        source = _TORCH_WITHOUT_NUMPY + source
    script = tmp_path_factory.mktemp("torch") / "torch_style_on_torch.py"
    script.write_text(source)
    return _run(script, None)


def test_torch_program_runs_with_only_its_imports_changed(
    rpcx_backend: str, torch_output: str
) -> None:
    out = _run(EXAMPLES / "torch_style.py", rpcx_backend)
    assert out == torch_output
    assert "observer rewards: [45.0, 60.0]; agent total: 105.0" in out


def _check_ddp_rpc(out: str, epochs: int) -> None:
    assert "DDP weights identical on both trainers: True" in out, out
    assert "loss fell on both trainers: True" in out, out
    for trainer in ("trainer0", "trainer1"):
        assert re.search(rf"{trainer}: epoch {epochs}/{epochs}  loss \d+\.\d+  \d+\.\d ms",
                         out), out


def test_ddp_rpc(rpcx_backend: str) -> None:
    out = _run(EXAMPLES / "ddp_rpc" / "main.py", rpcx_backend, "--epochs", "2", "--batches", "5")
    assert f"DDP + RPC on the {rpcx_backend!r} backend: 2 epochs of 5 batches" in out, out
    _check_ddp_rpc(out, 2)
    assert out.rstrip().endswith("done")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ddp_rpc_on_gpus(rpcx_backend: str) -> None:
    # Embedding on ps's cuda:0, each trainer's layer on its GPU, tensors along device maps.
    out = _run(EXAMPLES / "ddp_rpc" / "main.py", rpcx_backend, "--epochs", "2", "--batches", "5",
               "--cuda")
    assert f"on the {rpcx_backend!r} backend: 2 epochs of 5 batches, on GPUs" in out, out
    _check_ddp_rpc(out, 2)
    assert out.rstrip().endswith("done")


def test_ddp_rpc_cuda_flag_without_gpu_is_refused(rpcx_backend: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "ddp_rpc" / "main.py"), "--backend", rpcx_backend,
         "--cuda"], capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2 and "--cuda: torch sees no CUDA device" in out.stderr, out


def _rl_rewards(backend: str) -> list[str]:
    out = _run(EXAMPLES / "rl" / "main.py", backend, "--target", "40", "--episodes", "300",
               "--log-every", "5")
    assert f"1 agent and 2 observers on the {backend!r} backend" in out, out
    assert re.search(r"episode +5  rewards \[\d+, \d+\]  running +\d+\.\d\d  ", out), out
    solved = re.search(r"solved: running reward (\S+) > 40\.0 after (\d+) episodes", out)
    assert solved and float(solved.group(1)) > 40.0, out
    assert out.rstrip().endswith("done")
    return re.findall(r"episode +\d+  rewards \[\d+, \d+\]  running +\S+", out)


def _sources_digest() -> str:
    """A digest of rpcx's and the RL example's sources: what the rewards depend on."""
    digest = hashlib.sha256()
    root = EXAMPLES.parent
    for path in sorted([*root.glob("rpcx/**/*.py"), *(EXAMPLES / "rl").glob("*.py")]):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def test_rl(rpcx_backend: str, request: pytest.FixtureRequest) -> None:
    rewards = _rl_rewards(rpcx_backend)
    # Seeded per observer and updated in a fixed order: the same run on any backend. The
    # loopback run of these very sources is kept in pytest's cache (the loopback pass of
    # nox -s tests writes it; later passes read it instead of running it again).
    # (Without the cache plugin, -p no:cacheprovider, the reference is run here.)
    key = f"rpcx/rl-rewards-loopback/{_sources_digest()}"
    cache = getattr(request.config, "cache", None)
    if rpcx_backend == "loopback":
        if cache is not None:
            cache.set(key, rewards)
        return
    reference = cache.get(key, None) if cache is not None else None
    if reference is None:
        reference = _rl_rewards("loopback")
        if cache is not None:
            cache.set(key, reference)
    assert rewards == reference


def _rnn_losses(backend: str) -> list[float]:
    out = _run(EXAMPLES / "rnn" / "main.py", backend, "--epochs", "3")
    assert re.search(r"accuracy 1\.000 >= target 0\.9\n", out), out
    assert out.rstrip().endswith("done")
    return [float(x) for x in re.findall(r"epoch +\d+  loss (\d+\.\d+)  accuracy", out)]


def test_rnn(rpcx_backend: str) -> None:
    losses = _rnn_losses(rpcx_backend)
    assert len(losses) == 3 and losses[2] < losses[0] / 10, losses
    if rpcx_backend != "loopback":
        # Weights and batches come from generators of their own, so loopback, whose
        # workers share one process (and torch's global generator), gives the same
        # losses (up to the rounding of sums over another number of threads).
        assert losses == pytest.approx(_rnn_losses("loopback"), rel=1e-3)


def test_parameter_server(rpcx_backend: str) -> None:
    out = _run(EXAMPLES / "parameter_server" / "main.py", rpcx_backend, "--epochs", "3")
    for trainer in ("trainer1", "trainer2"):
        assert re.search(rf"{trainer}: epoch 3/3  loss \d+\.\d+  \d+\.\d+ ms/batch", out), out
    found = re.search(r"120 forward passes from 2 trainers; loss fell on every trainer: True; "
                      r"held-out accuracy (\S+) \(target 0\.9\)", out)
    assert found and float(found.group(1)) >= 0.9, out
    assert out.rstrip().endswith("done")


def test_batch_rpc(rpcx_backend: str) -> None:
    out = _run(EXAMPLES / "batch_rpc" / "main.py", rpcx_backend, "--rounds", "40")
    for trainer in ("trainer1", "trainer2", "trainer3"):
        assert re.search(rf"{trainer}: round 40/40  loss \d+\.\d+  \d+\.\d+ ms/round", out), out
    assert re.search(r"40 server steps for 40 rounds of 3 trainers \(first losses .*\); "
                     r"held-out MSE \S+, noise variance 0\.01000: fits: True", out), out
    assert out.rstrip().endswith("done")


def test_ddp_rpc_under_torchrun(rpcx_backend: str) -> None:
    from rpcx.registry import resolve_backend

    if resolve_backend(rpcx_backend).capabilities.in_process:
        pytest.skip("torchrun starts processes")
    script = EXAMPLES / "ddp_rpc" / "main.py"
    env = {k: v for k, v in os.environ.items() if k != "RPCX_BACKEND"}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--standalone", str(script), "--backend", rpcx_backend,
         "--epochs", "2", "--batches", "5"],
        capture_output=True, text=True, timeout=240, env=env, cwd=script.parent,
    )
    assert out.returncode == 0, f"torchrun failed:\n{out.stdout}\n{out.stderr}"
    _check_ddp_rpc(out.stdout, 2)
