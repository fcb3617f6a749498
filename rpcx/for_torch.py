"""One switch that makes torch's RPC API be rpcx's, for code that imports torch's names.

A program can change ``import torch.distributed.rpc as rpc`` into ``import rpcx as rpc``;
a library that imports torch's RPC itself (TorchRL's collectors and replay buffers) gives
its user no import to change. :func:`use_for_torch` points torch's public RPC names at
rpcx's, in the modules where programs and libraries look them up:

* ``torch.distributed.rpc``: ``init_rpc``, ``shutdown``, ``rpc_sync``, ``rpc_async``,
  ``remote``, ``get_worker_info``, ``get_rpc_timeout``, ``RRef``, ``PyRRef``,
  ``WorkerInfo``, ``BackendType``, ``RpcBackendOptions``, ``TensorPipeRpcBackendOptions``;
* ``torch._C._distributed_rpc.PyRRef``, which libraries test RRefs against with
  ``isinstance`` (on torch, ``rpc.remote()`` returns that class);
* ``torch.distributed.autograd``: ``context``, ``backward``, ``get_gradients``;
* ``torch.distributed.optim.DistributedOptimizer`` and ``torch.distributed.nn.RemoteModule``
  (and the modules that define them).

``torch.distributed.rpc.functions.async_execution`` stays torch's: rpcx runs functions it
marked as its own. Names bound before the switch (``from torch.distributed.rpc import
rpc_sync`` run earlier) keep torch's objects; the start-up hook turns the switch on as
soon as torch is imported, before any library's imports run: set ``RPCX_FOR_TORCH=1``
in the environment of every process of the job (``_rpcx_for_torch.py`` and the
``rpcx-for-torch.pth`` file that runs it at interpreter start-up, installed with rpcx).

``init_rpc`` under the switch reads torch's ``BackendType.TENSORPIPE`` (what libraries
pass; torch has no other backend) as "no backend named": the backend is the one given
to :func:`use_for_torch`, else ``$RPCX_BACKEND``, else rpcx's default. rpcx's own
``tensorpipe`` backend keeps working with the switch on: it reaches torch's agent
through modules the switch leaves alone.
"""

from __future__ import annotations

import enum
import importlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from rpcx import api, autograd, nn, optim
from rpcx.options import RpcBackendOptions, TensorPipeRpcBackendOptions
from rpcx.registry import BackendType
from rpcx.rref import RRef
from rpcx.worker import WorkerInfo

__all__ = ["ENV_VAR", "stop_using_for_torch", "use_for_torch", "used_for_torch"]

log = logging.getLogger("rpcx.for_torch")

ENV_VAR = "RPCX_FOR_TORCH"
"""Set (to anything but ``""``, ``0``, ``false``, ``no``, ``off``) to turn the switch on
in every process at interpreter start-up."""


def _init_rpc(
    name: str,
    backend: object = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: object = None,
) -> None:
    """``torch.distributed.rpc.init_rpc`` under the switch: rpcx's, on the switch's
    backend unless the caller named an rpcx one."""
    if backend is None or _is_torch_default(backend):
        backend = _state.backend
    api.init_rpc(name, backend, rank, world_size, rpc_backend_options)


def _is_torch_default(backend: object) -> bool:
    """torch's own backend choice (its only one), by whichever ``BackendType`` it came."""
    return isinstance(backend, enum.Enum) and backend.name == "TENSORPIPE"


def _replacements() -> list[tuple[str, str, object]]:
    """(module, attribute, rpcx's object) for every name the switch points at rpcx."""
    rpc = "torch.distributed.rpc"
    return [
        (rpc, "init_rpc", _init_rpc),
        (rpc, "shutdown", api.shutdown),
        (rpc, "rpc_sync", api.rpc_sync),
        (rpc, "rpc_async", api.rpc_async),
        (rpc, "remote", api.remote),
        (rpc, "get_worker_info", api.get_worker_info),
        (rpc, "get_rpc_timeout", api.get_rpc_timeout),
        (rpc, "RRef", RRef),
        (rpc, "PyRRef", RRef),
        ("torch._C._distributed_rpc", "PyRRef", RRef),
        (rpc, "WorkerInfo", WorkerInfo),
        (rpc, "BackendType", BackendType),
        (rpc, "RpcBackendOptions", RpcBackendOptions),
        (rpc, "TensorPipeRpcBackendOptions", TensorPipeRpcBackendOptions),
        ("torch.distributed.autograd", "context", autograd.context),
        ("torch.distributed.autograd", "backward", autograd.backward),
        ("torch.distributed.autograd", "get_gradients", autograd.get_gradients),
        ("torch.distributed.optim", "DistributedOptimizer", optim.DistributedOptimizer),
        ("torch.distributed.optim.optimizer", "DistributedOptimizer",
         optim.DistributedOptimizer),
        ("torch.distributed.nn", "RemoteModule", nn.RemoteModule),
        ("torch.distributed.nn.api.remote_module", "RemoteModule", nn.RemoteModule),
    ]


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.saved: dict[tuple[str, str], object] = {}  # torch's objects, while switched
        self.origin: str | None = None  # where the switch was turned on
        self.backend: str | None = None


_state = _State()


def use_for_torch(backend: str | None = None, *, origin: str | None = None) -> None:
    """Point torch's RPC names at rpcx's (see the module docstring for the list).

    Args:
        backend: the rpcx backend ``torch.distributed.rpc.init_rpc`` uses when its caller
            names none (or torch's ``TENSORPIPE``); ``None``: ``$RPCX_BACKEND``, else
            rpcx's default.
        origin: what turned the switch on, for :func:`used_for_torch` and ``rpcx
            doctor`` (default: the caller's file and line).

    Calling it again changes the backend and keeps the first origin. Raises
    ``RuntimeError`` when this torch has no RPC package (``torch.distributed.rpc`` does
    not import): there is nothing to point anywhere, and rpcx works without it.
    """
    if origin is None:
        caller = sys._getframe(1)
        origin = f"rpcx.use_for_torch() at {caller.f_code.co_filename}:{caller.f_lineno}"
    with _state.lock:
        if _state.origin is None and not _module("torch.distributed.rpc").is_available():
            raise RuntimeError(
                f"rpcx.use_for_torch(): this torch {torch.__version__} was built without "
                "distributed RPC (torch.distributed.rpc.is_available() is False), so there "
                "are no names of torch's for rpcx to stand in for; rpcx itself works without "
                "it: import rpcx"
            )
        _state.backend = backend
        if _state.origin is not None:
            return
        # Everything is looked up before anything changes: a torch that lacks a name
        # leaves torch's names as they were.
        targets = []
        for module_name, attribute, replacement in _replacements():
            module = _module(module_name)
            try:
                original = getattr(module, attribute)
            except AttributeError as exc:
                raise RuntimeError(
                    f"rpcx.use_for_torch(): this torch {torch.__version__} has no "
                    f"{module_name}.{attribute} to stand in for") from exc
            targets.append((module, module_name, attribute, original, replacement))
        for module, module_name, attribute, original, replacement in targets:
            _state.saved[(module_name, attribute)] = original
            setattr(module, attribute, replacement)
        _state.origin = origin
    log.debug("torch's RPC names point at rpcx (%s)", origin)


def stop_using_for_torch() -> None:
    """Give torch its own RPC names back (a no-op when the switch is off)."""
    with _state.lock:
        for (module_name, attribute), original in _state.saved.items():
            module = sys.modules.get(module_name)
            if module is not None:
                setattr(module, attribute, original)
        _state.saved.clear()
        _state.origin = None
        _state.backend = None


def used_for_torch() -> str | None:
    """Where the switch was turned on (``None``: torch's RPC names are torch's)."""
    return _state.origin


def switch_requested(environ: Callable[[str, str], str] = os.environ.get) -> bool:
    """Whether ``$RPCX_FOR_TORCH`` asks for the switch."""
    return environ(ENV_VAR, "").strip().lower() not in ("", "0", "false", "no", "off")


def hook_ran() -> bool:
    """Whether the start-up hook ran in this process (it loads itself as
    ``rpcx_startup``)."""
    return "rpcx_startup" in sys.modules


def origin_of_variable() -> str:
    """What turned the switch on when ``$RPCX_FOR_TORCH`` did: the start-up hook (it
    loads itself as ``rpcx_startup``), or rpcx's own import."""
    hook = sys.modules.get("rpcx_startup")
    return str(getattr(hook, "ORIGIN", f"${ENV_VAR}, when rpcx was imported"))


def _module(name: str) -> Any:
    try:
        with warnings.catch_warnings():
            # torch.distributed.nn and .optim script their functional forms with
            # torch.jit on import, which torch itself reports as deprecated: torch's
            # own use, not the program's, so not printed on its behalf.
            warnings.simplefilter("ignore", DeprecationWarning)
            return importlib.import_module(name)
    except ImportError as exc:
        raise RuntimeError(
            f"rpcx.use_for_torch(): {name} cannot be imported ({exc}); this torch "
            f"{torch.__version__} has no RPC package for rpcx to stand in for (rpcx itself "
            "works without it: import rpcx)"
        ) from exc
