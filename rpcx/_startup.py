"""The start-up hook of ``RPCX_FOR_TORCH``: turn :func:`rpcx.use_for_torch` on as soon as
torch is imported, in any Python process of the environment.

``rpcx-for-torch.pth`` (installed beside the package, in site-packages) loads this file as
the module ``rpcx_startup`` and calls :func:`install` at interpreter start-up when
``$RPCX_FOR_TORCH`` is set, without importing rpcx or torch:
start-up stays as fast as it was, and a process that never imports torch never pays
for either. It puts a finder first on ``sys.meta_path`` that waits for ``import torch``
and, once torch's package has run, turns the switch on before the import returns to
whoever asked for it, so a library's ``from torch.distributed.rpc import rpc_sync`` gets
rpcx's. Standard library only, on purpose.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import types
import warnings
from typing import Any

ORIGIN = "$RPCX_FOR_TORCH, at interpreter start-up"


class _SwitchAfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands ``torch``'s spec back with a loader that turns the
    switch on after torch's package has run.

    It stays on ``sys.meta_path`` until torch has actually run: a library that only
    looks for torch first (``importlib.util.find_spec("torch")``) gets a spec it throws
    away, and the import that follows must be seen too."""

    def __init__(self) -> None:
        self._looking = threading.local()  # this thread is asking the finders after us

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch" or getattr(self._looking, "on", False):
            return None
        self._looking.on = True
        try:
            spec = None
            for finder in list(sys.meta_path):  # the finders after us, in their order
                if type(finder).__name__ == _SwitchAfterTorch.__name__:
                    continue
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find is not None else None
                if spec is not None:
                    break
        finally:
            self._looking.on = False
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _SwitchingLoader(spec.loader)
        return spec


class _SwitchingLoader(importlib.abc.Loader):
    """torch's own loader, plus the switch once the package has run."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> types.ModuleType | None:
        module: types.ModuleType | None = self._inner.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        sys.meta_path[:] = [f for f in sys.meta_path
                            if type(f).__name__ != _SwitchAfterTorch.__name__]
        try:
            _switch()
        except Exception as exc:  # torch must still import: say so, and go on as torch
            warnings.warn(
                f"RPCX_FOR_TORCH is set, but rpcx could not take over torch's RPC names "
                f"({type(exc).__name__}: {exc}); torch.distributed.rpc stays torch's own",
                RuntimeWarning, stacklevel=2,
            )

    def __getattr__(self, name: str) -> Any:  # resources, get_filename, ...: torch's
        return getattr(self._inner, name)


def _switch() -> None:
    """Turn the switch on, unless rpcx is what imported torch: rpcx is then half
    imported, and turns the switch on itself once it is whole (it reads the variable
    at the end of its own import)."""
    spec = getattr(sys.modules.get("rpcx"), "__spec__", None)
    if getattr(spec, "_initializing", False):
        return
    import rpcx.for_torch

    rpcx.for_torch.use_for_torch(origin=ORIGIN)


def install() -> None:
    """Turn the switch on now if torch is already imported, else when it is."""
    if "torch" in sys.modules:
        _switch()
    elif not any(type(f).__name__ == _SwitchAfterTorch.__name__ for f in sys.meta_path):
        # (By name: a venv's site-packages may be read twice at start-up, each time
        # loading this file anew, with a class of its own.)
        sys.meta_path.insert(0, _SwitchAfterTorch())

