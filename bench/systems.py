"""The systems under comparison: torch.distributed.rpc and each rpcx backend.

A benchmark program is written once against the namespace :func:`api` returns (the
modules a torch RPC program imports); only the modules differ between systems, exactly
as in a program ported with ``import rpcx as rpc``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from types import SimpleNamespace
from typing import Any

# Without rpcx (or before its registry answers), the systems named when none are given.
FALLBACK_SYSTEMS = ("torch",)
# A system is a backend name, optionally with flags: "gloo+auth" runs gloo with a world
# key (rpcx._wire.auth: every frame's header MACed), "gloo+auth+payload" MACs tensors too,
# "tcp+auth+encrypt" encrypts every frame between every pair (rpcx._wire.cipher, encrypt=
# "always": one host's pairs too, so a one-host run measures the cipher); "auto+trace"
# records every call with rpcx.tracing (files written at shutdown, outside the timed part).
# "tcp+certs" keys the world with certificates instead of BENCH_KEY (rpcx._world.enrollment:
# rank 0 hands the key over mutual TLS), unencrypted; "tcp+certs+encrypt" every pair too.
AUTH_FLAG, PAYLOAD_FLAG, ENCRYPT_FLAG, TRACE_FLAG = "auth", "payload", "encrypt", "trace"
CERTS_FLAG = "certs"
BENCH_KEY = "rpcx-bench-key-0123456789abcdef"
BASELINE = "torch"
RPC_TIMEOUT_S = 60.0  # every call's default timeout: a lost reply becomes an error, not a hang
NUM_WORKER_THREADS = 16


def default_backend() -> str | None:
    """The backend ``init_rpc`` uses when none is named (``rpcx.registry.DEFAULT_BACKEND``,
    read now, so a change of default shows without touching the bench), or ``None``."""
    try:
        from rpcx import registry
    except ImportError:
        return None
    name = getattr(registry, "DEFAULT_BACKEND", None)
    return str(name) if name else None


def default_systems() -> str:
    """The default ``--systems``: torch, the default backend, the other built-in backends,
    then every installed plugin's backend (``nox -s bench`` installs the plugins under
    ``plugins/``), all as rpcx's registry lists them now: a backend built in later shows
    up without a change here."""
    try:
        import rpcx
    except ImportError:
        return ",".join(FALLBACK_SYSTEMS)
    names = list(rpcx.backend_names())
    builtin = set(names)
    try:
        from rpcx.registry import available_backends

        specs = available_backends()
        # Built-ins register first, in their own order; plugins are labelled by entry point.
        names = list(specs)
        builtin = {n for n, spec in specs.items()
                   if str(getattr(spec, "plugin", "")).startswith("rpcx.")}
    except Exception:  # an older registry: names only, all taken as they come
        pass
    default = default_backend()
    first = [default] if default in names else []
    rest = [n for n in names if n not in first]
    ordered = ([BASELINE, *first, *(n for n in rest if n in builtin),
                *sorted(n for n in rest if n not in builtin)])
    return ",".join(ordered)


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
        if ENCRYPT_FLAG in _flags(ns.system):
            extra["encrypt"] = "always"
    if CERTS_FLAG in _flags(ns.system):
        extra = {**_bench_certificates(),
                 "encrypt": "always" if ENCRYPT_FLAG in _flags(ns.system) else False}
    if TRACE_FLAG in _flags(ns.system):
        extra["trace_dir"] = os.path.join(tempfile.gettempdir(), f"rpcx-bench-trace-{os.getppid()}")
    options = ns.rpc.TensorPipeRpcBackendOptions(
        init_method=init_method, num_worker_threads=NUM_WORKER_THREADS,
        rpc_timeout=RPC_TIMEOUT_S, **extra,
    )
    kwargs: dict[str, Any] = {} if ns.system == BASELINE else {"backend": backend_of(ns.system)}
    ns.rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options,
                    **kwargs)


def _bench_certificates() -> dict[str, str]:
    """The ``tls_*`` options of a CA and certificate made once per benchmark run (by
    whichever worker comes first; the run's workers share the runner as parent)."""
    from rpcx.testing.certificates import make_site

    final = os.path.join(tempfile.gettempdir(), f"rpcx-bench-certs-{os.getppid()}")
    if not os.path.exists(os.path.join(final, "ca.crt")):
        made = tempfile.mkdtemp(prefix="rpcx-bench-certs-")
        make_site(made, ["bench"])
        try:
            os.rename(made, final)  # (atomic: a worker that lost the race uses the winner's)
        except OSError:
            shutil.rmtree(made, ignore_errors=True)
    return {"tls_ca": os.path.join(final, "ca.crt"),
            "tls_cert": os.path.join(final, "bench.crt"),
            "tls_key": os.path.join(final, "bench.key")}


def interface_variables(system: str, interface: str) -> dict[str, str]:
    """What ``system`` is told on a host whose network interface is ``interface``, across
    hosts (placement.py): torch the variables it needs there (its agent's own gloo group
    binds to the hostname's address, 127.0.0.1 in a namespace, without
    ``GLOO_SOCKET_IFNAME``); rpcx nothing (it must find its way without)."""
    if system == BASELINE:
        return {"TP_SOCKET_IFNAME": interface, "GLOO_SOCKET_IFNAME": interface}
    return {}


def routes(ns: SimpleNamespace, names: list[str]) -> dict[str, Any] | None:
    """How each of ``names`` reaches its peers, as rpcx's ``debug_info()["routes"]`` says
    (``{worker: {peer: route}}``), or ``None`` on torch (its agent does not say)."""
    if ns.system == BASELINE:
        return None
    me = ns.rpc.get_worker_info().name
    return {name: (ns.rpc.debug_info() if name == me
                   else ns.rpc.rpc_sync(name, ns.rpc.debug_info)).get("routes")
            for name in names}


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
        flags = _flags(system)
        unknown = flags - {AUTH_FLAG, PAYLOAD_FLAG, ENCRYPT_FLAG, TRACE_FLAG, CERTS_FLAG}
        keyed = flags & {AUTH_FLAG, CERTS_FLAG}
        if (unknown or len(keyed) > 1 or (flags & {PAYLOAD_FLAG, ENCRYPT_FLAG} and not keyed)
                or (PAYLOAD_FLAG in flags and CERTS_FLAG in flags)):
            return (f"system {system!r}: flags are +{AUTH_FLAG}, +{AUTH_FLAG}+"
                    f"{PAYLOAD_FLAG}, +{AUTH_FLAG}+{ENCRYPT_FLAG}, +{CERTS_FLAG}, "
                    f"+{CERTS_FLAG}+{ENCRYPT_FLAG} and +{TRACE_FLAG}")
        if flags & {ENCRYPT_FLAG, CERTS_FLAG}:
            from rpcx._wire.cipher import aead_available

            if not aead_available():
                return "+encrypt needs the 'cryptography' package: pip install cryptography"
        if backend_of(system) not in rpcx.backend_names():
            return (f"unknown system {system!r}: neither torch nor an installed rpcx backend "
                    f"({', '.join(rpcx.backend_names())})")
    return None
