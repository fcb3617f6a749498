"""rpcx.use_for_torch() and $RPCX_FOR_TORCH: torch's RPC names become rpcx's.

In this process: every name the switch covers points at rpcx's object while it is on and
at torch's again after ``stop_using_for_torch()``; torch's spelling of a program runs on
the backend the switch names. In fresh processes: the start-up hook turns the switch on
from the environment before a library's own ``from torch.distributed.rpc import ...``
runs, in the processes that library spawns itself too, and rpcx's tensorpipe backend
(which drives torch's agent) still works with the switch on.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import rpcx
from rpcx import for_torch, torch_originals
from rpcx.cli.doctor import diagnose, startup_hook

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def switched() -> Iterator[None]:
    """The switch on (loopback backend) for one test, and off again whatever happens."""
    assert rpcx.used_for_torch() is None, "the switch was left on by an earlier test"
    rpcx.use_for_torch(backend="loopback")
    try:
        yield
    finally:
        rpcx.stop_using_for_torch()


def _torch_objects() -> dict[tuple[str, str], object]:
    with warnings.catch_warnings():  # torch's own torch.jit use (see for_torch._module)
        warnings.simplefilter("ignore", DeprecationWarning)
        return {(module, name): getattr(importlib.import_module(module), name)
                for module, name, _ in for_torch._replacements()}


def test_every_name_points_at_rpcx_while_on_and_at_torch_after() -> None:
    before = _torch_objects()
    assert before[("torch.distributed.rpc", "rpc_sync")].__module__ == "torch.distributed.rpc.api"
    rpcx.use_for_torch()
    try:
        line = sys._getframe().f_lineno - 2
        for module, name, replacement in for_torch._replacements():
            assert getattr(importlib.import_module(module), name) is replacement, (module, name)
        assert rpcx.used_for_torch() == f"rpcx.use_for_torch() at {__file__}:{line}"
        assert torch._C._distributed_rpc.PyRRef is rpcx.RRef
        import torch.distributed.optim as torch_optim
        assert torch_optim.DistributedOptimizer is rpcx.optim.DistributedOptimizer
    finally:
        rpcx.stop_using_for_torch()
    assert rpcx.used_for_torch() is None
    assert _torch_objects() == before


def test_torch_spelling_runs_on_the_switch_backend(switched: None) -> None:
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    # What libraries pass: torch's only backend. Read as "no backend named".
    rpc.init_rpc("w0", backend=rpc.BackendType.TENSORPIPE, rank=0, world_size=1,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=30))
    try:
        assert rpcx.debug_info()["backend"] == "loopback"
        assert rpc.get_worker_info().name == "w0"
        assert torch.equal(rpc.rpc_sync("w0", torch.add, args=(torch.ones(2), 1)),
                           torch.full((2,), 2.0))
        assert torch.equal(rpc.rpc_async("w0", torch.neg, args=(torch.ones(2),)).wait(),
                           -torch.ones(2))
        rref = rpc.remote("w0", torch.arange, args=(3,))
        # The checks libraries make (TorchRL's accept_remote_rref_invocation).
        assert isinstance(rref, torch._C._distributed_rpc.PyRRef)
        assert isinstance(rref, rpc.RRef)
        assert torch.equal(rref.to_here(), torch.arange(3))
        x = torch.ones(2, requires_grad=True)
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync("w0", torch.mul, args=(x, 3.0)).sum()
            dist_autograd.backward(context_id, [loss])
            assert torch.equal(dist_autograd.get_gradients(context_id)[x], torch.full((2,), 3.0))
    finally:
        rpc.shutdown()


def test_torch_async_execution_runs_under_the_switch(switched: None) -> None:
    import torch.distributed.rpc as rpc

    rpc.init_rpc("w0", rank=0, world_size=1)
    try:
        assert rpc.rpc_sync("w0", _torch_async_double, args=(21,)) == 42
    finally:
        rpc.shutdown()


@torch.distributed.rpc.functions.async_execution  # torch's own decorator, kept as is
def _torch_async_double(x: int) -> torch.futures.Future[int]:
    future: torch.futures.Future[int] = torch.futures.Future()
    future.set_result(2 * x)
    return future


def _gather_in_world(rank: int, world_size: int, init_method: str, out: dict[int, Any]) -> None:
    import torch.distributed.rpc as rpc

    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=init_method,
                                                                      rpc_timeout=30))
    try:
        everyone = [rpc.api._all_gather(rank * 10) for _ in range(2)]  # two rounds
        subset = (rpc.api._all_gather(f"r{rank}", worker_names={"w0", "w2"})
                  if rank in (0, 2) else None)
        alone = None
        if rank == 1:  # w3 never takes part: bounded by the timeout given
            try:
                rpc.api._all_gather("x", worker_names=["w1", "w3", "w3"], timeout=0.3)
            except RuntimeError as exc:
                alone = str(exc)
        out[rank] = (everyone, subset, alone)
        rpc.api._all_gather(None)  # a barrier before anyone leaves
    finally:
        rpc.shutdown()


def test_all_gather_per_worker_in_one_process(switched: None, tmp_path: Path) -> None:
    """Workers that are threads of one process (loopback) each gather their own rounds."""
    out: dict[int, Any] = {}
    rpcx.spawn(_gather_in_world, args=(4, f"file://{tmp_path / 'rdv'}", out), nprocs=4,
               backend="loopback")
    every = {"w0": 0, "w1": 10, "w2": 20, "w3": 30}
    for rank in range(4):
        everyone, subset, alone = out[rank]
        assert everyone == [every, every], (rank, everyone)
        assert subset == ({"w0": "r0", "w2": "r2"} if rank in (0, 2) else None)
        assert (alone is None) is (rank != 1)
    assert "not every one of ['w1', 'w3'] took part within 0.3 s" in out[1][2]
    assert for_torch._gatherings == {}  # nothing left behind, the timed-out round included


def test_the_agent_view_reads_this_worker_s_device_maps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rpcx._core import context as _context
    from rpcx._wire.devices import DeviceRoutes

    routes = DeviceRoutes(0, ["w0", "w1"])
    routes.outgoing[1] = {torch.device("cpu"): torch.device("meta")}

    class Agent:
        pass

    agent = Agent()
    agent.routes = routes  # type: ignore[attr-defined]
    monkeypatch.setattr(_context, "maybe_current_agent", lambda: agent)
    monkeypatch.setattr(_context, "current_agent", lambda: agent)
    view = for_torch._get_current_rpc_agent()
    assert view._get_device_map(rpcx.WorkerInfo("w1", 1)) == {
        torch.device("cpu"): torch.device("meta")}
    assert view._get_device_map(rpcx.WorkerInfo("w0", 0)) == {}


def test_no_agent_is_torch_s_error() -> None:
    with pytest.raises(RuntimeError, match="Current RPC agent is not set!"):
        for_torch._get_current_rpc_agent()


def test_tensorpipe_starts_torch_s_agent_beside_an_rpcx_worker(
    switched: None, tmp_path: Path,
) -> None:
    """Under the switch, torch's "is an agent set?" answers for rpcx's workers too: the
    tensorpipe backend must still start torch's own agent when a loopback worker runs."""
    pytest.importorskip("numpy", reason="torch's TensorPipe agent needs numpy")
    import threading

    import torch.distributed.rpc as rpc

    ready, leave = threading.Event(), threading.Event()

    def loopback_worker() -> None:
        rpcx.init_rpc("lb", backend="loopback", rank=0, world_size=1)
        ready.set()
        leave.wait(60)
        rpcx.shutdown()

    thread = threading.Thread(target=loopback_worker)
    thread.start()
    try:
        assert ready.wait(60)
        rpcx.init_rpc("tp", backend="tensorpipe", rank=0, world_size=1,
                      rpc_backend_options=rpcx.TensorPipeRpcBackendOptions(
                          init_method=f"file://{tmp_path / 'rdv'}", rpc_timeout=30))
        try:
            # torch's own agent runs (torch's own answer, not the switch's)
            assert torch_originals.original(rpc.api, "_is_current_rpc_agent_set")()
            assert torch.equal(rpcx.rpc_sync("tp", torch.add, args=(torch.ones(1), 1)),
                               torch.full((1,), 2.0))
        finally:
            rpcx.shutdown()
    finally:
        leave.set()
        thread.join(60)


def test_a_second_call_changes_the_backend_and_keeps_the_origin(switched: None) -> None:
    origin = rpcx.used_for_torch()
    rpcx.use_for_torch(backend="gloo")
    assert rpcx.used_for_torch() == origin
    assert for_torch._state.backend == "gloo"


def test_a_torch_without_rpc_is_refused_and_nothing_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = _torch_objects()
    real = importlib.import_module

    def import_module(name: str, package: str | None = None) -> object:
        if name == "torch._C._distributed_rpc":
            raise ImportError("simulated: built without distributed RPC")
        return real(name, package)

    monkeypatch.setattr(for_torch.importlib, "import_module", import_module)
    with pytest.raises(RuntimeError, match="no RPC package for rpcx to stand in for"):
        rpcx.use_for_torch()
    monkeypatch.undo()
    assert rpcx.used_for_torch() is None
    assert _torch_objects() == before


@pytest.mark.parametrize(("value", "on"), [
    ("", False), ("0", False), ("false", False), ("No", False), ("off", False),
    ("1", True), ("yes", True), ("true", True), (" ON ", True),
])
def test_the_variable_reads_like_a_flag(value: str, on: bool) -> None:
    assert for_torch.switch_requested(lambda _name, _default: value) is on


def test_a_torch_missing_one_name_is_refused_and_nothing_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = _torch_objects()
    names = for_torch._replacements()
    monkeypatch.setattr(for_torch, "_replacements",
                        lambda: [*names, ("torch.distributed.rpc", "no_such_name", None)])
    with pytest.raises(RuntimeError, match=r"no torch\.distributed\.rpc\.no_such_name"):
        rpcx.use_for_torch()
    monkeypatch.undo()
    assert rpcx.used_for_torch() is None
    assert _torch_objects() == before


def test_doctor_reports_a_variable_the_start_up_hook_did_not_see(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert "rpcx_startup" not in sys.modules  # (the variable was unset when pytest began)
    monkeypatch.setenv("RPCX_FOR_TORCH", "1")
    check = {c.name: c for c in diagnose("tcp://127.0.0.1:1")}["for torch"]
    assert check.status == "PROBLEM" and "start-up hook did not run" in check.detail, check


def test_doctor_says_whether_the_switch_is_on() -> None:
    check = {c.name: c for c in diagnose("tcp://127.0.0.1:1")}["for torch"]
    assert check.status == "note" and check.detail.startswith("off:"), check
    rpcx.use_for_torch()
    try:
        check = {c.name: c for c in diagnose("tcp://127.0.0.1:1")}["for torch"]
        assert check.status == "ok" and "rpcx.use_for_torch() at" in check.detail, check
    finally:
        rpcx.stop_using_for_torch()


# --------------------------------------------------------------- fresh processes

# A "library": it binds torch's names at import, before any code of the program runs,
# and spawns its workers itself (fresh interpreters, as torch.multiprocessing does).
LIBRARY = '''\
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc
from torch._C._distributed_rpc import PyRRef, _is_current_rpc_agent_set
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import (
    RRef, TensorPipeRpcBackendOptions, init_rpc, remote, rpc_sync, shutdown,
)


class Buffer:
    """Lives on its owner; called through an RRef as TorchRL's replay buffer is."""

    def __init__(self):
        self.items = []

    def add(self, item):
        if isinstance(self, PyRRef):  # TorchRL's accept_remote_rref_invocation
            self = self.local_value()
        self.items.append(item)
        return len(self.items)


def worker(rank, init_method, out):
    assert not _is_current_rpc_agent_set()
    init_rpc(f"w{rank}", rank=rank, world_size=2,
             rpc_backend_options=TensorPipeRpcBackendOptions(init_method=init_method,
                                                              rpc_timeout=60))
    # torch's private names that libraries use (PyG, PiPPy): on both workers.
    assert _is_current_rpc_agent_set()
    assert torch.distributed.rpc.api._require_initialized(lambda: 7)() == 7
    gathered = torch.distributed.rpc.api._all_gather(rank * 10)
    assert gathered == {"w0": 0, "w1": 10}, gathered
    assert torch.distributed.rpc.api._all_gather(f"again {rank}") == {
        "w0": "again 0", "w1": "again 1"}
    agent = torch.distributed.rpc._get_current_rpc_agent()
    assert agent.get_worker_info().name == f"w{rank}"
    assert agent._get_device_map(agent.get_worker_info("w1")) == {}
    if rank == 0:
        import rpcx
        buffer = remote("w1", Buffer)
        assert isinstance(buffer, PyRRef) and isinstance(buffer, RRef)
        assert rpc_sync("w1", Buffer.add, args=(buffer, 7)) == 1
        weight = remote("w1", torch.ones, args=(2,), kwargs={"requires_grad": True})
        optimizer = DistributedOptimizer(torch.optim.SGD, [weight], lr=0.5)
        with dist_autograd.context() as context_id:
            loss = rpc_sync("w1", _times_weight, args=(weight,)).sum()
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
        after = weight.to_here()
        with open(out, "w") as f:
            f.write(f"{rpcx.debug_info()['backend']} {rpcx.used_for_torch()} "
                    f"{after.tolist()}")
    shutdown()


def _times_weight(weight_rref):
    return weight_rref.local_value() * 3.0
'''

PROGRAM = '''\
import sys

import torch.multiprocessing as mp

import library

if __name__ == "__main__":
    init_method, out = sys.argv[1], sys.argv[2]
    mp.start_processes(library.worker, args=(init_method, out), nprocs=2,
                       start_method="spawn")
'''


def _run_library(tmp_path: Path, env: dict[str, str]) -> str:
    (tmp_path / "library.py").write_text(LIBRARY)
    (tmp_path / "program.py").write_text(PROGRAM)
    out = tmp_path / "out.txt"
    full_env = {k: v for k, v in os.environ.items() if k not in ("RPCX_FOR_TORCH",
                                                                  "RPCX_BACKEND")}
    full_env.update(env, PYTHONPATH=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "program.py", f"file://{tmp_path / 'rendezvous'}", str(out)],
        cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=150,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out.read_text()


needs_hook = pytest.mark.skipif(
    startup_hook() is None,
    reason="rpcx-for-torch.pth is not installed here (run from an installed rpcx: pip "
           "install -e . installs it)",
)


@pytest.mark.commands
@needs_hook
def test_a_library_that_binds_torch_names_at_import_runs_on_rpcx(tmp_path: Path) -> None:
    # The weight: 1 - 0.5 * d(sum(3 w))/dw = 1 - 1.5
    assert _run_library(tmp_path, {"RPCX_FOR_TORCH": "1"}) == (
        "auto $RPCX_FOR_TORCH, at interpreter start-up [-0.5, -0.5]")


@pytest.mark.commands
@needs_hook
def test_rpcx_tensorpipe_backend_works_with_the_switch_on(tmp_path: Path) -> None:
    pytest.importorskip("numpy", reason="torch's TensorPipe agent needs numpy")
    result = _run_library(tmp_path, {"RPCX_FOR_TORCH": "1", "RPCX_BACKEND": "tensorpipe"})
    assert result == "tensorpipe $RPCX_FOR_TORCH, at interpreter start-up [-0.5, -0.5]"


def _run_with_hook(tmp_path: Path, code: str, variable: bool = True
                   ) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter that reads the source tree's .pth file once, as
    site does at start-up (without installing it), with the variable set or not."""
    (tmp_path / "rpcx-for-torch.pth").write_text((REPO / "rpcx" / "rpcx-for-torch.pth").read_text())
    prelude = ("import os, site, sys\n"
               + ("os.environ['RPCX_FOR_TORCH'] = '1'\n" if variable else "")
               + f"site.addsitedir({str(tmp_path)!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "RPCX_FOR_TORCH"}
    return subprocess.run([sys.executable, "-W", "always", "-c", prelude + code], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.commands
def test_the_pth_line_from_the_source_tree_turns_the_switch_on(tmp_path: Path) -> None:
    done = _run_with_hook(tmp_path, (
        "assert 'torch' not in sys.modules and 'rpcx' not in sys.modules\n"
        "from torch.distributed.rpc import rpc_sync\n"
        "import rpcx\n"
        "print(rpc_sync is rpcx.rpc_sync, rpcx.used_for_torch())\n"
    ))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True $RPCX_FOR_TORCH, at interpreter start-up"


@pytest.mark.commands
def test_a_library_that_looks_for_torch_first_still_gets_rpcx(tmp_path: Path) -> None:
    # transformers' is_torch_available() and others call find_spec before importing.
    done = _run_with_hook(tmp_path, (
        "import importlib.util\n"
        "assert importlib.util.find_spec('torch') is not None\n"
        "assert importlib.util.find_spec('torch') is not None\n"
        "from torch.distributed.rpc import rpc_sync\n"
        "import rpcx\n"
        "print(rpc_sync is rpcx.rpc_sync, rpcx.used_for_torch())\n"
    ))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True $RPCX_FOR_TORCH, at interpreter start-up"


@pytest.mark.commands
def test_a_switch_that_fails_leaves_torch_importable_and_says_why(tmp_path: Path) -> None:
    done = _run_with_hook(tmp_path, (
        "sys.modules['rpcx.for_torch'] = None  # as if rpcx were broken\n"
        "import torch.distributed.rpc as rpc\n"
        "print(rpc.rpc_sync.__module__)\n"
    ))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "torch.distributed.rpc.api"
    assert "RPCX_FOR_TORCH is set, but rpcx could not take over torch's RPC names" in (
        done.stderr), done.stderr


@pytest.mark.commands
def test_without_the_variable_the_hook_does_nothing(tmp_path: Path) -> None:
    done = _run_with_hook(tmp_path, (
        "import torch.distributed.rpc as rpc\n"
        "print(rpc.rpc_sync.__module__, 'rpcx' in sys.modules, 'rpcx_startup' in sys.modules)\n"
    ), variable=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "torch.distributed.rpc.api False False"
