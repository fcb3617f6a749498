"""The conformance suite, run on every selected backend (see rpcx.testing)."""

from rpcx.testing.conformance import *  # noqa: F403
from rpcx.testing.conformance_parity import *  # noqa: F403
