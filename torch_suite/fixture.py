"""The agent fixture torch's generated RPC suites mix in, filled in for rpcx.

torch's ``RpcAgentTestFixture`` leaves a new agent four hooks: the backend, its options,
and two regular expressions for the errors it raises when a peer has gone and when a call
timed out. torch's own TensorPipe fixture answers ``".*"`` for the shutdown one (any
message matches, so those assertions cannot fail); this one matches only rpcx's own
messages (``rpcx/_core/agent.py``), so a test that expects a dead-peer error fails if it gets
some other error.

Import it after :func:`torch_suite.shim.install`: torch's test helpers it imports bind
``torch.distributed.rpc`` at import.
"""

from __future__ import annotations

from typing import Any

from torch.testing._internal.common_distributed import tp_transports
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import (
    RpcAgentTestFixture,
)

from torch_suite.shim import backend

# rpcx's messages for a call to a worker that is gone (agent._lost_error, with the reasons
# the transports give: gloo and loopback "has shut down", any transport "is unreachable:
# ...") and for a call made after this worker itself shut down (agent.request/_close).
SHUTDOWN_ERRORS = [
    r"to worker '[^']+' failed: worker '[^']+' \(rank \d+\) has shut down",
    r"to worker '[^']+' failed: worker '[^']+' \(rank \d+\) is unreachable: ",
    r"RPC on worker '[^']+' has shut down",
    r"was cancelled: worker '[^']+' shut down",
]
# agent._timeout_error: "rpc_sync(f) to worker 'worker1' timed out after 0.101 s (timeout 0.1 s)"
TIMEOUT_ERROR = r"to worker '[^']+' timed out after [0-9.e+-]+ s \(timeout [0-9.e+-]+ s\)"


class RpcxAgentTestFixture(RpcAgentTestFixture):
    """Runs torch's RPC suites on rpcx's backend ``$TORCH_SUITE_BACKEND``."""

    @property
    def rpc_backend(self) -> Any:
        return backend()

    @property
    def rpc_backend_options(self) -> Any:
        import rpcx

        # TensorPipe's transports as torch's fixture sets them; other backends ignore them.
        return rpcx.TensorPipeRpcBackendOptions(
            init_method=self.init_method, _transports=tp_transports()
        )

    def get_shutdown_error_regex(self) -> str:
        return "|".join(f"({regex})" for regex in SHUTDOWN_ERRORS)

    def get_timeout_error_regex(self) -> str:
        return TIMEOUT_ERROR
