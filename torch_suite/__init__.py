"""torch's own RPC test suite, run against rpcx (see README.md)."""
