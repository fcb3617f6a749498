"""Module paths that moved when rpcx's tree became its layers, kept working for one
release with a :class:`DeprecationWarning`.

``import rpcx.serialization`` (or ``from rpcx import agent``) still gives the module,
now at its new path, and says where it went. Every path here but one is private (the
kit's ``basics``, split in three, is the kit itself now): what users and plugin authors
need is public in :mod:`rpcx`, :mod:`rpcx.transport`,
:mod:`rpcx.transport_kit`, :mod:`rpcx.options`, :mod:`rpcx.errors` and
:mod:`rpcx.testing`. The table, and these paths, go in the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

MOVED = {
    f"rpcx.{old}": f"rpcx.{new}" for old, new in {
        "_recent": "_util.recent", "_timer": "_util.timer", "_memory": "_util.memory",
        "_environ": "_util.environ", "_intra_op": "_util.intra_op",
        "_process_watch": "_util.process_watch", "_forkserver": "_util.forkserver",
        "_cpp_log": "_util.cpp_log", "_torch_import": "_util.torch_import",
        "_pool": "_util.pool",
        "serialization": "_wire.codec", "auth": "_wire.auth", "devices": "_wire.devices",
        "rendezvous": "_world.rendezvous", "_store": "_world.store",
        "_store_dial": "_world.store_dial", "dynamic_world": "_world.dynamic",
        "_membership": "_world.membership", "_membership_events": "_world.membership_events",
        "agent": "_core.agent", "joining": "_core.joining", "_call_path": "_core.call_path",
        "_peer_health": "_core.peer_health", "_heartbeat": "_core.heartbeat",
        "_executors": "_core.executors", "_shutdown": "_core.shutdown",
        "_budget": "_core.budget", "_retransmit": "_core.retransmit",
        "_context": "_core.context", "service_host": "_core.service_host",
        "_pending": "_core.pending", "_lanes": "_core.lanes", "_profiling": "_core.profiling",
        "calls": "_services.calls", "rref_protocol": "_services.rref_protocol",
        "rref_fork": "_services.rref_fork",
        "trace_session": "tracing.session", "_trace_ring": "tracing.ring",
        # (split by what each part is for; all of it is re-exported by the kit)
        "transport_kit.basics": "transport_kit",
    }.items()
}
"""Old dotted path -> where the module lives now."""

class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path in :data:`MOVED` and loads the module at its new one."""

    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        """A spec for ``fullname`` if it moved; ``None`` lets the other finders look."""
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """The module at its new path (imported if it was not), after the warning."""
        new = MOVED[spec.name]
        private = any(part.startswith("_") for part in new.split("."))
        advice = ("import what you use from rpcx's public modules instead" if private
                  else f"import it from {new}")
        warnings.warn(f"{spec.name} moved to {new}{' (private)' if private else ''}; "
                      f"{advice}. The old path goes in the next release.", DeprecationWarning,
                      stacklevel=2)  # (warnings itself skips importlib's frames)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module ran when it was imported at its new path."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
