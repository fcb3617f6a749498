"""Worker identity: :class:`WorkerInfo` and the rules for worker names."""

from __future__ import annotations

import functools
import re
from typing import Any

__all__ = ["WorkerInfo", "validate_worker_name"]

_NAME_RE = re.compile(r"[A-Za-z0-9_\-:]+")
MAX_NAME_LENGTH = 128


@functools.total_ordering
class WorkerInfo:
    """The name and id (rank) of a worker in the RPC world.

    Immutable, hashable, comparable and picklable, so it can be used as a dict key and
    passed in calls, like ``torch.distributed.rpc.WorkerInfo``.
    """

    __slots__ = ("_id", "_name")
    _id: int
    _name: str

    def __init__(self, name: str, id: int) -> None:
        object.__setattr__(self, "_name", str(name))
        object.__setattr__(self, "_id", int(id))

    @property
    def name(self) -> str:
        """The worker's name, unique in its world."""
        return self._name

    @property
    def id(self) -> int:
        """The worker's rank, ``0 <= id < world_size``."""
        return self._id

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("WorkerInfo is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WorkerInfo):
            return NotImplemented
        return self._id == other._id and self._name == other._name

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, WorkerInfo):
            return NotImplemented
        return (self._id, self._name) < (other._id, other._name)

    def __hash__(self) -> int:
        return hash((self._id, self._name))

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self._id}, name={self._name})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (WorkerInfo, (self._name, self._id))


def validate_worker_name(name: object) -> str:
    """Return ``name`` if it is a valid worker name, else raise ``ValueError`` saying why."""
    if not isinstance(name, str):
        raise TypeError(f"worker name must be a str, got {type(name).__name__}")
    if not name or len(name) >= MAX_NAME_LENGTH:
        raise ValueError(
            f"worker name must have 1 to {MAX_NAME_LENGTH - 1} characters, got {len(name)}"
        )
    if not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"worker name {name!r} may only contain letters, digits, '_', '-' and ':'"
        )
    return name
