"""The systems under comparison: torch.distributed.rpc and each rpcx backend.

A benchmark program is written once against the namespace :func:`api` returns (the
modules a torch RPC program imports); only the modules differ between systems, exactly
as in a program ported with ``import rpcx as rpc``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

BUILTIN_SYSTEMS = ("torch", "gloo", "tensorpipe", "loopback")
# A system is a backend name, optionally with flags: "gloo+auth" runs gloo with a world
# key (rpcx.auth: every frame's header MACed), "gloo+auth+payload" MACs tensors too.
AUTH_FLAG, PAYLOAD_FLAG = "auth", "payload"
BENCH_KEY = "rpcx-bench-key-0123456789abcdef"
BASELINE = "torch"
RPC_TIMEOUT_S = 60.0  # every call's default timeout: a lost reply becomes an error, not a hang
NUM_WORKER_THREADS = 16


def default_systems() -> str:
    """The default ``--systems``: torch, the built-in backends, then every installed
    plugin's backend (``nox -s bench`` installs the plugins under ``plugins/``)."""
    try:
        import rpcx
    except ImportError:
        return ",".join(BUILTIN_SYSTEMS)
    plugins = sorted(set(rpcx.backend_names()) - set(BUILTIN_SYSTEMS))
    return ",".join((*BUILTIN_SYSTEMS, *plugins))


def api(system: str) -> SimpleNamespace:
    """``rpc``, ``dist_autograd`` and ``DistributedOptimizer`` of ``system``.

    ``torch`` gives torch.distributed's own modules; any other name gives rpcx's (the
    backend is chosen in :func:`init_worker`).
    """
    if system == BASELINE:
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        from torch.distributed.optim import DistributedOptimizer
    else:
        import rpcx as rpc
        import rpcx.autograd as dist_autograd
        from rpcx.optim import DistributedOptimizer
    return SimpleNamespace(
        system=system, rpc=rpc, dist_autograd=dist_autograd,
        DistributedOptimizer=DistributedOptimizer,
    )


def backend_of(system: str) -> str:
    """The rpcx backend (or ``torch``) that ``system`` runs: its name before any ``+``."""
    return system.split("+", 1)[0]


def _flags(system: str) -> set[str]:
    return set(system.split("+")[1:])


def in_process(system: str) -> bool:
    """Whether ``system``'s workers are threads of one process (rpcx's loopback)."""
    if system == BASELINE:
        return False
    from rpcx.registry import resolve_backend

    return resolve_backend(backend_of(system)).capabilities.in_process


def init_worker(
    ns: SimpleNamespace, name: str, rank: int, world_size: int, init_method: str
) -> None:
    """``init_rpc`` on ``ns``'s system with the options every system gets alike."""
    extra: dict[str, Any] = {}
    if AUTH_FLAG in _flags(ns.system):
        extra = {"auth_key": BENCH_KEY, "auth_payload": PAYLOAD_FLAG in _flags(ns.system)}
    options = ns.rpc.TensorPipeRpcBackendOptions(
        init_method=init_method, num_worker_threads=NUM_WORKER_THREADS,
        rpc_timeout=RPC_TIMEOUT_S, **extra,
    )
    kwargs: dict[str, Any] = {} if ns.system == BASELINE else {"backend": backend_of(ns.system)}
    ns.rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options,
                    **kwargs)


def missing_requirement(system: str) -> str | None:
    """Why ``system`` cannot run on this machine, or ``None``."""
    if system == BASELINE:
        try:
            import numpy  # noqa: F401
        except ImportError:
            return "torch.distributed.rpc's TensorPipe init_rpc needs numpy: pip install numpy"
    else:
        try:
            import rpcx
        except ImportError as exc:
            return f"rpcx does not import: {exc}"
        unknown = _flags(system) - {AUTH_FLAG, PAYLOAD_FLAG}
        if unknown or (PAYLOAD_FLAG in _flags(system) and AUTH_FLAG not in _flags(system)):
            return (f"system {system!r}: flags are +{AUTH_FLAG} and +{AUTH_FLAG}+"
                    f"{PAYLOAD_FLAG}")
        if backend_of(system) not in rpcx.backend_names():
            return (f"unknown system {system!r}: neither torch nor an installed rpcx backend "
                    f"({', '.join(rpcx.backend_names())})")
    return None
