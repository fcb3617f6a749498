"""Point torch's public RPC names at rpcx, the way a migrated program would.

torch's test modules are written against ``torch.distributed.rpc``,
``torch.distributed.autograd``, ``torch.distributed.optim.DistributedOptimizer`` and
``torch.distributed.nn.RemoteModule``. :func:`install` replaces those *public* names with
rpcx's, before the test modules are imported (they bind some names at import time:
``from torch.distributed.rpc import RRef, WorkerInfo``).

``torch.distributed.rpc`` and ``torch.distributed.autograd`` are replaced by stand-in
module objects (in ``sys.modules`` and as attributes of ``torch.distributed``) rather than
patched in place: rpcx's tensorpipe backend drives torch's own agent through the real
modules (``torch.distributed.rpc.rpc_async``, ``TensorPipeRpcBackendOptions``), and it
keeps its references to them. Anything the stand-ins do not override (private helpers such
as ``_get_debug_info``, ``rpc.api``, ``rpc.constants``) falls through to torch's module, so
a test that reaches into torch's internals runs torch's code, against an agent that was
never started, and fails: those failures are listed in docs/compatibility.md as "private".
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

# torch.distributed.rpc names rpcx implements (torch's __all__, plus the public names
# outside it that programs use). Everything else falls through to torch.
RPC_NAMES = [
    "BackendType",
    "RRef",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "_set_rpc_timeout",  # private in torch, but rpcx keeps it on purpose (api.py)
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
AUTOGRAD_NAMES = ["backward", "context", "get_gradients"]

_installed: str | None = None


def backend() -> str:
    """The backend under test: ``$TORCH_SUITE_BACKEND`` (an rpcx backend, or ``torch``)."""
    return os.environ.get("TORCH_SUITE_BACKEND", "gloo")


def _stand_in(real: types.ModuleType, overrides: dict[str, Any]) -> types.ModuleType:
    module = types.ModuleType(real.__name__, real.__doc__)
    for attr in ("__file__", "__path__", "__package__", "__spec__", "__loader__"):
        if hasattr(real, attr):
            setattr(module, attr, getattr(real, attr))
    module.__dict__.update(overrides)

    def __getattr__(name: str) -> Any:  # module-level __getattr__ (PEP 562)
        return getattr(real, name)

    module.__dict__["__getattr__"] = __getattr__
    module.__dict__["_rpcx_real_module"] = real
    return module


def install() -> None:
    """Make torch's public RPC, autograd, optimizer and RemoteModule names rpcx's."""
    global _installed
    if _installed:
        return
    import torch.distributed as dist
    import torch.distributed.autograd as real_autograd
    import torch.distributed.nn as real_nn
    import torch.distributed.nn.api.remote_module as real_remote_module
    import torch.distributed.optim as real_optim
    import torch.distributed.rpc as real_rpc

    import rpcx
    import rpcx.autograd
    import rpcx.functions
    import rpcx.nn
    import rpcx.optim
    from rpcx.registry import available_backends

    # Load every backend now, so the tensorpipe backend binds torch's real modules.
    available_backends()

    rpc = _stand_in(real_rpc, {name: getattr(rpcx, name) for name in RPC_NAMES}
                    | {"functions": rpcx.functions})
    autograd = _stand_in(
        real_autograd, {name: getattr(rpcx.autograd, name) for name in AUTOGRAD_NAMES}
    )
    sys.modules["torch.distributed.rpc"] = rpc
    sys.modules["torch.distributed.autograd"] = autograd
    dist.rpc = rpc  # type: ignore[attr-defined]
    dist.autograd = autograd  # type: ignore[attr-defined]
    # optim and nn hold much besides RPC (ZeroRedundancyOptimizer, functional
    # collectives) that rpcx never calls: patching the one name in place is enough.
    real_optim.DistributedOptimizer = rpcx.optim.DistributedOptimizer  # type: ignore[attr-defined,misc]
    real_nn.RemoteModule = rpcx.nn.RemoteModule  # type: ignore[attr-defined,misc]
    real_remote_module.RemoteModule = rpcx.nn.RemoteModule  # type: ignore[misc]
    _installed = "rpcx"
