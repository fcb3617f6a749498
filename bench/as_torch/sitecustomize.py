"""Run an unchanged rpcx program on torch.distributed.rpc: bench/examples.py's "torch".

Python imports ``sitecustomize`` at startup from ``sys.path``; bench/examples.py puts
this directory first on ``PYTHONPATH`` and sets ``RPCX_BENCH_AS_TORCH=1`` for its torch
runs. Every process of such a run, the workers that ``rpcx.launch`` spawns included
(they are fresh interpreters with the same environment), then imports rpcx and swaps
its public RPC API for torch's before the program's own imports run:

=====================================  =========================================================
rpcx name                              becomes
=====================================  =========================================================
``rpcx.init_rpc``                      ``torch.distributed.rpc.init_rpc``, rpcx's ``backend=``
                                       name dropped (torch's TensorPipe agent, torch's only one)
``rpcx.shutdown``                      ``torch.distributed.rpc.shutdown``
``rpcx.rpc_sync``, ``rpcx.rpc_async``  ``torch.distributed.rpc``'s
``rpcx.remote``                        ``torch.distributed.rpc.remote``
``rpcx.RRef``                          ``torch.distributed.rpc.RRef``
``rpcx.get_worker_info``               ``torch.distributed.rpc.get_worker_info``
``rpcx.TensorPipeRpcBackendOptions``   ``torch.distributed.rpc``'s
``rpcx.autograd``                      ``torch.distributed.autograd`` (the attribute and
                                       ``sys.modules["rpcx.autograd"]``)
``rpcx.optim.DistributedOptimizer``    ``torch.distributed.optim``'s
``rpcx.nn.RemoteModule``               ``torch.distributed.nn.RemoteModule``
``rpcx.functions.async_execution``     ``torch.distributed.rpc.functions``'
``rpcx.debug_info``                    ``{"backend": "torch"}``, so the examples say "on the
                                       'torch' backend" (bench/examples.py checks that they did)
=====================================  =========================================================

Everything else stays rpcx's, on purpose: ``rpcx.launch``, ``rpcx.spawn``,
``LaunchedWorker``, ``under_torchrun`` and ``rpcx.registry`` only start processes and
hand out file rendezvous (``file://...``), which torch's ``init_rpc`` and
``init_process_group`` accept as they are. If the swap fails the process exits with
status 86 rather than go on as an rpcx program under the name "torch". Without
``RPCX_BENCH_AS_TORCH=1`` this file only runs the ``sitecustomize`` it shadows (the
next one on ``sys.path``), as it does in either case.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

ENV_VAR = "RPCX_BENCH_AS_TORCH"
SWAP_FAILED_STATUS = 86


def _torch_init_rpc() -> Any:
    """torch's ``init_rpc`` behind rpcx's signature."""
    import torch.distributed.rpc as torch_rpc

    def init_rpc(name: str, backend: object = None, rank: int = -1,
                 world_size: int | None = None, rpc_backend_options: object = None) -> None:
        # rpcx's backend= names a transport ("gloo"); torch's takes a BackendType and
        # has one agent. The name only chose how rpcx.launch started the processes.
        if backend is not None and not isinstance(backend, str):
            raise TypeError(f"as_torch: backend={backend!r} is not an rpcx backend name")
        torch_rpc.init_rpc(name, rank=rank, world_size=world_size,
                           rpc_backend_options=rpc_backend_options)

    return init_rpc


def _debug_info() -> dict[str, Any]:
    """What the examples print as their backend."""
    return {"backend": "torch"}


def swap() -> None:
    """Replace rpcx's public RPC API with torch.distributed.rpc's (the table above)."""
    import torch.distributed.autograd as torch_autograd
    import torch.distributed.rpc as torch_rpc
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc.functions import async_execution

    # rpcx whole first (its package imports every submodule): its own modules must
    # find each other as they are, and only then do the program's names change.
    import rpcx
    import rpcx.functions
    import rpcx.nn
    import rpcx.optim

    patches: list[tuple[Any, str, Any]] = [
        (rpcx, "init_rpc", _torch_init_rpc()),
        (rpcx, "shutdown", torch_rpc.shutdown),
        (rpcx, "rpc_sync", torch_rpc.rpc_sync),
        (rpcx, "rpc_async", torch_rpc.rpc_async),
        (rpcx, "remote", torch_rpc.remote),
        (rpcx, "RRef", torch_rpc.RRef),
        (rpcx, "get_worker_info", torch_rpc.get_worker_info),
        (rpcx, "TensorPipeRpcBackendOptions", torch_rpc.TensorPipeRpcBackendOptions),
        (rpcx, "autograd", torch_autograd),
        (rpcx.optim, "DistributedOptimizer", DistributedOptimizer),
        (rpcx.nn, "RemoteModule", RemoteModule),
        (rpcx.functions, "async_execution", async_execution),
        (rpcx, "debug_info", _debug_info),
    ]
    for module, name, value in patches:
        if not hasattr(module, name):  # a renamed rpcx name would otherwise go unswapped
            raise AttributeError(f"{module.__name__} has no {name!r} to swap")
        setattr(module, name, value)
    # `import rpcx.autograd as dist_autograd` looks in sys.modules first.
    sys.modules["rpcx.autograd"] = torch_autograd


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path``, the one this file shadows."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_chain()
if os.environ.get(ENV_VAR) == "1":
    try:
        swap()
    except BaseException as exc:  # site.py would print one line and go on as rpcx
        print(f"bench/as_torch: cannot swap rpcx for torch.distributed.rpc: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(SWAP_FAILED_STATUS)
