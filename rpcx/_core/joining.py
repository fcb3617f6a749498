"""Joining the world: what ``init_rpc`` does before there is an agent.

In order: open the rendezvous store (an in-process one for a backend whose workers are
threads of one process), join the world through it (every worker's name, by rank),
share device maps and turn them into this worker's routes, and, with a world key,
exchange session nonces for the frame guard and the transports' connection proofs.
:func:`join` returns a :class:`Joined` record: everything the agent is built from.

A dynamic world (no ``world_size``, as torch's) is joined by
:mod:`rpcx._core.dynamic_join`.

Nothing here runs after ``init_rpc`` (a dynamic worker leaves the roster through
:meth:`rpcx._world.dynamic.DynamicWorld.departing`, which its agent holds); the agent
never imports this module.
"""

from __future__ import annotations

import os
from typing import Any

from rpcx._core.dynamic_join import join_dynamic
from rpcx._core.joined import Joined
from rpcx._wire import auth, cipher
from rpcx._wire.devices import DeviceRoutes, WorkerDevices, plan_routes
from rpcx._wire.sessions import Sessions
from rpcx._world import enrollment, rendezvous
from rpcx._world.dynamic import claim_kind
from rpcx.errors import RpcError
from rpcx.options import RpcBackendOptions
from rpcx.registry import BackendSpec
from rpcx.worker import WorkerInfo

__all__ = ["Joined", "join", "rank_and_size"]


def join(
    name: str,
    spec: BackendSpec,
    options: RpcBackendOptions,
    rank: int,
    world_size: int | None,
    key: bytes | None,
    spawn_world: str | None = None,
    certificates: enrollment.Certificates | None = None,
) -> Joined:
    """Join the world as worker ``name`` (rank ``rank`` of ``world_size``, or as
    :func:`rank_and_size` reads them from the environment).

    ``key``: the world key (:func:`rpcx._wire.auth.resolve_key`), or ``None``.
    ``certificates``: instead of a key, this worker's certificates: the world's key is
    handed over by mutual TLS (:mod:`rpcx._world.enrollment`), and encryption between
    hosts is on unless ``encrypt`` says otherwise.
    ``spawn_world``: for an in-process backend, the world ``rpcx.spawn`` started this
    thread in (else the world is named by ``options.init_method``). Waits are bounded by
    ``options.rpc_timeout``. Raises what the rendezvous raises; whatever fails after the
    in-process store was opened releases it.
    """
    rank, world_size = rank_and_size(options, rank, world_size)
    encrypt = cipher.resolve_encrypt(options,
                                     default="hosts" if certificates is not None else None)
    if certificates is not None and key is not None:
        raise RpcError(
            f"init_rpc: worker {name!r}: both a world key ({auth.AUTH_KEY_ENV} or auth_key) "
            f"and certificates ({enrollment.CERT_ENV} or tls_cert) are set; give one: with "
            "certificates, the world's key is drawn by one worker and handed to the others")
    if encrypt is not None and key is None and certificates is None:
        raise RpcError(
            f"init_rpc: worker {name!r}: encryption ({cipher.ENCRYPT_ENV}) needs a world "
            f"key: set {auth.AUTH_KEY_ENV} (or the auth_key option) on every worker, the "
            "same on each")
    if encrypt is not None and not cipher.aead_available():
        raise RpcError(
            f"init_rpc: worker {name!r}: encryption ({cipher.ENCRYPT_ENV}"
            + (", on by default with certificates" if certificates is not None else "")
            + ") needs the 'cryptography' package: pip install 'torch-rpcx[encrypt]'")
    if world_size is None:
        return join_dynamic(name, spec, options, rank, key, encrypt, certificates)
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
        session = rendezvous.open_session(store, name, rank, world_size, join_timeout)
        server = None
        if certificates is not None:
            key, server = enrollment.static_world_key(
                session, rank, certificates,
                enrollment.key_server_host(options, in_process),
                join_timeout, f"init_rpc: worker {name!r} (rank {rank})")
        seal = auth.ValueSeal(key) if key is not None else None
        try:
            names = rendezvous.gather_names(session, name, rank, world_size, join_timeout,
                                            seal)
        except RpcError as exc:
            if server is None or not server.refused:
                raise
            raise type(exc)(  # (the workers it waits for may be those it refused)
                f"{exc}; meanwhile its key server refused {server.refused} connection(s), "
                f"the last: {server.last_refusal}") from exc
        finally:
            if server is not None:  # (every worker has the key: its name is sealed)
                server.close()
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
