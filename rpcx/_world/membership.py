"""The roster: which worker holds each rank, and, in a dynamic world, who joins and leaves.

A world started with ``world_size`` never changes its roster. A dynamic world (``init_rpc``
without ``world_size``, as torch's) does: a worker that joins after this one is admitted
by the transport when it connects (:meth:`Roster.admit`), and one that shuts down is
struck off when it departs (:meth:`Roster.depart`). Ranks may join in any order, so the
table can have holes: a :class:`~rpcx.worker.VacantRank` holds each until a worker takes
it. The agent's per-rank tables (counters, recent request ids, budgets) grow with it
through ``growers``.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from rpcx.errors import RpcError, UnknownWorkerError
from rpcx.worker import VacantRank, WorkerInfo, find_worker, is_member

__all__ = ["Roster"]

log = logging.getLogger("rpcx.agent")

_GONE_REMEMBERED = 256  # departed workers' names kept to explain a call to one of them


class Roster:
    """Every rank's worker, by rank, and by name.

    Args:
        workers: the world as this worker joined it, by rank (vacant ranks included).
        dynamic: whether workers may join and leave after this one started.
    """

    def __init__(self, workers: list[WorkerInfo], dynamic: bool = False) -> None:
        self.workers = workers  # (shared with the agent's parts: changed in place only)
        self.by_name = {w.name: w for w in workers if is_member(w)}
        self.dynamic = dynamic
        # Run with the new table size before a rank past the end is used.
        self.growers: list[Callable[[int], None]] = []
        # Run with a rank a worker took again after one had left it.
        self.on_rejoin: list[Callable[[int], None]] = []
        self._departed: set[int] = set()
        # name -> (rank, how it went), latest last: errors for calls to a departed name.
        self._gone: collections.OrderedDict[str, tuple[int, str]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def holds(self, rank: int) -> bool:
        """Whether a worker of the world holds ``rank`` now."""
        return (0 <= rank < len(self.workers) and is_member(self.workers[rank])
                and rank not in self._departed)

    def members(self) -> list[WorkerInfo]:
        """The workers of the world now, by rank."""
        return [w for w in self.workers if is_member(w) and w.id not in self._departed]

    def admit(self, worker: WorkerInfo) -> None:
        """``worker`` joined (a dynamic world): it holds its rank from now on.

        Raises ``RpcError`` for a rank or name another worker holds."""
        if not self.dynamic:
            raise RpcError(f"worker {worker.name!r} (rank {worker.id}) tried to join a world "
                           "of fixed size")
        rank = worker.id
        with self._lock:
            holder = self.by_name.get(worker.name)
            if holder is not None and holder.id != rank:
                raise RpcError(f"worker name {worker.name!r} is taken by rank {holder.id}")
            if self.holds(rank) and self.workers[rank] != worker:
                raise RpcError(f"rank {rank} is held by worker {self.workers[rank].name!r}")
            if rank >= len(self.workers):
                size = rank + 1
                for grow in self.growers:
                    grow(size)
                self.workers.extend(VacantRank(r) for r in range(len(self.workers), size))
            rejoined = rank in self._departed
            self._departed.discard(rank)
            self._gone.pop(worker.name, None)
            self.workers[rank] = worker
            self.by_name[worker.name] = worker
        if rejoined:
            for hook in self.on_rejoin:
                hook(rank)
        log.info("worker %r (rank %d) joined the world", worker.name, rank)

    def depart(self, rank: int, how: str = "has shut down") -> None:
        """Worker ``rank`` left a dynamic world (``how``: "has shut down", or why it was
        lost): its name no longer resolves (its rank's entry stays, so errors of calls
        that were pending to it still name it)."""
        if not self.dynamic or not 0 <= rank < len(self.workers):
            return
        with self._lock:
            worker = self.workers[rank]
            if self.by_name.get(worker.name) == worker:
                del self.by_name[worker.name]
                self._gone[worker.name] = (rank, how)
                self._gone.move_to_end(worker.name)
                if len(self._gone) > _GONE_REMEMBERED:
                    self._gone.popitem(last=False)
            self._departed.add(rank)

    def how_gone(self, name: str) -> str | None:
        """Why worker ``name`` is no longer in the world ("worker 'w' (rank 3) has shut
        down"), if it was in it lately."""
        with self._lock:
            found = self._gone.get(name)
        return None if found is None else f"worker {name!r} (rank {found[0]}) {found[1]}"

    def resolve(self, to: str | int | WorkerInfo) -> WorkerInfo:
        """The ``WorkerInfo`` for a name, a rank or a ``WorkerInfo`` of a worker in the
        world now; ``UnknownWorkerError`` naming the workers (and, for a worker that left
        lately, how it went) otherwise."""
        if not self.dynamic:
            return find_worker(self.workers, self.by_name, to)
        try:
            found: WorkerInfo | None = find_worker(self.workers, self.by_name, to)
        except UnknownWorkerError:
            found = None
        if found is None or not self.holds(found.id):
            known = ", ".join(w.name for w in self.members())
            name = to.name if isinstance(to, WorkerInfo) else to
            gone = self.how_gone(name) if isinstance(name, str) else None
            left = (f": {gone}, and is no longer in the world" if gone is not None
                    else " (it left the world)" if found is not None else "")
            raise UnknownWorkerError(
                f"unknown destination worker {name!r}{left}; the workers are: {known}")
        return found
