"""Test configuration: the rpcx conformance fixtures (--rpcx-backend, rpc_world), a
loopback rendezvous URL of either network scheme, and ``--only-backend-tests``."""

from __future__ import annotations

import os

import pytest

from rpcx.testing.world import free_port

pytest_plugins = ["rpcx.testing.fixtures"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--only-backend-tests", action="store_true",
        help="run only the tests that depend on --rpcx-backend (they use the rpcx_backend "
             "fixture); nox's loopback session runs the others, once, not once per backend",
    )
    parser.addoption(
        "--seeds-on-torch", action="store_true",
        help="also run the seed programs on torch.distributed.rpc itself, to check that "
             "their checks hold there (nox -s seeds; ~80 s, not in nox -s tests)",
    )


# Modules whose tests each start workers of their own and share no world: xdist may send
# each test to either worker. (loadscope, which the shared-world modules need, would run
# a whole module on one worker: test_seed_programs alone is ~170 s of gloo's session.)
_INDEPENDENT_TESTS = ("tests/test_seed_programs.py", "tests/test_examples.py",
                      "tests/test_lifecycle.py", "tests/test_launch.py", "tests/test_cli.py")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    if config.getoption("dist", None) != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class _Scheduler(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(_INDEPENDENT_TESTS):
                return nodeid
            return str(super()._split_scope(nodeid))

    return _Scheduler(config, log)


WITHOUT_TORCH_RPC = "RPCX_TEST_WITHOUT_TORCH_RPC"  # set by nox -s no_torch_rpc


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(WITHOUT_TORCH_RPC):
        # The session claims torch has no RPC here: make sure (tests/no_torch_rpc).
        import torch.distributed.rpc

        if torch.distributed.rpc.is_available():
            raise pytest.UsageError(
                f"${WITHOUT_TORCH_RPC} is set but torch.distributed.rpc is available: put "
                "tests/no_torch_rpc first on PYTHONPATH")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--only-backend-tests"):
        return
    keep = [item for item in items if "rpcx_backend" in getattr(item, "fixturenames", ())]
    dropped = [item for item in items if "rpcx_backend" not in getattr(item, "fixturenames", ())]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(params=["tcp", "env"])
def loopback_rendezvous(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
                        ) -> tuple[str, int]:
    """``(init_method, port)`` on 127.0.0.1 and a free port: ``tcp://127.0.0.1:port``,
    or ``env://`` with ``MASTER_ADDR``/``MASTER_PORT`` set for the test."""
    port = free_port()
    if request.param == "env":
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        return "env://", port
    return f"tcp://127.0.0.1:{port}", port
