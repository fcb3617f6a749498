"""pytest plugin: backend selection and shared worlds for the conformance suite.

Options: ``--rpcx-backend NAME`` (repeatable; default: every installed backend, or the
comma-separated ``$RPCX_TEST_BACKENDS``).

Marker: ``@pytest.mark.rpcx_requires("multi_process", reason=...)`` skips a test on a
backend whose :class:`~rpcx.transport.Capabilities` lack any of the named flags, saying
which flag is missing and why the test needs it.

The fixtures:

- ``rpcx_backend``: the backend under test (the suite is parametrized over them).
- ``rpc_world``: a 4-worker world on that backend, shared by a module's tests.
- ``rpc_world_keeper``: closes that world for a test that needs a world of its own.

It also loads :mod:`rpcx.testing.backstop`: a test hung where pytest-timeout cannot end
it (inside a C++ call) still ends its process, with every thread's stack printed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from rpcx.registry import backend_names, resolve_backend
from rpcx.testing.world import World, start_world

pytest_plugins = ["rpcx.testing.backstop"]

WORLD_SIZE = 4


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--rpcx-backend``."""
    parser.addoption(
        "--rpcx-backend", action="append", default=None,
        help="backend(s) to run the rpcx conformance suite on (default: all installed)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Declare the ``rpcx_requires`` marker."""
    config.addinivalue_line(
        "markers",
        "rpcx_requires(*capabilities, reason): skip unless the backend under test declares "
        "every named Capabilities flag",
    )
    config.addinivalue_line(
        "markers", "long: a kit test that takes tens of seconds (deselect with -m 'not long')")


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


class WorldKeeper:
    """The shared world of a test module: started on first use, closable for a test
    that needs this process free (its own world), started again by the next user."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._world: World | None = None

    def world(self) -> World:
        """The shared world, started if it is not running."""
        if self._world is None:
            self._world = start_world(self.backend, WORLD_SIZE)
        return self._world

    def close(self) -> None:
        """Close the shared world if it is running."""
        world, self._world = self._world, None
        if world is not None:
            world.close()


@pytest.fixture(scope="module")
def rpc_world_keeper(rpcx_backend: str) -> Iterator[WorldKeeper]:
    """The module's :class:`WorldKeeper` (closed with the module)."""
    keeper = WorldKeeper(rpcx_backend)
    try:
        yield keeper
    finally:
        keeper.close()


@pytest.fixture
def rpc_world(rpc_world_keeper: WorldKeeper) -> World:
    """A world of ``worker0`` (this test process or thread) and three more workers.

    Shared by the tests of a module (per pytest-xdist worker): started once, and again
    only after a test that needed this process for a world of its own (``TestPeerDeath``:
    a crash ends a world) closed it.
    """
    return rpc_world_keeper.world()


@pytest.fixture(autouse=True)
def _rpcx_requires(request: pytest.FixtureRequest) -> None:
    """Skip a test marked ``rpcx_requires`` on a backend that lacks a capability."""
    marker = request.node.get_closest_marker("rpcx_requires")
    if marker is None or "rpcx_backend" not in request.fixturenames:
        return
    backend = request.getfixturevalue("rpcx_backend")
    capabilities = resolve_backend(backend).capabilities
    missing = [flag for flag in marker.args if not getattr(capabilities, flag)]
    if missing:
        why = marker.kwargs.get("reason", "")
        pytest.skip(f"backend {backend!r} does not declare {', '.join(missing)}"
                    + (f": {why}" if why else ""))
