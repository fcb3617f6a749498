"""The bottom of the house stays layered: leaves import nothing above them, services see
the agent only through rpcx._core.service_host, and nobody reaches into _context's globals.

Read from the source (every import, type-only and function-level ones included), so a
new upward import fails here before it knots the package again.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import rpcx
from rpcx._services.rref_fork import ForkState
from rpcx.options import RpcBackendOptions, TensorPipeRpcBackendOptions, as_backend_options
from rpcx.worker import WorkerInfo

PACKAGE = Path(rpcx.__file__).parent


def rpcx_imports(relative: str) -> set[str]:
    """Every ``rpcx`` module ``relative`` (a path under the package) imports, anywhere."""
    tree = ast.parse((PACKAGE / relative).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("rpcx"))
        elif (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
              and (node.module == "rpcx" or node.module.startswith("rpcx."))):
            found.add(node.module)
            # from a package, a name may be a module: from rpcx._core import context
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if _is_module(f"{node.module}.{a.name}"))
    found.discard("rpcx")
    return found


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_errors_is_a_leaf() -> None:
    assert rpcx_imports("errors.py") == set()


def test_devices_imports_only_the_options() -> None:
    assert rpcx_imports("_wire/devices.py") == {"rpcx.options"}


def test_the_fork_state_sits_below_rref_and_its_protocol() -> None:
    assert rpcx_imports("_services/rref_fork.py") == {"rpcx.worker"}
    assert "rpcx.rref" not in rpcx_imports("_services/rref_protocol.py")
    assert "rpcx.rref" not in rpcx_imports("_services/rref_deletions.py")


SERVICES = ["rref.py", "functions.py",
            *(str(p.relative_to(PACKAGE)) for d in ("_services", "autograd", "nn", "optim")
              for p in sorted((PACKAGE / d).glob("*.py")))]


@pytest.mark.parametrize("module", SERVICES)
def test_services_see_the_agent_only_through_the_service_host(module: str) -> None:
    imported = rpcx_imports(module)
    assert "rpcx._core.agent" not in imported
    assert "rpcx.api" not in imported  # the public API sits above the services


def test_the_autograd_engine_does_not_import_its_service() -> None:
    assert "rpcx.autograd.service" not in rpcx_imports("autograd/engine.py")


def test_hookspecs_does_not_import_the_registry() -> None:
    assert "rpcx.registry" not in rpcx_imports("hookspecs.py")


def test_joining_the_world_is_init_time_only() -> None:
    users = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if "rpcx._core.joining" in rpcx_imports(str(p.relative_to(PACKAGE))))
    assert users == ["api.py"]


@pytest.mark.parametrize("module", ["api.py", "spawn.py", "testing/remote.py"])
def test_context_globals_are_private(module: str) -> None:
    source = (PACKAGE / module).read_text()
    assert "_context._" not in source


# ------------------------------------------------------------------ options conversion


class _Backends:
    class Own(TensorPipeRpcBackendOptions):
        def __init__(self, *, extra: int = 7, **kwargs: object) -> None:
            super().__init__(**kwargs)  # type: ignore[arg-type]
            self.extra = extra


def test_options_of_the_backends_type_pass_through() -> None:
    mine = _Backends.Own(extra=3)
    assert as_backend_options(mine, _Backends.Own) is mine
    plain = TensorPipeRpcBackendOptions()
    assert as_backend_options(plain, RpcBackendOptions) is plain  # a subclass is fine


def test_other_options_become_the_backends_type_keeping_common_fields() -> None:
    given = TensorPipeRpcBackendOptions(
        rpc_timeout=5, init_method="tcp://127.0.0.1:1", num_worker_threads=3,
        device_maps={"w1": {"cpu": "cpu"}}, auth_key="k", heartbeat_interval=0)
    converted = as_backend_options(given, _Backends.Own)
    assert type(converted) is _Backends.Own
    assert converted.extra == 7  # the backend's own field: its default
    assert (converted.rpc_timeout, converted.init_method, converted.num_worker_threads,
            converted.auth_key, converted.heartbeat_interval) == (
        5.0, "tcp://127.0.0.1:1", 3, "k", 0.0)
    assert converted.device_maps == {"w1": {torch.device("cpu"): torch.device("cpu")}}
    given.set_device_map("w2", {"cpu": "cpu"})  # the user's object stays the user's
    assert "w2" not in converted.device_maps
    converted.validate()


# -------------------------------------------------------------------------- fork state


def test_fork_state_confirmation_and_giving_up() -> None:
    state = ForkState((1, 1), WorkerInfo("w1", 1), (0, 2), confirmed=False)
    assert not state.settled and not state.confirmed
    assert not state.wait(0.01)
    state.confirm()
    assert state.settled and state.confirmed and state.wait(0)
    gone = ForkState((1, 1), WorkerInfo("w1", 1), (0, 3), confirmed=False)
    gone.give_up()
    assert gone.settled and not gone.confirmed
    assert gone.wait_settled(0) and not gone.wait(0)
