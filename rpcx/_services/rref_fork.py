"""One RRef object's place in the lifetime protocol: its ids, its owner, its confirmation.

:class:`ForkState` is what :mod:`rpcx._services.rref_protocol` drives (it confirms a fork, or gives
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
    tells the two apart. The event's ``threading.Event`` is made only when a thread has
    to wait for it: most RRefs are confirmed before anyone looks (an RRef ``remote()``
    made, one that came from its owner), and an Event is a Condition and two locks.
    """

    __slots__ = ("__weakref__", "_event", "_settled", "_unconfirmable", "fork", "owner",
                 "rref_id")

    def __init__(self, rref_id: RRefId, owner: WorkerInfo, fork: ForkId, confirmed: bool):
        self.rref_id = rref_id
        self.owner = owner
        self.fork = fork
        self._settled = confirmed
        self._unconfirmable = False
        self._event: threading.Event | None = None  # made by the first waiter

    @property
    def confirmed(self) -> bool:
        """True once the owner is known to have registered this fork."""
        return self._settled and not self._unconfirmable

    @property
    def settled(self) -> bool:
        """True once there is nothing more to wait for: confirmed, or unconfirmable."""
        return self._settled

    def confirm(self) -> None:
        """The owner registered this fork (or answered for it)."""
        self._settled = True  # before the event is read: see wait_settled
        event = self._event
        if event is not None:
            event.set()

    def give_up(self) -> None:
        """No confirmation can come any more: wake whoever waits, unconfirmed."""
        self._unconfirmable = True
        self.confirm()

    def wait_settled(self, timeout: float) -> bool:
        """Block until settled; False only after ``timeout`` seconds."""
        if self._settled:
            return True
        with _EVENTS:
            event = self._event
            if event is None:
                event = self._event = threading.Event()
        # Read after the event is in place: a confirm() that did not see the event set
        # the flag first, so it is seen here.
        return self._settled or event.wait(timeout)

    def wait(self, timeout: float) -> bool:
        """Block until settled; True if confirmed, False if unconfirmable or after
        ``timeout`` seconds."""
        return self.wait_settled(timeout) and not self._unconfirmable


_EVENTS = threading.Lock()  # makes each state's event once (taken only by waiters)
