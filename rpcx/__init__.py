"""rpcx: torch.distributed.rpc's API on pluggable transports.

``import rpcx as rpc`` is a drop-in for programs written against the call API of
``torch.distributed.rpc``: the same functions, arguments, options and futures, with the
transport chosen by name (``init_rpc(backend="gloo")``, ``$RPCX_BACKEND``).
"""

import rpcx._util.torch_import  # noqa: F401  (first: torch without its numpy warning)
from rpcx import autograd, for_torch, functions, nn, optim
from rpcx._util import moved as _moved
from rpcx._world.membership_events import MembershipChange
from rpcx.api import (
    UNSET_RPC_TIMEOUT,
    _set_rpc_timeout,
    debug_info,
    get_rpc_timeout,
    get_worker_info,
    get_worker_infos,
    init_rpc,
    is_available,
    on_membership_change,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from rpcx.errors import (
    AuthenticationError,
    BackendNotFoundError,
    InvalidWorkerNameError,
    LostCause,
    PeerLostError,
    ProtocolError,
    RemoteException,
    RemoteTraceback,
    RpcError,
    RpcNotInitializedError,
    RpcShutdownError,
    RpcTimeoutError,
    SerializationError,
    UnknownWorkerError,
)
from rpcx.for_torch import stop_using_for_torch, use_for_torch, used_for_torch
from rpcx.futures import RpcFuture
from rpcx.launcher import LaunchedWorker, launch, under_torchrun
from rpcx.options import (
    DEFAULT_INIT_METHOD,
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
)
from rpcx.registry import DEFAULT_BACKEND, BackendType, available_backends, backend_names
from rpcx.rref import RRef
from rpcx.spawn import WorkerFailedError, spawn
from rpcx.worker import WorkerInfo

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_BACKEND",
    "DEFAULT_INIT_METHOD",
    "DEFAULT_NUM_WORKER_THREADS",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "UNSET_RPC_TIMEOUT",
    "AuthenticationError",
    "BackendNotFoundError",
    "BackendType",
    "InvalidWorkerNameError",
    "LaunchedWorker",
    "LostCause",
    "MembershipChange",
    "PeerLostError",
    "ProtocolError",
    "RRef",
    "RemoteException",
    "RemoteTraceback",
    "RpcBackendOptions",
    "RpcError",
    "RpcFuture",
    "RpcNotInitializedError",
    "RpcShutdownError",
    "RpcTimeoutError",
    "SerializationError",
    "TensorPipeRpcBackendOptions",
    "UnknownWorkerError",
    "WorkerFailedError",
    "WorkerInfo",
    "_set_rpc_timeout",
    "autograd",
    "available_backends",
    "backend_names",
    "debug_info",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "get_worker_infos",
    "init_rpc",
    "is_available",
    "launch",
    "nn",
    "on_membership_change",
    "optim",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    "spawn",
    "stop_using_for_torch",
    "under_torchrun",
    "use_for_torch",
    "used_for_torch",
]

_moved.install()  # (the module paths of rpcx 0.1 keep working for one release, with a warning)

if for_torch.switch_requested():  # (also when the start-up hook is not installed)
    try:
        for_torch.use_for_torch(origin=for_torch.origin_of_variable())
    except RuntimeError as _exc:  # a torch without RPC: rpcx itself works without it
        import warnings as _warnings

        _warnings.warn(f"RPCX_FOR_TORCH is set, but {_exc}", RuntimeWarning, stacklevel=2)
