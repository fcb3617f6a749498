"""Receive lanes: serve a request on the thread that received it (leader/follower).

Waking another thread costs ~25-75 us on the machines rpcx runs on (a futex wake, often
an inter-processor interrupt in a VM, then a wait for the GIL): more than a small call
spends anywhere else. So a transport that receives on threads of its own can run each
peer's receive loop as a :class:`ReceiveLane`, and the agent then serves requests right
on the receiving thread instead of queueing them for the request pool.

A lane is the *role* of receiving one peer's frames, held by one thread at a time. A
handler that blocks would stop that peer's frames (its replies to our own calls among
them), so the role moves to another thread -- the follower -- while the old one goes on
serving:

* at once, when the handler waits in a way rpcx sees (a nested call's future, an RRef
  confirmation: every wait in rpcx goes through :func:`rpcx._util.pool.blocking`);
* otherwise when a watchdog sees the same request still being served on two successive
  looks, ``WATCH_INTERVAL`` apart (a lock, a sleep, a long computation): the peer's
  frames then wait at most about two intervals.

Frames stay in order: the role moves only while a request is being *served*, after
everything about its frame that must happen in order (notes, in-order handlers) is done,
and the new holder continues with the next frame.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rpcx._util import pool as _pool
from rpcx._util.intra_op import adopt_intra_op_threads

__all__ = ["WATCH_INTERVAL", "LaneWatch", "ReceiveLane", "current_lane"]

log = logging.getLogger("rpcx.lanes")

WATCH_INTERVAL = 0.01  # seconds between the watchdog's looks at lanes that serve
_IDLE_CHECK = 1.0  # the sleeping watchdog's bound on a wait, so it sees close() promptly


class _Local(threading.local):
    lane: ReceiveLane | None = None  # the lane whose role this thread holds


_local = _Local()


def current_lane() -> ReceiveLane | None:
    """The lane whose receiving role the calling thread holds, if any."""
    return _local.lane


class ReceiveLane:
    """The role of receiving (and delivering) one peer's frames.

    The transport runs its receive loop between :meth:`enter` and :meth:`leave`, and
    after delivering each frame asks :meth:`still_held`; ``False`` means another thread
    took over the loop (``resume``, started through ``start_thread``), so this thread
    must stop receiving and return.
    """

    __slots__ = ("__weakref__", "_holder", "_lock", "_serving", "_start_thread", "_watch",
                 "name", "owner", "resume")

    def __init__(
        self,
        name: str,
        resume: Callable[[], None],
        start_thread: Callable[[Callable[[], None]], None],
        owner: object = None,
    ) -> None:
        self.name = name
        self.owner = owner  # the agent that serves this lane's requests
        self.resume = resume
        self._start_thread = start_thread
        self._lock = threading.Lock()
        self._holder: threading.Thread | None = None
        # What is being served now: a token that changes with every request, or None.
        self._serving: object | None = None
        self._watch: LaneWatch | None = None  # told when serving starts (it sleeps idle)

    # ------------------------------------------------------------- transport side

    def enter(self) -> None:
        """The calling thread takes the role (it runs the receive loop from here on)."""
        with self._lock:
            self._holder = threading.current_thread()
        _local.lane = self

    def still_held(self) -> bool:
        """After a delivery: does the calling thread still hold the role?"""
        with self._lock:
            held = self._holder is threading.current_thread()
        if not held:
            _local.lane = None
        return held

    def held_here(self) -> bool:
        """Whether the calling thread holds the role now (no side effect).

        Only the holder can lose the role while it checks this: a ``True`` stays true
        until the holder itself serves a request that hands the role off (or the
        watchdog takes it from a request being served), so a transport may act on it
        under a lock that the next holder also takes before it blocks.
        """
        return self._holder is threading.current_thread()

    def leave(self) -> None:
        """The receive loop ended on the calling thread (the peer is gone)."""
        with self._lock:
            if self._holder is threading.current_thread():
                self._holder = None
        if _local.lane is self:
            _local.lane = None

    # ------------------------------------------------------------------ core side

    def serve(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` (serving a request) on this, the holding thread.

        While it runs, a wait that rpcx sees hands the role to a follower at once, and
        the watchdog hands it over if ``fn`` runs for long.
        """
        # Handlers and backward passes run here: torch's intra-op setting as it is now
        # (taken once per thread, at its first request, not when the lane started).
        adopt_intra_op_threads()
        token = object()
        with self._lock:
            held = self._holder is threading.current_thread()
            nested = held and self._serving is not None
            if held and not nested:
                self._serving = token
        if held and not nested and self._watch is not None:
            self._watch.wake()
        if not held or nested:
            # Not held: the role moved on while this thread served an earlier request
            # (it keeps the lane as its current one until it returns to its loop).
            # Marking the lane serving would let the watchdog move the role off its
            # real holder, which is receiving: two threads would read one peer.
            # Nested (a request served inside another, such as a call to this worker
            # itself): the outer request's token must stay, or ending the inner one
            # would clear it and the outer one could no longer hand the role off.
            fn(*args)
            return
        with _pool.blocker(self):
            try:
                fn(*args)
            finally:
                with self._lock:
                    if self._serving is token:
                        self._serving = None

    @contextmanager
    def blocking(self) -> Iterator[None]:
        """Around a wait inside :meth:`serve`: give the role away first."""
        self.hand_off()
        yield

    def hand_off(self) -> bool:
        """Move the role to a follower if the calling thread holds it while serving."""
        me = threading.current_thread()
        with self._lock:
            if self._holder is not me or self._serving is None:
                return False
            self._holder = None
            self._serving = None
        self._start_thread(self.resume)
        return True

    def _hand_off_if_stuck(self, seen: object | None) -> object | None:
        """The watchdog's look: hand off if ``seen``, the request being served at the
        last look, is still being served. Returns what to compare with next time."""
        with self._lock:
            serving = self._serving
            stuck = serving is not None and serving is seen and self._holder is not None
            if stuck:
                self._holder = None
                self._serving = None
        if not stuck:
            return serving
        log.debug("lane %s: a request has been served for over %.0f ms; another thread "
                  "takes over receiving", self.name, WATCH_INTERVAL * 1e3)
        self._start_thread(self.resume)
        return None


class LaneWatch:
    """One watchdog thread that moves the role off lanes whose handler runs long.

    It looks every ``interval`` only while some lane serves a request; with nothing
    served it sleeps until a lane starts serving (an idle worker's watchdog used to wake
    100 times a second: about 1% of a core, the whole of an idle worker's cost).
    """

    def __init__(self, name: str, interval: float = WATCH_INTERVAL) -> None:
        self._name = name
        self._interval = interval
        self._lanes: weakref.WeakSet[ReceiveLane] = weakref.WeakSet()
        self._wanted = threading.Event()  # a lane started serving since the last look
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def add(self, lane: ReceiveLane) -> None:
        """Watch ``lane`` (until it is garbage or the watch closes)."""
        lane._watch = self
        with self._lock:
            self._lanes.add(lane)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._run, name=f"{self._name}-lanes", daemon=True
                )
                self._thread.start()

    def wake(self) -> None:
        """A lane started serving: look at the lanes (soon) until none serves."""
        if not self._wanted.is_set():
            self._wanted.set()

    def close(self, timeout: float) -> None:
        """Stop watching; joins the thread for at most ``timeout`` seconds."""
        self._stop.set()
        self._wanted.set()
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        seen: dict[int, object | None] = {}
        while not self._stop.is_set():
            if not self._wanted.wait(_IDLE_CHECK):
                continue
            # Cleared before looking: a lane that starts serving after this sets it
            # again, so the watch comes back for it however the looks below end.
            self._wanted.clear()
            while not self._stop.wait(self._interval):
                with self._lock:
                    lanes = list(self._lanes)
                serving = False
                for lane in lanes:
                    try:
                        seen[id(lane)] = lane._hand_off_if_stuck(seen.get(id(lane)))
                        serving = serving or seen[id(lane)] is not None
                    except Exception:  # a follower that cannot start: logged, retried
                        serving = True
                        log.exception("%s: could not hand off lane %s", self._name,
                                      lane.name)
                if len(seen) > 2 * len(lanes) + 16:
                    live = {id(lane) for lane in lanes}
                    seen = {key: value for key, value in seen.items() if key in live}
                if not serving:
                    break  # nothing is being served: sleep until something is
