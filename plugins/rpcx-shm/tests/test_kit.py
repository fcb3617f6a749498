"""rpcx's conformance kit, whole, on this plugin's backend (``--rpcx-backend=shm``)."""

from rpcx.testing.test_kit import *  # noqa: F403
