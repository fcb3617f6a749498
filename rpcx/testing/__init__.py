"""rpcx's conformance kit: the suite every backend must pass, and the harness it runs on.

A backend plugin runs exactly the suite the built-in backends pass::

    # conftest.py of the plugin's tests
    pytest_plugins = ["rpcx.testing.fixtures"]

    # test_conformance.py
    from rpcx.testing.conformance import *  # noqa: F403

    # then: pytest --rpcx-backend=mybackend

Functions the suite calls remotely live in :mod:`rpcx.testing.remote`, so every worker
process can import them.
"""

from rpcx.testing.world import World, start_world

__all__ = ["World", "start_world"]
