"""rpcx's conformance kit: the suite every backend must pass, and the harness it runs on.

A backend plugin runs exactly the suite the built-in backends pass, from the installed
package::

    pytest -p rpcx.testing.fixtures --pyargs rpcx.testing --rpcx-backend=mybackend

That collects :mod:`rpcx.testing.test_kit`, which gathers every group of the kit. Tests
marked ``rpcx_requires`` skip, saying why, on a backend whose capabilities lack a flag
(see :mod:`rpcx.testing.fixtures`).

Functions the suite calls remotely live in :mod:`rpcx.testing.remote`, so every worker
process can import them.
"""

from rpcx.testing.world import World, start_world

__all__ = ["World", "start_world"]
