"""One RRef object's place in the lifetime protocol: its ids, its owner, its confirmation.

:class:`ForkState` is what :mod:`rpcx.rref_protocol` drives (it confirms a fork, or gives
up waiting when the owner is gone) and what :class:`rpcx.rref.RRef` reads and waits on.
Neither reaches into the other: each RRef holds one ForkState, and the protocol tracks
the states (weakly: a state lives as long as its RRef).
"""

from __future__ import annotations

import threading

from rpcx.worker import WorkerInfo

__all__ = ["ForkId", "ForkState", "RRefId"]

RRefId = tuple[int, int]  # (creating rank, counter), unique in the world
ForkId = tuple[int, int]  # (rank that made the fork, counter)


class ForkState:
    """The fork ``fork`` of RRef ``rref_id``, owned by ``owner``, and whether the owner
    has confirmed it (registered the fork).

    The confirmation is an event: set once the owner confirmed, or once no confirmation
    can come any more (the owner is gone, or this worker shut down); :attr:`confirmed`
    tells the two apart.
    """

    __slots__ = ("__weakref__", "_settled", "_unconfirmable", "fork", "owner", "rref_id")

    def __init__(self, rref_id: RRefId, owner: WorkerInfo, fork: ForkId, confirmed: bool):
        self.rref_id = rref_id
        self.owner = owner
        self.fork = fork
        self._settled = threading.Event()
        self._unconfirmable = False
        if confirmed:
            self._settled.set()

    @property
    def confirmed(self) -> bool:
        """True once the owner is known to have registered this fork."""
        return self._settled.is_set() and not self._unconfirmable

    @property
    def settled(self) -> bool:
        """True once there is nothing more to wait for: confirmed, or unconfirmable."""
        return self._settled.is_set()

    def confirm(self) -> None:
        """The owner registered this fork (or answered for it)."""
        self._settled.set()

    def give_up(self) -> None:
        """No confirmation can come any more: wake whoever waits, unconfirmed."""
        self._unconfirmable = True
        self._settled.set()

    def wait_settled(self, timeout: float) -> bool:
        """Block until settled; False only after ``timeout`` seconds."""
        return self._settled.wait(timeout)

    def wait(self, timeout: float) -> bool:
        """Block until settled; True if confirmed, False if unconfirmable or after
        ``timeout`` seconds."""
        return self._settled.wait(timeout) and not self._unconfirmable
