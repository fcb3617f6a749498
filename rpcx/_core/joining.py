"""Joining the world: what ``init_rpc`` does before there is an agent.

In order: open the rendezvous store (an in-process one for a backend whose workers are
threads of one process), join the world through it (every worker's name, by rank),
share device maps and turn them into this worker's routes, and, with a world key,
exchange session nonces for the frame guard and the transports' connection proofs.
:func:`join` returns a :class:`Joined` record: everything the agent is built from.

A dynamic world (no ``world_size``, as torch's) is joined under its membership token
(:mod:`rpcx._world.dynamic`): this worker enters the store's roster, and the token stays
held until its transport has connected to every member (:meth:`Joined.settle`).

Nothing here runs after ``init_rpc`` (a dynamic worker leaves the roster through
:meth:`rpcx._world.dynamic.DynamicWorld.departing`, which its agent holds); the agent
never imports this module.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rpcx._wire import auth, cipher
from rpcx._wire.devices import DeviceRoutes, WorkerDevices, plan_routes
from rpcx._wire.sessions import Sessions
from rpcx._world import rendezvous
from rpcx._world.dynamic import DynamicWorld, HeldToken, claim_kind
from rpcx.errors import RpcError
from rpcx.options import RpcBackendOptions
from rpcx.registry import BackendSpec, available_backends, dynamic_backends
from rpcx.worker import VacantRank, WorkerInfo

__all__ = ["Joined", "join", "rank_and_size"]

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
        if self.world_key is not None:
            rendezvous.release_in_process_store(self.world_key)


def join(
    name: str,
    spec: BackendSpec,
    options: RpcBackendOptions,
    rank: int,
    world_size: int | None,
    key: bytes | None,
    spawn_world: str | None = None,
) -> Joined:
    """Join the world as worker ``name`` (rank ``rank`` of ``world_size``, or as
    :func:`rank_and_size` reads them from the environment).

    ``key``: the world key (:func:`rpcx._wire.auth.resolve_key`), or ``None``.
    ``spawn_world``: for an in-process backend, the world ``rpcx.spawn`` started this
    thread in (else the world is named by ``options.init_method``). Waits are bounded by
    ``options.rpc_timeout``. Raises what the rendezvous raises; whatever fails after the
    in-process store was opened releases it.
    """
    rank, world_size = rank_and_size(options, rank, world_size)
    encrypt = cipher.resolve_encrypt(options)
    if encrypt is not None and key is None:
        raise RpcError(
            f"init_rpc: worker {name!r}: encryption ({cipher.ENCRYPT_ENV}) needs a world "
            f"key: set {auth.AUTH_KEY_ENV} (or the auth_key option) on every worker, the "
            "same on each")
    if encrypt is not None and not cipher.aead_available():
        raise RpcError(
            f"init_rpc: worker {name!r}: encryption ({cipher.ENCRYPT_ENV}) needs the "
            "'cryptography' package: pip install 'torch-rpcx[encrypt]'")
    if world_size is None:
        return _join_dynamic(name, spec, options, rank, key, encrypt)
    seal = auth.ValueSeal(key) if key is not None else None
    join_timeout = options.rpc_timeout or None
    in_process = spec.capabilities.in_process
    world_key: str | None = None
    if in_process:
        world_key = spawn_world or options.init_method
        store = rendezvous.in_process_store(world_key)
    else:
        store = rendezvous.open_store(options.init_method, rank, world_size, join_timeout)
    try:
        claim_kind(store, "static", repr(name), join_timeout)
        session, names = rendezvous.join_world(
            store, name, rank, world_size, join_timeout, seal)
    except Exception as exc:
        if world_key is not None:
            rendezvous.release_in_process_store(world_key)
            if isinstance(exc, TimeoutError):
                raise RpcError(
                    f"{exc}. The {spec.name!r} backend runs every worker as a thread of one "
                    "process: start the workers with rpcx.spawn(..., backend="
                    f"{spec.name!r}) or threads, or pick a multi-process backend"
                ) from exc
        raise
    workers = [WorkerInfo(n, r) for r, n in enumerate(names)]
    try:
        routes = exchange_devices(session, rank, name, world_size, options, join_timeout, seal)
        guard, connections = _authenticate(session, key, seal, rank, names, options,
                                           join_timeout, encrypt)
    except BaseException:
        if world_key is not None:
            rendezvous.release_in_process_store(world_key)
        raise
    return Joined(
        backend=spec, name=name, rank=rank, world_size=world_size, workers=workers,
        store=session.with_seal(seal), options=options, routes=routes, guard=guard,
        connection_auth=connections, world_key=world_key,
    )


def rank_and_size(options: RpcBackendOptions, rank: int, world_size: int | None
                  ) -> tuple[int, int | None]:
    """``init_rpc``'s rank and world size: as given, or from ``$RANK`` and ``$WORLD_SIZE``
    with ``env://``. A world size of ``None`` (not given, nor in the environment) means a
    dynamic world. Raises ``ValueError`` for a size below 1, a rank outside it, or a
    dynamic worker without a rank (with torch's wording)."""
    env = options.init_method.startswith("env://")
    if env:
        if rank < 0 and "RANK" in os.environ:
            rank = int(os.environ["RANK"])
        if world_size is None and "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
    if world_size is None:
        if rank < 0:
            raise ValueError(
                "init_rpc without world_size joins a dynamic world, which needs this "
                "worker's rank: "
                + ("environment variable RANK expected, but not set" if env else
                   f"rank parameter missing (init_method {options.init_method!r})"))
        return rank, None
    if world_size < 1:
        raise ValueError(f"init_rpc needs world_size >= 1, got {world_size} (leave it out "
                         "to join a dynamic world)")
    if not 0 <= rank < world_size:
        raise ValueError(f"init_rpc needs 0 <= rank < world_size={world_size}, got rank={rank}")
    return rank, world_size


def _join_dynamic(name: str, spec: BackendSpec, options: RpcBackendOptions, rank: int,
                  key: bytes | None, encrypt: str | None) -> Joined:
    """Join the dynamic world on ``options.init_method`` as worker ``name`` of ``rank``:
    under its membership token, which the returned record holds until
    :meth:`Joined.settle`. With a key, this worker checks the members' session records
    and publishes its own before it enters (:class:`_DynamicSessions`)."""
    _check_dynamic(name, spec, options)
    join_timeout = options.rpc_timeout or None
    store = rendezvous.open_store(options.init_method, rank, None, join_timeout)
    claim_kind(store, "dynamic", repr(name), join_timeout)
    world = DynamicWorld(store.with_seal(auth.ValueSeal(key) if key is not None else None),
                         name, rank, join_timeout)
    keys = _DynamicSessions(world, key, encrypt, options)
    token = world.hold_token("join")
    try:
        roster = world.strike_off_the_dead(world.roster())
        if (rank not in roster and not spec.capabilities.reuses_ranks
                and world.was_held(rank)):
            raise RpcError(
                f"init_rpc: worker {name!r} cannot take rank {rank} of the dynamic world: "
                f"a worker held it before, and the {spec.name!r} backend cannot give a rank "
                "to a new worker (torch's agent keeps the old connection); pick a rank not "
                "used in this world, or a backend that can ("
                + ", ".join(n for n, other in available_backends().items()
                            if other.capabilities.dynamic and other.capabilities.reuses_ranks)
                + ")")
        keys.meet(roster)
        world.enter(roster)
    except BaseException:
        token.release()
        raise
    roster[rank] = name
    workers: list[WorkerInfo] = [VacantRank(r) for r in range(max(roster) + 1)]
    for held, holder in roster.items():
        workers[held] = WorkerInfo(holder, held)
    try:
        guard, connections = keys.start([w.name for w in workers])
    except BaseException:  # (a member's public key unusable: leave as a failed start does)
        world.leave()
        token.release()
        raise
    return Joined(
        backend=spec, name=name, rank=rank, world_size=len(workers), workers=workers,
        store=world.store, options=options,
        routes=DeviceRoutes(rank, [w.name for w in workers]), guard=guard,
        connection_auth=connections, world_key=None, dynamic=world, token=token,
        admit_keys=keys.admit if guard is not None else None,
    )


class _DynamicSessions:
    """The session records of a dynamic world with a key (nothing without one): each
    worker publishes its own, sealed, under the membership token before it enters; the
    members read a newcomer's when its connection arrives."""

    def __init__(self, world: DynamicWorld, key: bytes | None, encrypt: str | None,
                 options: RpcBackendOptions) -> None:
        self._world = world
        self._me = f"init_rpc: worker {world.name!r} (rank {world.rank})"
        self._seal = auth.ValueSeal(key) if key is not None else None
        self._sessions = (None if key is None else Sessions(
            key, world.rank, self._me, encrypt, bool(getattr(options, "auth_payload", False))))

    def meet(self, roster: dict[int, str]) -> None:
        """Under the token, before entering: check that every member of ``roster`` runs
        with this worker's key and settings (``RpcError`` naming the first that does
        not), and publish this worker's record."""
        found = self._world.sessions(sorted(roster))
        if self._sessions is None or self._seal is None:
            keyed = [rank for rank, value in found.items() if value]
            if keyed:
                raise RpcError(
                    f"{self._me}: the dynamic world's members hold a world key (rank "
                    f"{keyed[0]}, {roster[keyed[0]]!r}, published a sealed session record) "
                    f"and this worker has none: set {auth.AUTH_KEY_ENV} (or the auth_key "
                    "option) to the world's key")
            return
        for rank, value in found.items():
            self._sessions.read(rank, self._open(rank, value, roster[rank]), roster[rank])
        self._world.publish_session(
            self._seal.seal(self._label(self._world.rank), self._sessions.mine.to_bytes()))

    def start(self, names: list[str]) -> tuple[auth.FrameGuard | None,
                                               auth.ConnectionAuth | None]:
        """The frame guard and connection proofs (``(None, None)`` without a key)."""
        if self._sessions is None:
            return None, None
        return self._sessions.start(names, fetch=self._fetch)

    def admit(self, rank: int) -> None:
        """Key the pair with the worker joining at ``rank`` (:meth:`Sessions.admit`)."""
        if self._sessions is not None:
            self._sessions.admit(rank)

    def _fetch(self, rank: int) -> bytes:
        """The opened record of the worker holding ``rank`` now (joining: it published
        the record before it dialled); ``RpcError`` if it has none, or a forged one."""
        return self._open(rank, self._world.sessions([rank])[rank], None)

    def _open(self, rank: int, value: bytes, name: str | None) -> bytes:
        assert self._seal is not None
        who = f"rank {rank}" + (f" ({name!r})" if name else "")
        if not value:
            raise RpcError(f"{self._me}: {who} published no session record: it runs "
                           f"without a world key; set {auth.AUTH_KEY_ENV} the same on "
                           "every worker")
        opened = self._seal.open(self._label(rank), value)
        if opened is None:
            raise RpcError(f"{self._me}: the session record of {who} is not sealed with "
                           "this worker's world key: the keys differ, or something other "
                           "than rpcx wrote it")
        return opened

    @staticmethod
    def _label(rank: int) -> str:
        return f"{DynamicWorld.PREFIX}/{DynamicWorld.SESSION}/{rank}"


def _check_dynamic(name: str, spec: BackendSpec, options: RpcBackendOptions) -> None:
    """Refuse, saying why, what a dynamic world cannot do yet."""
    me = f"init_rpc: worker {name!r} (without world_size: a dynamic world)"
    if not spec.capabilities.dynamic:
        where = ("its workers are threads of one process, started together"
                 if spec.capabilities.in_process else
                 "its transport connects a fixed set of workers at start")
        raise RpcError(
            f"{me}: the {spec.name!r} backend cannot admit workers after the world started "
            f"({where}). Backends that can: {', '.join(dynamic_backends()) or 'none'}; or "
            "pass world_size to start a world of fixed size")
    if getattr(options, "device_maps", None) or getattr(options, "devices", None):
        raise RpcError(
            f"{me}: device maps are not supported in a dynamic world yet (the world's "
            "maps are checked once, at start); send CPU tensors, or pass world_size")


def exchange_devices(
    store: Any, rank: int, name: str, world_size: int, options: Any, timeout: float | None,
    seal: auth.ValueSeal | None = None,
) -> DeviceRoutes:
    """Share this worker's device declaration through ``store``; return its checked routes.

    ``seal``: the world key, see :func:`rpcx._world.rendezvous.all_gather`."""
    mine = WorkerDevices.of(name, options)
    gathered = rendezvous.all_gather(
        store, "devices", rank, world_size, mine.to_bytes(), timeout,
        what=(f"init_rpc: worker {name!r} (rank {rank}) waiting for every worker's device "
              "maps (bounded by rpc_timeout)"),
        seal=seal,
    )
    declarations = []
    for peer, data in enumerate(gathered):
        try:
            declarations.append(WorkerDevices.from_bytes(data))
        except ValueError as exc:
            raise RpcError(
                f"init_rpc: worker {name!r} (rank {rank}) read an invalid device declaration "
                f"for rank {peer} from the rendezvous store ({exc}); is something other than "
                "rpcx writing to it?"
            ) from None
    return plan_routes(rank, declarations)


def _authenticate(
    session: Any, key: bytes | None, seal: auth.ValueSeal | None, rank: int,
    names: list[str], options: Any, timeout: float | None, encrypt: str | None = None,
) -> tuple[auth.FrameGuard | None, auth.ConnectionAuth | None]:
    """With a key: exchange sealed session records (:mod:`rpcx._wire.sessions`), return
    the frame guard (a cipher when ``encrypt`` is set) and the proofs transports use on
    their connections. Without one: ``(None, None)``."""
    if key is None or seal is None:
        return None, None
    me = f"init_rpc: worker {names[rank]!r} (rank {rank})"
    sessions = Sessions(key, rank, me, encrypt, bool(getattr(options, "auth_payload", False)))
    published = rendezvous.all_gather(
        session, "auth", rank, len(names), sessions.mine.to_bytes(), timeout,
        what=f"{me} waiting for session nonces", seal=seal,
    )
    for peer, value in enumerate(published):
        sessions.read(peer, value, names[peer])
    return sessions.start(names)
