"""Worker identity: :class:`WorkerInfo` and the rules for worker names."""

from __future__ import annotations

import functools
import re
from typing import Any

from rpcx.errors import InvalidWorkerNameError, UnknownWorkerError

__all__ = ["VacantRank", "WorkerInfo", "find_worker", "is_member", "validate_worker_name"]

_NAME_RE = re.compile(r"[A-Za-z0-9_\-:]+")
MAX_NAME_LENGTH = 128


@functools.total_ordering
class WorkerInfo:
    """The name and id (rank) of a worker in the RPC world.

    Immutable, hashable, comparable and picklable, so it can be used as a dict key and
    passed in calls, like ``torch.distributed.rpc.WorkerInfo``. As torch's, it refuses
    an invalid name (see :func:`validate_worker_name`).
    """

    __slots__ = ("_id", "_name")
    _id: int
    _name: str

    def __init__(self, name: str, id: int) -> None:
        object.__setattr__(self, "_name", _checked(str(name)))
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


class VacantRank(WorkerInfo):
    """A rank of a dynamic world that no worker holds (yet, or any more).

    It keeps the agent's tables indexed by rank when ranks join out of order. It never
    leaves the worker: ``get_worker_infos`` and name lookups skip it, and calls to it
    fail as to a peer that is gone. Its name (``"<rank N: vacant>"``) is no valid worker
    name, so it cannot clash with one.
    """

    __slots__ = ()

    def __init__(self, id: int) -> None:  # (no name check: the name is deliberately invalid)
        object.__setattr__(self, "_name", f"<rank {int(id)}: vacant>")
        object.__setattr__(self, "_id", int(id))

    def __reduce__(self) -> tuple[Any, ...]:
        return (VacantRank, (self._id,))


def is_member(worker: WorkerInfo) -> bool:
    """Whether ``worker`` is a worker of the world, not a :class:`VacantRank`."""
    return not isinstance(worker, VacantRank)


def validate_worker_name(name: object) -> str:
    """Return ``name`` if it is a valid worker name, else raise saying why.

    Valid: 1 to 127 letters, digits, ``_``, ``-`` and ``:`` (torch's rule). The error is
    an :class:`~rpcx.errors.InvalidWorkerNameError`, both a ``ValueError`` and (as
    torch raises) a ``RuntimeError``; its message contains torch's wording ("Worker name
    must match", "must be non-empty", "shorter than 128"). A non-string is a ``TypeError``.
    """
    if not isinstance(name, str):
        raise TypeError(f"worker name must be a str, got {type(name).__name__}")
    return _checked(name)


@functools.lru_cache(maxsize=1024)
def _checked(name: str) -> str:
    # Cached: WorkerInfo objects are rebuilt from the same few names on every RRef that
    # arrives, and a name once valid stays valid. Errors are not cached.
    if not name:
        raise InvalidWorkerNameError(
            f"Worker name must be non-empty: a worker name has 1 to {MAX_NAME_LENGTH - 1} "
            "characters, got 0"
        )
    if len(name) >= MAX_NAME_LENGTH:
        raise InvalidWorkerNameError(
            f"Worker name must be shorter than {MAX_NAME_LENGTH} characters: a worker name "
            f"has 1 to {MAX_NAME_LENGTH - 1} characters, got {len(name)} ({name[:32]!r}...)"
        )
    if not _NAME_RE.fullmatch(name):
        raise InvalidWorkerNameError(
            f"Worker name must match ^[A-Za-z0-9_:-]+$: worker name {name!r} may only "
            "contain letters, digits, '_', '-' and ':'"
        )
    return name


def find_worker(workers: list[WorkerInfo], by_name: dict[str, WorkerInfo],
                to: str | int | WorkerInfo) -> WorkerInfo:
    """The worker ``to`` names: a name, a rank or a ``WorkerInfo`` of this world.

    ``UnknownWorkerError`` (listing the workers) if there is none; ``TypeError`` for
    anything else.
    """
    if isinstance(to, WorkerInfo):
        if 0 <= to.id < len(workers) and workers[to.id] == to:
            return to
    elif isinstance(to, str):
        found = by_name.get(to)
        if found is not None:
            return found
    elif isinstance(to, int) and not isinstance(to, bool):
        if 0 <= to < len(workers) and is_member(workers[to]):
            return workers[to]
    else:
        raise TypeError(
            f"destination must be a worker name, rank or WorkerInfo, got {type(to).__name__}"
        )
    known = ", ".join(w.name for w in workers if is_member(w))
    raise UnknownWorkerError(f"unknown destination worker {to!r}; the workers are: {known}")
