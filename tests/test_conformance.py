"""The conformance kit (rpcx.testing.test_kit), run on every selected backend."""

from rpcx.testing.test_kit import *  # noqa: F403
