"""torch's own RPC test suites, generated for the backend under test.

``$TORCH_SUITE_BACKEND`` picks it: an rpcx backend (``gloo``, ``tensorpipe``) or ``torch``
(torch.distributed.rpc's own TensorPipe agent, for the comparison count). See README.md
for which of torch's suites run and why the others do not.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

from torch_suite import shim

BACKEND = shim.backend()
if BACKEND != "torch":
    shim.install()  # before torch's test modules bind names at import

# The parent process waits this long for a test's workers (torch's default is 300 s).
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "150")

import torch  # noqa: E402
from torch.testing._internal.common_distributed import MultiProcessTestCase  # noqa: E402
from torch.testing._internal.distributed.ddp_under_dist_autograd_test import (  # noqa: E402
    CudaDdpComparisonTest,
    DdpComparisonTest,
    DdpUnderDistAutogradTest,
)
from torch.testing._internal.distributed.nn.api.remote_module_test import (  # noqa: E402
    CudaRemoteModuleTest,
    RemoteModuleTest,
    ThreeWorkersRemoteModuleTest,
)
from torch.testing._internal.distributed.rpc.dist_autograd_test import (  # noqa: E402
    CudaDistAutogradTest,
    DistAutogradTest,
    TensorPipeAgentDistAutogradTest,
    TensorPipeCudaDistAutogradTest,
)
from torch.testing._internal.distributed.rpc.dist_optimizer_test import (  # noqa: E402
    DistOptimizerTest,
)
from torch.testing._internal.distributed.rpc.examples.parameter_server_test import (  # noqa: E402
    ParameterServerTest,
)
from torch.testing._internal.distributed.rpc.examples.reinforcement_learning_rpc_test import (  # noqa: E402
    ReinforcementLearningRpcTest,
)
from torch.testing._internal.distributed.rpc.rpc_test import (  # noqa: E402
    CudaRpcTest,
    RpcTest,
    TensorPipeAgentCudaRpcTest,
    TensorPipeAgentRpcTest,
)

# torch's GENERIC_TESTS and TENSORPIPE_TESTS (rpc_utils.py) without the TorchScript suites
# (JitRpcTest, JitDistAutogradTest): see README.md.
SUITES: list[type] = [
    RpcTest,
    ParameterServerTest,
    DistAutogradTest,
    DistOptimizerTest,
    RemoteModuleTest,
    ThreeWorkersRemoteModuleTest,
    DdpUnderDistAutogradTest,
    DdpComparisonTest,
    ReinforcementLearningRpcTest,
    TensorPipeAgentRpcTest,
    TensorPipeAgentDistAutogradTest,
]
if torch.cuda.is_available():  # every test in these needs a GPU; without one, all skip
    SUITES += [
        CudaRpcTest,
        CudaDistAutogradTest,
        CudaRemoteModuleTest,
        CudaDdpComparisonTest,
        TensorPipeAgentCudaRpcTest,
        TensorPipeCudaDistAutogradTest,
    ]


class ForkHelper(MultiProcessTestCase):
    """torch's SpawnHelper, with forked workers unless ``$TORCH_SUITE_START=spawn``.

    Spawning imports torch four times per test (seconds each on a small machine); a fork
    of the pytest process, which has started no RPC, torch threads or OpenMP pool, does not. A
    forked child would skip ``atexit`` handlers (multiprocessing ends it with os._exit),
    and an rpcx worker that returns without ``shutdown()`` leaves through one: so the
    child drops the handlers it inherited and runs its own at the end, as a spawned
    process would.
    """

    def setUp(self) -> None:
        super().setUp()
        method = os.environ.get("TORCH_SUITE_START", "fork")
        self._start_processes(torch.multiprocessing.get_context(method).Process)

    @classmethod
    def _run(  # type: ignore[override]
        cls, rank: int, test_name: str, file_name: str, parent_pipe: Any, **kwargs: Any
    ) -> None:
        if os.environ.get("TORCH_SUITE_START", "fork") != "fork":
            super()._run(rank, test_name, file_name, parent_pipe, **kwargs)
            return
        atexit._clear()
        try:
            super()._run(rank, test_name, file_name, parent_pipe, **kwargs)
        finally:
            atexit._run_exitfuncs()


if BACKEND == "torch":
    from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
        TensorPipeRpcAgentTestFixture as Fixture,
    )
else:
    from torch_suite.fixture import RpcxAgentTestFixture as Fixture

for _suite in SUITES:
    _name = f"{BACKEND.capitalize()}{_suite.__name__}"
    _class = type(_name, (_suite, Fixture, ForkHelper), {})
    _class.__module__ = __name__
    globals()[_name] = _class
del _suite, _name, _class
