"""rpcx's whole conformance kit, on whichever backend ``--rpcx-backend`` names (zmq)."""

from rpcx.testing.test_kit import *  # noqa: F403
