"""Test configuration: the rpcx conformance fixtures (--rpcx-backend, rpc_world)."""

pytest_plugins = ["rpcx.testing.fixtures"]
