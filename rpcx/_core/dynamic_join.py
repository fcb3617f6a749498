"""Joining a dynamic world (``init_rpc`` without ``world_size``, as torch's).

Under the world's membership token (:mod:`rpcx._world.dynamic`), a joining worker reads
who is in the world, checks the members' session records (with a world key:
:class:`_DynamicSessions`) and device declarations (:class:`_DynamicDevices`),
publishes its own, and enters the roster; the token stays held until its transport has
connected to every member (:meth:`Joined.settle <rpcx._core.joined.Joined.settle>`).
A member takes a newcomer's record and declaration when the newcomer's connection
arrives (the frame guard's keys in the transport's ``admit``, the routes through the
dynamic world's admission checks).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

from rpcx._core.joined import Joined
from rpcx._wire import auth
from rpcx._wire.devices import DeviceRoutes, WorkerDevices, plan_dynamic_routes
from rpcx._wire.sessions import Sessions
from rpcx._world import enrollment, rendezvous, sealed
from rpcx._world.dynamic import DynamicWorld, claim_kind
from rpcx.errors import RpcError
from rpcx.options import RpcBackendOptions
from rpcx.registry import BackendSpec, available_backends, dynamic_backends
from rpcx.worker import VacantRank, WorkerInfo

__all__ = ["join_dynamic"]


def join_dynamic(name: str, spec: BackendSpec, options: RpcBackendOptions, rank: int,
                  key: bytes | None, encrypt: str | None,
                  certificates: enrollment.Certificates | None = None) -> Joined:
    """Join the dynamic world on ``options.init_method`` as worker ``name`` of ``rank``:
    under its membership token, which the returned record holds until
    :meth:`Joined.settle`. With a key, this worker checks the members' session records
    and publishes its own before it enters (:class:`_DynamicSessions`). With
    ``certificates``, it takes the key from a member's key server under the token (or
    draws it, founding the world) and serves it to later joiners while it is a member."""
    _check_dynamic(name, spec, options)
    join_timeout = options.rpc_timeout or None
    store = rendezvous.open_store(options.init_method, rank, None, join_timeout)
    claim_kind(store, "dynamic", repr(name), join_timeout)
    world = DynamicWorld(store.with_seal(auth.ValueSeal(key) if key is not None else None),
                         name, rank, join_timeout)
    devices = _DynamicDevices(world, WorkerDevices.of(name, options))
    token = world.hold_token("join")
    server: enrollment.KeyServer | None = None
    entered = False
    try:
        if certificates is not None:
            key, server = _enrol(world, certificates, options)
        keys = _DynamicSessions(world, key, encrypt, options)
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
        routes = devices.meet(roster)
        world.enter(roster)
        entered = True
        if server is not None:
            enrollment.list_server(world.store, rank, server.address, join_timeout)
            world.on_departure.append(server.close)
    except BaseException:
        if server is not None:
            server.close()
        if entered:  # (its key server could not be listed: out of the roster again)
            with contextlib.suppress(RpcError):
                world.leave()
        token.release()
        raise
    roster[rank] = name
    workers: list[WorkerInfo] = [VacantRank(r) for r in range(max(roster) + 1)]
    for held, holder in roster.items():
        workers[held] = WorkerInfo(holder, held)
    try:
        guard, connections = keys.start([w.name for w in workers])
    except BaseException:  # (a member's public key unusable: leave as a failed start does)
        try:
            world.leave()
        finally:
            token.release()
            world.departed()  # (its key server closes)
        raise
    world.admission_checks.append(functools.partial(devices.admit, routes))
    return Joined(
        backend=spec, name=name, rank=rank, world_size=len(workers), workers=workers,
        store=world.store, options=options, routes=routes, guard=guard,
        connection_auth=connections, world_key=None, dynamic=world, token=token,
        admit_keys=keys.admit if guard is not None else None,
    )


def _enrol(world: DynamicWorld, certificates: enrollment.Certificates,
           options: RpcBackendOptions) -> tuple[bytes, enrollment.KeyServer]:
    """Under the token: the world's key, from a member's key server, or new for a world
    nobody is in (the first worker, or after the last member left); this worker's
    own key server, listening, for later joiners. The world's store view seals with the
    key from then on."""
    who = f"init_rpc: worker {world.name!r} (rank {world.rank})"
    key = enrollment.dynamic_world_key(world.store, certificates, world.timeout, who,
                                       world.has_members())
    world.use_seal(auth.ValueSeal(key))
    server = enrollment.KeyServer(certificates, key, enrollment.key_server_host(options),
                                  f"worker {world.name!r} (rank {world.rank})")
    return key, server


class _DynamicSessions:
    """The session records of a dynamic world with a key (nothing without one): each
    worker publishes its own, sealed, under the membership token before it enters; the
    members read a newcomer's when its connection arrives."""

    def __init__(self, world: DynamicWorld, key: bytes | None, encrypt: str | None,
                 options: RpcBackendOptions) -> None:
        self._world = world  # (its store view carries the key's seal)
        self._me = f"init_rpc: worker {world.name!r} (rank {world.rank})"
        self._sessions = (None if key is None else Sessions(
            key, world.rank, self._me, encrypt, bool(getattr(options, "auth_payload", False))))

    def meet(self, roster: dict[int, str]) -> None:
        """Under the token, before entering: check that every member of ``roster`` runs
        with this worker's key and settings (``RpcError`` naming the first that does
        not), and publish this worker's record. (A worker without a key that meets
        members with one was told so already: the roster it read is sealed.)"""
        if self._sessions is None:
            return
        for rank, value in self._world.sessions(sorted(roster)).items():
            self._sessions.read(rank, self._open(rank, value, roster[rank]), roster[rank])
        key = f"{DynamicWorld.SESSION}/{self._world.rank}"
        sealed.publish(self._world.store, key, self._sessions.mine.to_bytes(),
                       label=self._label(self._world.rank, entering=True))

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
        seal = self._world.store.seal
        assert seal is not None
        who = f"rank {rank}" + (f" ({name!r})" if name else "")
        if not value:
            raise RpcError(f"{self._me}: {who} published no session record: it runs "
                           f"without a world key; set {auth.AUTH_KEY_ENV} the same on "
                           "every worker")
        opened = seal.open(self._label(rank), value)
        if opened is None:
            raise RpcError(f"{self._me}: the session record of {who} is not sealed with "
                           "this worker's world key: the keys differ, or something other "
                           "than rpcx wrote it")
        return opened

    def _label(self, rank: int, *, entering: bool = False) -> str:
        """A record's seal label: bound to its holder's incarnation (an earlier holder's
        record, put back in the store, does not open)."""
        return self._world.holder_label(f"{DynamicWorld.SESSION}/{rank}", rank,
                                        entering=entering)


class _DynamicDevices:
    """The device declarations of a dynamic world: each worker publishes its own (sealed
    with a key) before it enters, plans its routes from the members' (a map to a worker
    not in the world yet waits for it), and takes each newcomer's when it is admitted."""

    KEY = "devices"

    def __init__(self, world: DynamicWorld, mine: WorkerDevices) -> None:
        self._world = world
        self._mine = mine
        self._me = f"init_rpc: worker {world.name!r} (rank {world.rank})"

    def meet(self, roster: dict[int, str]) -> DeviceRoutes:
        """Under the token, before entering: this worker's routes among the members of
        ``roster`` (``RpcError`` naming the entry at fault), and its declaration
        published."""
        ranks = sorted(roster)
        members = {rank: self._read(rank, roster[rank]) for rank in ranks}
        members[self._world.rank] = self._mine
        try:
            routes = plan_dynamic_routes(self._world.rank, members,
                                         max([*ranks, self._world.rank]) + 1)
        except ValueError as exc:
            raise RpcError(f"{self._me}: invalid device maps: {exc}") from None
        key = f"{self.KEY}/{self._world.rank}"
        sealed.publish(self._world.store, key, self._mine.to_bytes(),
                       label=self._world.holder_label(key, self._world.rank, entering=True))
        return routes

    def admit(self, routes: DeviceRoutes, rank: int) -> Callable[[], None]:
        """A worker joins at ``rank``: take its declaration into ``routes`` (``RpcError``,
        refusing it, if its maps and this worker's do not fit); what undoes that."""
        theirs = self._read(rank, None)
        try:
            return routes.admit(rank, theirs)
        except ValueError as exc:
            raise RpcError(f"worker {self._world.name!r} refuses rank {rank} "
                           f"({theirs.name!r}): invalid device maps: {exc}") from None

    def _read(self, rank: int, name: str | None) -> WorkerDevices:
        """The declaration the worker holding ``rank`` published (before it entered)."""
        key = f"{self.KEY}/{rank}"
        who = f"rank {rank}" + (f" ({name!r})" if name else "")
        if not self._world.store.check([key], self._world.timeout):
            raise RpcError(f"{self._me}: {who} published no device declaration: run the "
                           "same rpcx on every worker")
        (value,) = sealed.read(self._world.store, [key], self._world.timeout,
                               labels=[self._world.holder_label(key, rank)])
        if value is None:
            raise RpcError(f"{self._me}: the device declaration of {who} is not sealed "
                           "with this worker's world key")
        try:
            return WorkerDevices.from_bytes(value)
        except ValueError as exc:
            raise RpcError(f"{self._me}: {who} published an invalid device declaration "
                           f"({exc}); is something other than rpcx writing to the store?"
                           ) from None


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
    if getattr(options, "device_maps", None) and spec.capabilities.cuda_direct:
        raise RpcError(
            f"{me}: device maps in a dynamic world are not supported on the "
            f"{spec.name!r} backend yet (its transport moves device memory itself, and "
            "newcomers' maps are not handed to it); use a backend where rpcx places "
            "tensors (" + ", ".join(
                n for n, other in available_backends().items()
                if other.capabilities.dynamic and not other.capabilities.cuda_direct)
            + "), send CPU tensors, or pass world_size")
