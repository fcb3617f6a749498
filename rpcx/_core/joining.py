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

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any, ClassVar

from rpcx._wire import auth, cipher
from rpcx._wire.devices import DeviceRoutes, WorkerDevices, plan_routes
from rpcx._world import rendezvous
from rpcx._world.dynamic import DynamicWorld, HeldToken, claim_kind
from rpcx.errors import RpcError
from rpcx.hosts import host_identity
from rpcx.options import RpcBackendOptions
from rpcx.registry import BackendSpec, available_backends, dynamic_backends
from rpcx.worker import VacantRank, WorkerInfo

__all__ = ["Joined", "join", "rank_and_size"]

_HOST_BYTES = 16  # each worker's host, hashed, beside its session nonce

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
        return _join_dynamic(name, spec, options, rank, key)
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
        store=session, options=options, routes=routes, guard=guard,
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
                  key: bytes | None) -> Joined:
    """Join the dynamic world on ``options.init_method`` as worker ``name`` of ``rank``:
    under its membership token, which the returned record holds until
    :meth:`Joined.settle`."""
    _check_dynamic(name, spec, options, key)
    join_timeout = options.rpc_timeout or None
    store = rendezvous.open_store(options.init_method, rank, None, join_timeout)
    claim_kind(store, "dynamic", repr(name), join_timeout)
    world = DynamicWorld(store, name, rank, join_timeout)
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
        world.enter(roster)
    except BaseException:
        token.release()
        raise
    roster[rank] = name
    workers: list[WorkerInfo] = [VacantRank(r) for r in range(max(roster) + 1)]
    for held, holder in roster.items():
        workers[held] = WorkerInfo(holder, held)
    return Joined(
        backend=spec, name=name, rank=rank, world_size=len(workers), workers=workers,
        store=world.store, options=options,
        routes=DeviceRoutes(rank, [w.name for w in workers]), guard=None,
        connection_auth=None, world_key=None, dynamic=world, token=token,
    )


def _check_dynamic(name: str, spec: BackendSpec, options: RpcBackendOptions,
                   key: bytes | None) -> None:
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
    if key is not None:
        raise RpcError(
            f"{me}: a world key (authentication) is not supported in a dynamic world yet: "
            "every worker's session nonce is exchanged once, at start. Unset the key for a "
            "dynamic world on a trusted network, or pass world_size")
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
    """With a key: exchange sealed session records (each worker's nonce, host, whether
    and where it encrypts, and with encryption its X25519 public key), return the frame
    guard (a cipher when ``encrypt`` is set) and the proofs transports use on their
    connections. Without one: ``(None, None)``."""
    if key is None or seal is None:
        return None, None
    # With encryption, each worker's X25519 public key rides along (cipher.KeyExchange).
    exchange = cipher.KeyExchange() if encrypt is not None else None
    try:
        mine = _SessionRecord(auth.new_nonce(), _host_digest(), _MODES[encrypt],
                              exchange.public if exchange is not None else b"")
        published = rendezvous.all_gather(
            session, "auth", rank, len(names), mine.to_bytes(), timeout,
            what=f"init_rpc: worker {names[rank]!r} (rank {rank}) waiting for session nonces",
            seal=seal,
        )
        records = [_SessionRecord.read(value, peer, names, rank, mine.mode)
                   for peer, value in enumerate(published)]
        nonces = [record.nonce for record in records]
        payload = bool(getattr(options, "auth_payload", False))
        guard: auth.FrameGuard
        if exchange is None or encrypt is None:
            guard = auth.FrameGuard(key, rank, nonces, names, payload=payload)
        else:
            shared = []
            for peer, record in enumerate(records):
                unusable = None
                try:
                    shared.append(exchange.shared(record.public))
                except ValueError as exc:  # (a degenerate public key)
                    unusable = str(exc)
                if unusable is not None:  # (raised out here: the error's traceback would
                    # hold the exchange, private half and all)
                    raise RpcError(
                        f"init_rpc: worker {names[rank]!r} (rank {rank}): rank {peer} "
                        f"({names[peer]!r}) published an unusable public key ({unusable})")
            guard = cipher.FrameCipher(
                key, rank, nonces, names,
                cipher.encrypted_pairs(rank, [r.host for r in records], encrypt), shared,
                payload=payload)
            del shared
    finally:
        del exchange  # (the private half goes, even on failure: recorded frames stay unreadable)
    return guard, auth.ConnectionAuth(key, nonces)


_MODES = {None: 0, "hosts": 1, "always": 2}
_MODE_NAMES = {0: "does not encrypt", 1: f"encrypts between hosts ({cipher.ENCRYPT_ENV}=1)",
               2: f"encrypts every pair ({cipher.ENCRYPT_ENV}=always)"}


@dataclass(frozen=True)
class _SessionRecord:
    """What each worker of a keyed world publishes, sealed, at ``init_rpc``."""

    nonce: bytes  # auth.NONCE_BYTES
    host: bytes  # _HOST_BYTES: rpcx.hosts.host_identity, hashed
    mode: int  # _MODES: whether and where this worker encrypts
    public: bytes  # its X25519 public key when it encrypts, else empty

    # A record starts with _MAGIC (one of an older rpcx, which started with its nonce, is
    # told apart), then the nonce, the host and the mode byte.
    _MAGIC: ClassVar[bytes] = b"rsr1"
    _FIXED: ClassVar[int] = len(_MAGIC) + auth.NONCE_BYTES + _HOST_BYTES + 1

    def to_bytes(self) -> bytes:
        return self._MAGIC + self.nonce + self.host + bytes([self.mode]) + self.public

    @classmethod
    def read(cls, value: bytes, peer: int, names: list[str], rank: int,
             mode: int) -> _SessionRecord:
        """Rank ``peer``'s record; ``RpcError`` naming it if its settings differ from this
        worker's (``mode``) or it is no record this version writes."""
        me = f"init_rpc: worker {names[rank]!r} (rank {rank})"
        if (len(value) < cls._FIXED or not value.startswith(cls._MAGIC)
                or value[cls._FIXED - 1] not in _MODE_NAMES):
            raise RpcError(f"{me}: rank {peer} ({names[peer]!r}) published a session record "
                           f"this version of rpcx cannot read ({len(value)} bytes): run the "
                           "same rpcx on every worker")
        theirs = value[cls._FIXED - 1]
        if theirs != mode:
            raise RpcError(f"{me}: this worker {_MODE_NAMES[mode]} and rank {peer} "
                           f"({names[peer]!r}) {_MODE_NAMES[theirs]}: set "
                           f"{cipher.ENCRYPT_ENV} (or the encrypt option) the same on every "
                           "worker")
        public = value[cls._FIXED:]
        if len(public) != (cipher.PUBLIC_BYTES if mode else 0):
            raise RpcError(f"{me}: rank {peer} ({names[peer]!r}) published a public key of "
                           f"{len(public)} bytes")
        start = len(cls._MAGIC)
        return cls(value[start:start + auth.NONCE_BYTES],
                   value[start + auth.NONCE_BYTES:cls._FIXED - 1], theirs, public)


def _host_digest() -> bytes:
    """This worker's host, hashed, for the pairs ``RPCX_ENCRYPT=1`` encrypts. Where a part
    of the host's identity cannot be read (no boot id, no mount namespace: not Linux, a
    restricted ``/proc``), a random one: this worker then counts as a host of its own,
    and encrypts with everyone, rather than trusting a hostname another machine may share."""
    identity = host_identity()
    if any(not part for part in identity.split("|")):
        return os.urandom(_HOST_BYTES)
    return hashlib.sha256(identity.encode()).digest()[:_HOST_BYTES]
