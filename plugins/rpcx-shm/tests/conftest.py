"""rpcx's conformance fixtures (--rpcx-backend, rpc_world); run with --rpcx-backend=shm."""

pytest_plugins = ["rpcx.testing.fixtures"]
