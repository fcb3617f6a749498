"""Which backends are installed, and which one ``init_rpc`` uses.

Selection order: ``init_rpc(backend=...)``, then the backend ``rpcx.spawn`` was given for
the threads it started, then the ``RPCX_BACKEND`` environment variable, then
:data:`DEFAULT_BACKEND`. Plugins load once, on first use; a plugin that fails to load is
reported (``python -m rpcx backends``) instead of breaking rpcx.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pluggy

from rpcx import faulty, hookspecs
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
# auto is the default: it routes each pair of workers over the fastest socket that reaches
# it (shared memory within a host, TCP across hosts) and beat torch's TensorPipe agent on
# the bench's lines where gloo did not (bench/; docs/design/transports.md). tensorpipe is
# the one that moves CUDA memory directly.
DEFAULT_BACKEND = "auto"


class BackendType(str, enum.Enum):
    """Names of the built-in backends, for code written against torch's ``BackendType``."""

    AUTO = "auto"
    """The default: shared memory within a host, TCP across hosts, chosen per pair."""
    SHM = "shm"
    """One host: Unix sockets, large tensors through shared memory."""
    TCP = "tcp"
    """TCP for every pair of workers."""
    LOOPBACK = "loopback"
    """Every worker a thread of one process."""
    GLOO = "gloo"
    """gloo send/recv on a private process group."""
    TENSORPIPE = "tensorpipe"
    """torch's TensorPipe agent, CUDA device to device."""


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


if TYPE_CHECKING:  # (checked by mypy: a BackendRegistry is what hooks are told they get)
    _IS_A_REGISTER: hookspecs.Register = BackendRegistry()


_lock = threading.Lock()
_loaded: dict[str, BackendSpec] | None = None
_builtins: dict[str, BackendSpec] | None = None  # (no plugin imported to find these)
_errors: dict[str, str] = {}

_BUILTINS = ("rpcx.backends.sockets", "rpcx.backends.loopback", "rpcx.backends.gloo",
             "rpcx.backends.tensorpipe")
_HOOK = "rpcx_register_backends"


def _load() -> dict[str, BackendSpec]:
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        pm.add_hookspecs(hookspecs)
        registry = BackendRegistry()
        # Built-ins register first, whatever a plugin's tryfirst/trylast says: their names
        # are taken before any plugin can ask for them.
        for name in _register_builtins(pm) + _register_entry_points(pm):
            _call_register_hook(pm, name, registry)
        _loaded = registry.specs()
        return _loaded


def _load_builtins() -> dict[str, BackendSpec]:
    """The built-in backends alone. ``init_rpc`` on one of them imports no plugin: a
    plugin cannot take a built-in's name, and importing every installed plugin in every
    worker (pyzmq, say) costs each of a large world's processes CPU time at start."""
    global _builtins
    with _lock:
        if _builtins is None:
            pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
            pm.add_hookspecs(hookspecs)
            registry = BackendRegistry()
            for name in _register_builtins(pm):
                _call_register_hook(pm, name, registry)
            _builtins = registry.specs()
        return _builtins


def _register_builtins(pm: pluggy.PluginManager) -> list[str]:
    """Register the built-in backend modules as plugins; their names, in order."""
    registered = []
    for module_name in _BUILTINS:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # a torch built without its RPC module has no TensorPipe
            _errors[module_name.rsplit(".", 1)[-1]] = f"unavailable in this torch build: {exc}"
            continue
        pm.register(module, name=module_name)
        registered.append(module_name)
    return registered


def _register_entry_points(pm: pluggy.PluginManager) -> list[str]:
    """Load each ``rpcx`` entry point through pluggy, one at a time; those that loaded.

    One at a time so that a plugin that fails (an import error, a hook implementation
    pluggy refuses) is skipped with its reason and takes no other plugin down with it.
    """
    loaded = []
    entry_points = list(importlib.metadata.entry_points(group=hookspecs.PROJECT_NAME))
    names = dict.fromkeys(ep.name for ep in entry_points)
    for name in names:
        same = [ep.value for ep in entry_points if ep.name == name]
        if len(same) > 1:  # pluggy loads the first and skips the rest without a word
            _errors[f"{name} (duplicate)"] = (
                f"declared by {len(same)} installed packages ({', '.join(same)}); "
                "only one is loaded: uninstall the others"
            )
            log.warning("rpcx plugin %r is declared %d times: %s", name, len(same), same)
        try:
            pm.load_setuptools_entrypoints(hookspecs.PROJECT_NAME, name=name)
        except Exception as exc:  # a broken plugin must not break rpcx
            if pm.has_plugin(name):  # pluggy may have registered part of it
                pm.unregister(name=name)
            _errors[name] = f"failed to load: {type(exc).__name__}: {exc}"
            log.warning("rpcx plugin %r failed to load: %s: %s", name, type(exc).__name__, exc)
        else:
            loaded.append(name)
    return loaded


def _plugin_label(pm: pluggy.PluginManager, name: str) -> str:
    """How ``python -m rpcx backends`` names a plugin: ``entry point (module)``."""
    if name in _BUILTINS:
        return name
    plugin = pm.get_plugin(name)
    return f"{name} ({getattr(plugin, '__name__', type(plugin).__name__)})"


def _call_register_hook(pm: pluggy.PluginManager, name: str, registry: BackendRegistry) -> None:
    """Call plugin ``name``'s hook alone; what it registers counts only if it all succeeds."""
    others = [other for other_name, other in pm.list_name_plugin()
              if other_name != name and other is not None]
    hook = pm.subset_hook_caller(_HOOK, remove_plugins=others)
    registry._plugin = _plugin_label(pm, name)
    before = registry.specs()
    try:
        hook(register=registry)
    except Exception as exc:
        if name in _BUILTINS:
            raise  # a built-in that cannot register is a bug in rpcx, not a plugin to skip
        registry._specs = before
        _errors[name] = f"failed to register: {type(exc).__name__}: {exc}"
        log.warning("rpcx plugin %s failed to register: %s", registry._plugin, exc)


def available_backends() -> dict[str, BackendSpec]:
    """Every installed backend, by name."""
    return dict(_load())


def backend_names() -> list[str]:
    """Sorted names of the installed backends."""
    return sorted(_load())


def dynamic_backends() -> list[str]:
    """Sorted names of the installed backends that admit workers after start (a
    dynamic world: ``init_rpc`` without ``world_size``)."""
    return sorted(name for name, spec in _load().items() if spec.capabilities.dynamic)


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
    if backend.lower().startswith(faulty.PREFIX):
        return _faulty(resolve_backend(backend[len(faulty.PREFIX):]))
    spec = _load_builtins().get(backend.lower())
    if spec is not None:
        return spec
    specs = _load()
    spec = specs.get(backend.lower())
    if spec is None:
        installed = ", ".join(sorted(specs)) or "none"
        why = _errors.get(backend.lower())
        if why is not None:  # installed, but it cannot run here (tensorpipe without RPC)
            raise BackendNotFoundError(
                f"rpcx backend {backend!r} cannot be used here ({why}); installed "
                f"backends that work here: {installed}"
            )
        raise BackendNotFoundError(
            f"unknown rpcx backend {backend!r}; installed backends: {installed}"
        )
    return spec


def _faulty(inner: BackendSpec) -> BackendSpec:
    """``faulty:<inner>``: ``inner`` with injected faults (see :mod:`rpcx.faulty`)."""
    capabilities = dataclasses.replace(inner.capabilities, lossy=True)
    return BackendSpec(
        name=faulty.PREFIX + inner.name,
        factory=faulty.faulty_class(inner.name, inner.factory, capabilities),
        capabilities=capabilities,
        description=f"{inner.name}, with frames dropped, duplicated or delayed on demand",
        options_type=inner.options_type,
        plugin="rpcx.faulty",
    )
