pytest_plugins = ["rpcx.testing.fixtures"]
