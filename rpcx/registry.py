"""Which backends are installed, and which one ``init_rpc`` uses.

Selection order: ``init_rpc(backend=...)``, then the backend ``rpcx.spawn`` was given for
the threads it started, then the ``RPCX_BACKEND`` environment variable, then
:data:`DEFAULT_BACKEND`. Plugins load once, on first use; a plugin that fails to load is
reported (``python -m rpcx backends``) instead of breaking rpcx.
"""

from __future__ import annotations

import enum
import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pluggy

from rpcx import hookspecs
from rpcx.errors import BackendNotFoundError
from rpcx.options import RpcBackendOptions
from rpcx.transport import Capabilities, Transport

__all__ = [
    "DEFAULT_BACKEND",
    "BackendRegistry",
    "BackendSpec",
    "BackendType",
    "available_backends",
    "backend_names",
    "plugin_errors",
    "resolve_backend",
]

log = logging.getLogger("rpcx.registry")

ENV_VAR = "RPCX_BACKEND"
# gloo is the default: of the multi-process, multi-host backends it measured fastest on
# small calls and large tensors (bench/; docs/design/transports.md). tensorpipe is the
# one that moves CUDA memory directly.
DEFAULT_BACKEND = "gloo"


class BackendType(str, enum.Enum):
    """Names of the built-in backends, for code written against torch's ``BackendType``."""

    LOOPBACK = "loopback"
    GLOO = "gloo"
    TENSORPIPE = "tensorpipe"


@dataclass(frozen=True)
class BackendSpec:
    """One registered backend."""

    name: str
    factory: Callable[[], Transport]
    capabilities: Capabilities
    description: str
    options_type: type[RpcBackendOptions]
    plugin: str


class BackendRegistry:
    """The ``register`` object handed to ``rpcx_register_backends`` hooks."""

    def __init__(self) -> None:
        self._specs: dict[str, BackendSpec] = {}
        self._plugin = "?"

    def __call__(
        self,
        name: str,
        factory: Callable[[], Transport],
        *,
        description: str = "",
        options_type: type[RpcBackendOptions] = RpcBackendOptions,
        capabilities: Capabilities | None = None,
    ) -> None:
        """Register backend ``name``; see :func:`rpcx.hookspecs.rpcx_register_backends`."""
        key = name.lower()
        if key in self._specs:
            raise ValueError(
                f"backend {key!r} registered twice: by {self._specs[key].plugin} "
                f"and by {self._plugin}"
            )
        caps = capabilities if capabilities is not None else getattr(factory, "capabilities", None)
        if not isinstance(caps, Capabilities):
            raise TypeError(f"backend {key!r} ({self._plugin}) declares no Capabilities")
        self._specs[key] = BackendSpec(key, factory, caps, description, options_type, self._plugin)

    def specs(self) -> dict[str, BackendSpec]:
        """Every registered backend, by name."""
        return dict(self._specs)


_lock = threading.Lock()
_loaded: dict[str, BackendSpec] | None = None
_errors: dict[str, str] = {}


def _load() -> dict[str, BackendSpec]:
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        from rpcx.backends import gloo, loopback  # built-ins register like any plugin

        pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        pm.add_hookspecs(hookspecs)
        plugins: list[tuple[str, Any]] = [
            ("rpcx.backends.loopback", loopback),
            ("rpcx.backends.gloo", gloo),
        ]
        try:  # a torch built without its RPC module has no TensorPipe agent
            from rpcx.backends import tensorpipe
        except ImportError as exc:
            _errors["tensorpipe"] = f"unavailable in this torch build: {exc}"
        else:
            plugins.append(("rpcx.backends.tensorpipe", tensorpipe))
        for ep in importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME):
            try:
                plugins.append((f"{ep.name} ({ep.value})", ep.load()))
            except Exception as exc:  # a broken plugin must not break rpcx
                _errors[ep.name] = f"failed to load: {type(exc).__name__}: {exc}"
                log.warning("rpcx plugin %r (%s) failed to load: %s", ep.name, ep.value, exc)
        registry = BackendRegistry()
        for plugin_name, plugin in plugins:
            if pm.is_registered(plugin):
                continue
            pm.register(plugin, name=plugin_name)
        for impl in pm.hook.rpcx_register_backends.get_hookimpls():
            registry._plugin = impl.plugin_name
            try:
                impl.function(register=registry)
            except Exception as exc:
                _errors[impl.plugin_name] = f"failed to register: {type(exc).__name__}: {exc}"
                log.warning("rpcx plugin %s failed to register: %s", impl.plugin_name, exc)
        _loaded = registry.specs()
        return _loaded


def available_backends() -> dict[str, BackendSpec]:
    """Every installed backend, by name."""
    return dict(_load())


def backend_names() -> list[str]:
    """Sorted names of the installed backends."""
    return sorted(_load())


def plugin_errors() -> dict[str, str]:
    """Plugins that failed, with what failed ("failed to load: ImportError: ...")."""
    _load()
    return dict(_errors)


def resolve_backend(backend: object = None, spawned: str | None = None) -> BackendSpec:
    """The backend to use for ``init_rpc(backend=backend)``; see the module docstring."""
    if backend is None:
        backend = spawned or os.environ.get(ENV_VAR) or DEFAULT_BACKEND
    if isinstance(backend, enum.Enum):  # rpcx.BackendType or torch's BackendType
        backend = backend.value if isinstance(backend, str) else backend.name
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a name such as 'gloo', got {type(backend).__name__}")
    specs = _load()
    spec = specs.get(backend.lower())
    if spec is None:
        installed = ", ".join(sorted(specs)) or "none"
        raise BackendNotFoundError(
            f"unknown rpcx backend {backend!r}; installed backends: {installed}"
        )
    return spec
