"""What joining gave a worker (:class:`Joined`): everything its agent is built from, and
what ``init_rpc`` releases if the agent does not start."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rpcx._wire import auth
from rpcx._wire.devices import DeviceRoutes
from rpcx._world import rendezvous
from rpcx._world.dynamic import DynamicWorld, HeldToken
from rpcx.options import RpcBackendOptions
from rpcx.registry import BackendSpec
from rpcx.worker import WorkerInfo

__all__ = ["Joined"]

log = logging.getLogger("rpcx")


@dataclass(frozen=True)
class Joined:
    """What joining gave this worker: everything its agent is built from.

    Attributes:
        backend: the backend it joined with.
        name, rank, world_size: this worker.
        workers: every worker of the world, by rank.
        store: the world's session store (the rendezvous store, under this world's
            session prefix); the agent's barriers and the transports' exchanges use it.
        options: the options, of the backend's own type.
        routes: this worker's device routes (:mod:`rpcx._wire.devices`).
        guard: with a world key, the frame guard (``None`` without one).
        connection_auth: with a world key, the proofs transports use on their
            connections (``None`` without one).
        world_key: the in-process store's key, for a backend whose workers are threads of
            one process (released once the worker leaves: :meth:`leave`); else ``None``.
        dynamic: a dynamic world's record in the store (``None`` for a static world).
        token: a dynamic worker's membership token, held until :meth:`settle`.
        admit_keys: a dynamic world with a key: keys the pair with a worker joining at
            a rank (``rpcx._wire.keyed.keyed``'s ``admit_keys``).
    """

    backend: BackendSpec
    name: str
    rank: int
    world_size: int
    workers: list[WorkerInfo]
    store: Any
    options: RpcBackendOptions
    routes: DeviceRoutes
    guard: auth.FrameGuard | None
    connection_auth: auth.ConnectionAuth | None
    world_key: str | None
    dynamic: DynamicWorld | None = None
    token: HeldToken | None = None
    admit_keys: Callable[[int], None] | None = None

    def settle(self) -> None:
        """The agent started: give the membership token back (a dynamic world; nothing
        otherwise)."""
        if self.token is not None:
            self.token.release()

    def leave(self) -> None:
        """``init_rpc`` failed: release what joining holds beyond the agent (the
        in-process store; a dynamic worker's roster entry and membership token)."""
        if self.token is not None and self.token.held and self.dynamic is not None:
            try:
                self.dynamic.leave()
            except Exception as exc:  # logged: init_rpc raises its own error
                log.debug("%s: leaving the dynamic world's roster: %s", self.name, exc)
            self.token.release()
        if self.dynamic is not None:
            self.dynamic.departed()  # (a key server closes)
        if self.world_key is not None:
            rendezvous.release_in_process_store(self.world_key)
