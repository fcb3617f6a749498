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
through ``torch.distributed.rpc.api`` and, where the switch replaced a name there,
through torch's original (:mod:`rpcx.torch_originals`).
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

from rpcx import api, autograd, nn, optim, torch_originals
from rpcx._core import context as _context
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


def _is_current_rpc_agent_set() -> bool:
    """torch's "is RPC up?", under the switch: an rpcx worker runs here (or torch's own
    agent does, which rpcx's tensorpipe backend starts)."""
    if _context.maybe_current_agent() is not None:
        return True
    torch_rpc_api = sys.modules["torch.distributed.rpc.api"]
    return bool(torch_originals.original(torch_rpc_api, "_is_current_rpc_agent_set")())


class AgentView:
    """What ``torch.distributed.rpc._get_current_rpc_agent()`` returns under the switch:
    the parts of torch's agent that libraries call, answered by rpcx's worker."""

    def get_worker_info(self, worker_name: str | None = None) -> WorkerInfo:
        """This worker's, or ``worker_name``'s, :class:`~rpcx.WorkerInfo`."""
        return api.get_worker_info(worker_name)

    def get_worker_infos(self) -> list[WorkerInfo]:
        """Every worker's :class:`~rpcx.WorkerInfo`."""
        return api.get_worker_infos()

    def _get_device_map(self, to: WorkerInfo) -> dict[torch.device, torch.device]:
        """The device map of requests to ``to`` (empty: CPU only), as torch's agent's."""
        return dict(_context.current_agent().routes.outgoing.get(to.id, {}))

    def get_debug_info(self) -> dict[str, str]:
        """rpcx's :func:`~rpcx.debug_info`, its values as strings (torch's shape)."""
        return {key: str(value) for key, value in api.debug_info().items()}


def _get_current_rpc_agent() -> AgentView:
    if _context.maybe_current_agent() is None:
        raise RuntimeError("Current RPC agent is not set!")  # torch's words
    return AgentView()


class _Gathering:
    """One all-gather on one worker: the objects that reached it, and when complete."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.complete = threading.Event()


_gather_lock = threading.Lock()
# Per worker (id of its agent): in-process backends run several workers in one process.
_gatherings: dict[tuple[int, str], _Gathering] = {}
_gather_rounds: dict[tuple[int, tuple[str, ...]], int] = {}


def _gathering(key: str) -> _Gathering:
    """This worker's state of gathering ``key`` (created by whichever message is first)."""
    with _gather_lock:
        return _gatherings.setdefault((id(_context.current_agent()), key), _Gathering())


def _all_gather(obj: Any, worker_names: Any = None, timeout: float = -1.0) -> dict[str, Any]:
    """torch's ``rpc.api._all_gather`` under the switch: every named worker's ``obj``, by
    worker name, once all of them called it (the same calls in the same order on each).

    As torch's: the worker with the smallest name gathers, then sends the result to the
    others; with ``timeout`` unset (``-1``) the calls take the RPC timeout and the wait
    for the other workers is unbounded, ``0`` bounds neither, another value both."""
    names = sorted(set(worker_names or (w.name for w in api.get_worker_infos())))
    me = api.get_worker_info().name
    if me not in names:
        raise RuntimeError(f"_all_gather on worker {me!r}: it is not among {names}")
    leader = names[0]
    call_timeout = api.get_rpc_timeout() if timeout < 0 else timeout
    wait_bound = timeout if timeout > 0 else None
    agent = id(_context.current_agent())
    with _gather_lock:
        round_ = _gather_rounds.get((agent, tuple(names)), 0)
        _gather_rounds[(agent, tuple(names))] = round_ + 1
    key = "\0".join([*names, str(round_)])
    try:
        if me == leader:
            _arrive(key, me, obj, len(names))
        else:
            api.rpc_sync(leader, _arrive, args=(key, me, obj, len(names)),
                         timeout=call_timeout)
        gathering = _gathering(key)
        if not gathering.complete.wait(wait_bound):
            raise RuntimeError(f"_all_gather on worker {me!r}: not every one of {names} "
                               f"took part within {timeout:g} s")
        if me == leader:
            futures = {name: api.rpc_async(name, _deliver, args=(key, gathering.objects),
                                           timeout=call_timeout)
                       for name in names if name != me}
            errors = []
            for name, future in futures.items():
                try:
                    future.wait()
                except Exception as exc:
                    errors.append(f"{name}: {exc}")
            if errors:
                raise RuntimeError(f"_all_gather on worker {me!r}: the result did not reach "
                                   f"every worker ({'; '.join(errors)})")
        return dict(gathering.objects)
    finally:
        with _gather_lock:
            _gatherings.pop((agent, key), None)


def _arrive(key: str, name: str, obj: Any, expected: int) -> None:
    """On the leader: ``name``'s object for gathering ``key``."""
    gathering = _gathering(key)
    with _gather_lock:
        if name in gathering.objects:
            raise RuntimeError(f"_all_gather: worker {name!r} took part twice in one round")
        gathering.objects[name] = obj
        if len(gathering.objects) == expected:
            gathering.complete.set()


def _deliver(key: str, objects: dict[str, Any]) -> None:
    """On a follower: the leader's gathered objects for ``key``."""
    gathering = _gathering(key)
    gathering.objects = objects
    gathering.complete.set()


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
        # Private names libraries use (PyG's distributed layer, PiPPy, machin): whether
        # RPC is up (torch's own require-initialized decorator reads the api module's),
        # the current agent, and torch's RPC all-gather. The api module's
        # _get_current_rpc_agent stays torch's: torch's functions, which rpcx's
        # tensorpipe backend calls, read it.
        (rpc + ".api", "_is_current_rpc_agent_set", _is_current_rpc_agent_set),
        ("torch._C._distributed_rpc", "_is_current_rpc_agent_set", _is_current_rpc_agent_set),
        (rpc, "_is_current_rpc_agent_set", _is_current_rpc_agent_set),
        (rpc, "_get_current_rpc_agent", _get_current_rpc_agent),
        (rpc + ".api", "_all_gather", _all_gather),
    ]


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.saved = torch_originals.saved  # torch's objects, while switched
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
