"""Every plugin hook rpcx calls, in one place.

rpcx uses pluggy with the project name ``rpcx``. Third-party packages expose a module (or
object) through the entry-point group ``rpcx``; rpcx registers it as a plugin and calls
the hooks below. The built-in backends register through the very same hooks.

A minimal backend plugin::

    # my_backend/plugin.py
    from rpcx.hookspecs import hookimpl

    @hookimpl
    def rpcx_register_backends(register):
        register("mine", MyTransport, description="frames over my fabric")

    # pyproject.toml
    [project.entry-points.rpcx]
    mine = "my_backend.plugin"
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import pluggy

if TYPE_CHECKING:
    from rpcx.options import RpcBackendOptions
    from rpcx.transport import Capabilities, Transport

__all__ = ["PROJECT_NAME", "Register", "hookimpl", "hookspec"]

PROJECT_NAME = "rpcx"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
"""Marks rpcx's hook specifications (for rpcx itself)."""
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marks a plugin's implementation of an rpcx hook (``rpcx_register_backends``)."""


class Register(Protocol):
    """The ``register`` object a ``rpcx_register_backends`` hook is given
    (:class:`rpcx.registry.BackendRegistry` is the one rpcx passes)."""

    def __call__(
        self,
        name: str,
        factory: Callable[[], Transport],
        *,
        description: str = "",
        options_type: type[RpcBackendOptions] = ...,
        capabilities: Capabilities | None = None,
    ) -> None:
        """Register backend ``name``; see :func:`rpcx_register_backends`."""


@hookspec
def rpcx_register_backends(register: Register) -> None:
    """Register transports.

    Call ``register(name, factory, *, description="", options_type=RpcBackendOptions,
    capabilities=None)`` once per backend. ``factory()`` must return a new object that
    implements :class:`rpcx.transport.Transport`; ``capabilities`` defaults to the
    factory's ``capabilities`` attribute. Names are lower-case; registering a name twice
    is an error that names both plugins.
    """
