"""pytest plugin: backend selection and shared worlds for the conformance suite.

Options: ``--rpcx-backend NAME`` (repeatable; default: every installed backend, or the
comma-separated ``$RPCX_TEST_BACKENDS``).

Fixtures:
    rpcx_backend: the backend under test (the suite is parametrized over them).
    rpc_world: a 3-worker world on that backend, started once per test module.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from rpcx.registry import backend_names
from rpcx.testing.world import World, start_world

WORLD_SIZE = 4


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--rpcx-backend``."""
    parser.addoption(
        "--rpcx-backend", action="append", default=None,
        help="backend(s) to run the rpcx conformance suite on (default: all installed)",
    )


def selected_backends(config: pytest.Config) -> list[str]:
    """The backends chosen on the command line, in the environment, or all installed."""
    chosen = config.getoption("--rpcx-backend")
    if not chosen and os.environ.get("RPCX_TEST_BACKENDS"):
        chosen = os.environ["RPCX_TEST_BACKENDS"].split(",")
    return [name.strip() for name in chosen] if chosen else backend_names()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``rpcx_backend`` over the selected backends."""
    if "rpcx_backend" in metafunc.fixturenames:
        metafunc.parametrize(
            "rpcx_backend", selected_backends(metafunc.config), scope="module"
        )


@pytest.fixture(scope="module")
def rpc_world(rpcx_backend: str) -> Iterator[World]:
    """A world of ``worker0`` (this test process or thread) and three more workers."""
    world = start_world(rpcx_backend, WORLD_SIZE)
    try:
        yield world
    finally:
        world.close()
