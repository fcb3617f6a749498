"""Device maps across the world: declarations, validation and the map each message takes.

Every worker's ``device_maps`` (``{worker: {local device: remote device}}``) is shared at
``init_rpc`` (by :mod:`rpcx._core.joining`, as :class:`WorkerDevices`), checked once against
every worker's device count, and turned into :class:`DeviceRoutes`: which map a message
to a given peer uses. A request uses the sender's own map to its destination; a response
travels along the *inverse* of the caller's map to the responder, so a tensor that went
``cuda:0 -> cuda:1`` comes back ``cuda:1 -> cuda:0`` without the responder configuring
anything.

Only non-CPU tensors are mapped; CPU tensors always arrive on the CPU. Where no map
covers a tensor's device the send fails, and the error says which map to set.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rpcx.options import invert_device_map, normalize_device, normalize_device_map

__all__ = [
    "SAME_DEVICE",
    "DeviceMap",
    "DeviceRoutes",
    "WorkerDevices",
    "check_declarations",
    "plan_dynamic_routes",
    "plan_routes",
]

DeviceMap = dict[torch.device, torch.device]


@dataclass(frozen=True)
class WorkerDevices:
    """What one worker declares at ``init_rpc``: its maps, devices and device count."""

    name: str
    device_count: int
    device_maps: dict[str, DeviceMap] = field(default_factory=dict)
    devices: list[torch.device] = field(default_factory=list)

    @classmethod
    def of(cls, name: str, options: Any) -> WorkerDevices:
        """This process's declaration, from any options object (plain ones have no maps)."""
        maps = getattr(options, "device_maps", None) or {}
        devices = getattr(options, "devices", None) or []
        return cls(
            name=name,
            device_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            device_maps={to: normalize_device_map(m) for to, m in maps.items()},
            devices=[normalize_device(d) for d in devices],
        )

    def to_bytes(self) -> bytes:
        """JSON (devices as strings): what other workers read must not be able to run
        code in them, and anyone who can reach the rendezvous store can write it."""
        plain = {
            "name": self.name,
            "device_count": self.device_count,
            "device_maps": {to: {str(k): str(v) for k, v in m.items()}
                            for to, m in self.device_maps.items()},
            "devices": [str(d) for d in self.devices],
        }
        return json.dumps(plain, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> WorkerDevices:
        """Inverse of :meth:`to_bytes`; ``ValueError`` for anything it did not write."""
        try:
            plain = json.loads(data)
            name, count = plain["name"], plain["device_count"]
            maps, devices = plain["device_maps"], plain["devices"]
            if not (isinstance(name, str) and type(count) is int and count >= 0
                    and isinstance(maps, dict) and isinstance(devices, list)
                    and all(isinstance(m, dict) for m in maps.values())):
                raise TypeError("unexpected field types")
            return cls(
                name=name,
                device_count=count,
                device_maps={
                    str(to): {torch.device(str(k)): torch.device(str(v)) for k, v in m.items()}
                    for to, m in maps.items()
                },
                devices=[torch.device(str(d)) for d in devices],
            )
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            raise ValueError(f"not a device declaration: {type(exc).__name__}: {exc}") from None


class _SameDevice(Mapping[torch.device, torch.device]):
    """The map of a call to oneself without a map of its own: every device to itself."""

    def __getitem__(self, device: torch.device) -> torch.device:
        return device

    def __iter__(self) -> Iterator[torch.device]:
        return iter(())

    def __len__(self) -> int:
        return 0


SAME_DEVICE: Mapping[torch.device, torch.device] = _SameDevice()


@dataclass
class DeviceRoutes:
    """The device maps one worker uses, by peer rank.

    Attributes:
        names: every worker's name, by rank.
        outgoing: ``rank -> {local: remote}`` for requests this worker sends.
        incoming: ``rank -> {local: remote}`` for responses this worker sends, the
            inverse of that peer's map to this worker.
        devices: the accelerator devices this worker uses (declared, or those its maps
            and the inverse maps name).
    """

    rank: int
    names: list[str]
    outgoing: dict[int, DeviceMap] = field(default_factory=dict)
    incoming: dict[int, DeviceMap] = field(default_factory=dict)
    devices: list[torch.device] = field(default_factory=list)
    declared: WorkerDevices | None = None  # this worker's declaration, where there is one

    def connect(self, peer: int, theirs: WorkerDevices) -> None:
        """Take the routes to and from worker ``peer`` (declared ``theirs``; checked):
        this worker's map to it, the inverse of its map to this worker."""
        me = self.declared
        if me is None:
            return
        mine, back = me.device_maps.get(theirs.name), theirs.device_maps.get(me.name)
        self.outgoing.pop(peer, None)
        self.incoming.pop(peer, None)
        if mine:
            self.outgoing[peer] = dict(mine)
        if back:
            self.incoming[peer] = invert_device_map(back)
        self._take_devices()

    def _take_devices(self) -> None:
        """This worker's devices: as declared, else those its routes name now."""
        me = self.declared
        if me is not None and me.devices:
            self.devices = list(me.devices)
            return
        used = {d for table in (self.outgoing, self.incoming) for m in table.values()
                for d in m}
        self.devices = sorted((d for d in used if d.type != "cpu"),
                              key=lambda d: (d.type, d.index))

    def admit(self, peer: int, theirs: WorkerDevices) -> Callable[[], None]:
        """A worker joins a dynamic world at ``peer``, declaring ``theirs``: check the
        maps between it and this worker (``ValueError`` naming the entry at fault, as
        :func:`plan_routes`) and take its routes; a map this worker holds to its name
        applies from now on. Returns what undoes it (the worker was refused after all)."""
        me = self.declared
        if me is None:
            return lambda: None
        check_declarations([me, theirs], later=True)
        before = (list(self.names), self.outgoing.get(peer), self.incoming.get(peer))
        self.names.extend(f"<rank {r}: vacant>" for r in range(len(self.names), peer + 1))
        self.names[peer] = theirs.name
        self.connect(peer, theirs)

        def undo() -> None:
            names, outgoing, incoming = before
            self.names[:] = names  # (in place: the list is shared)
            for table, old in ((self.outgoing, outgoing), (self.incoming, incoming)):
                table.pop(peer, None)
                if old is not None:
                    table[peer] = old
            self._take_devices()

        return undo

    def for_request(self, dst: int) -> Mapping[torch.device, torch.device] | None:
        """The map a request (or one-way message) to rank ``dst`` takes."""
        found = self.outgoing.get(dst)
        if found is None and dst == self.rank:
            return SAME_DEVICE  # a call to oneself keeps tensors where they are
        return found

    def for_response(self, src: int) -> Mapping[torch.device, torch.device] | None:
        """The map a response to rank ``src``'s request takes."""
        found = self.incoming.get(src)
        if found is None and src == self.rank:
            return SAME_DEVICE
        return found

    def target(self, peer: int, device: torch.device, response: bool) -> torch.device | None:
        """Where a tensor on ``device`` lands at ``peer``; ``None`` if no map says."""
        mapping = self.for_response(peer) if response else self.for_request(peer)
        return None if mapping is None else mapping.get(device)

    def explain_missing(self, peer: int, device: torch.device, response: bool) -> str:
        """Why a tensor on ``device`` cannot travel to ``peer``, and which map to set."""
        me, other = self.names[self.rank], self.names[peer]
        if not response:
            return (
                f"worker {me!r} has no device map entry for {device} toward worker "
                f"{other!r}; call options.set_device_map({other!r}, {{{str(device)!r}: "
                f"<device on {other}>}}) before init_rpc on {me!r}, or move the tensor "
                "to the CPU"
            )
        return (
            f"a response from worker {me!r} to {other!r} holds a tensor on {device}, and "
            f"responses travel along the inverse of {other!r}'s device map to {me!r}, "
            f"which has no entry mapping to {device}; call options.set_device_map({me!r}, "
            f"{{<device on {other}>: {str(device)!r}}}) before init_rpc on {other!r}, "
            "or return CPU tensors"
        )


def plan_routes(rank: int, everyone: Sequence[WorkerDevices]) -> DeviceRoutes:
    """Check every worker's declaration and build the routes of worker ``rank``.

    Raises ``ValueError`` naming the worker and the entry at fault: a map to an unknown
    worker, a device index past a worker's device count, a map that is not one-to-one,
    a mapped device missing from a worker's explicit ``devices``.
    """
    check_declarations(everyone)
    return _routes(rank, dict(enumerate(everyone)), len(everyone))


def plan_dynamic_routes(rank: int, members: Mapping[int, WorkerDevices],
                        size: int) -> DeviceRoutes:
    """:func:`plan_routes` for a worker joining a dynamic world: ``members`` by rank (this
    worker's included), ``size`` ranks in all (the others vacant). A map to a worker not
    in the world yet is kept for when it joins (:meth:`DeviceRoutes.admit`)."""
    check_declarations(list(members.values()), later=True)
    return _routes(rank, members, size)


def check_declarations(everyone: Sequence[WorkerDevices], later: bool = False) -> None:
    """Check the declarations of ``everyone`` against each other (see
    :func:`plan_routes`); ``later``: a map to a worker not among them is one that may
    join later (a dynamic world), not an error."""
    names = [w.name for w in everyone]
    by_name = {w.name: w for w in everyone}
    for worker in everyone:
        for device in worker.devices:
            _check_device(device, worker.name, "devices", worker)
        for to, device_map in worker.device_maps.items():
            if to not in by_name:
                if later:  # (its own devices can be checked now; the peer's when it joins)
                    for src in device_map:
                        _check_device(src, worker.name, f"device map to {to!r}", worker)
                    continue
                raise ValueError(
                    f"worker {worker.name!r} has a device map to {to!r}, which is not a "
                    f"worker of this world ({', '.join(names)})"
                )
            peer = by_name[to]
            seen: dict[torch.device, torch.device] = {}
            for src, dst in device_map.items():
                _check_device(src, worker.name, f"device map to {to!r}", worker)
                _check_device(dst, worker.name, f"device map to {to!r}", peer)
                if dst in seen:
                    raise ValueError(
                        f"worker {worker.name!r}: device map to {to!r} maps both "
                        f"{seen[dst]} and {src} to {dst} (maps must be one-to-one)"
                    )
                seen[dst] = src
    for worker in everyone:
        if worker.devices:  # declared explicitly: every mapped device must be in it
            _check_declared(worker, everyone)


def _routes(rank: int, members: Mapping[int, WorkerDevices], size: int) -> DeviceRoutes:
    """The routes of worker ``rank`` among ``members`` (checked), ``size`` ranks in all."""
    me = members[rank]
    names = [members[r].name if r in members else f"<rank {r}: vacant>" for r in range(size)]
    routes = DeviceRoutes(rank, names, declared=me)
    for peer, worker in members.items():
        routes.connect(peer, worker)
    return routes


def _check_declared(worker: WorkerDevices, everyone: Sequence[WorkerDevices]) -> None:
    declared = set(worker.devices)
    used = [(src, f"its device map to {to!r}") for to, m in worker.device_maps.items()
            for src in m]
    used += [(dst, f"{other.name!r}'s device map to it") for other in everyone
             for dst in other.device_maps.get(worker.name, {}).values()]
    for device, where in used:
        if device.type != "cpu" and device not in declared:
            raise ValueError(
                f"worker {worker.name!r}: {where} uses {device}, which is not in its "
                f"devices {[str(d) for d in worker.devices]}"
            )


def _check_device(
    device: torch.device, owner: str, where: str, holder: WorkerDevices
) -> None:
    """``owner``'s ``where`` names ``device``, which must exist on worker ``holder``."""
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ValueError(
            f"worker {owner!r}: {where} names {device}; rpcx maps CPU and CUDA devices only"
        )
    index = device.index if device.index is not None else 0
    if not 0 <= index < holder.device_count:
        raise ValueError(
            f"worker {owner!r}: {where} names {device}, but worker {holder.name!r} has "
            f"{holder.device_count} CUDA device(s)"
        )
