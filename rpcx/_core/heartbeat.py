"""Heartbeats: find peers that hang without dying.

A dead process closes its connections and its transport reports it at once; a process
that is stopped (``SIGSTOP``), stuck holding the GIL, or on a host that vanished says
nothing. So each worker counts the frames it receives from every peer; a peer it has not
heard from for ``interval`` seconds gets a ping (which it answers), and one silent for
``timeout`` seconds is reported *silent*: the agent fails the calls waiting on it and
refuses new ones, until a frame from it arrives again.

Only a count per peer is touched on the receive path (the agent bumps ``heard[src]``);
everything else runs on this module's one thread.

Silence is counted only while this thread runs. On a starved host the thread that
watches is starved too: when it wakes later than it asked to (by more than one tick),
the time it lost is taken out of every peer's silence, since a frame that arrived
meanwhile could not have been counted either. So CPU starvation of this worker never
makes a peer look silent; a peer that is stopped or hung while this worker runs still
is, after ``timeout`` seconds of this worker's running time.

A starved *peer* is silent too. So before reporting a peer, the watch asks ``vouch`` (on
one host, the kernel: :mod:`rpcx._util.process_watch`) whether its process is alive; while it
is (running, sleeping), the peer is logged as starved and not reported, and calls to it
still fail by their own timeouts. Once it is stopped or gone, or where nobody can say
(another host), the silence is reported as before.

Where the kernel can say (``knows(rank)``: a peer on this host whose process mark is
known), a quiet peer is not pinged at all: the watch asks the kernel instead, and a
process that runs counts as heard from. A ping could only tell the same thing (a peer
whose process runs is never reported anyway), at the price of two frames and two
wake-ups per quiet peer per interval: 64 workers on one host sent each other 4,032
pings a second, which starved the very calls they watched. Peers on other hosts, and
peers already reported silent (a frame must show they are back), are pinged as before.
While any peer is silent the watch looks every 0.1 s: calls to a silent peer are refused
until it is heard, so a peer back from a partition is taken back as soon as its first
frame is counted, not up to a whole tick later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["Heartbeat"]

log = logging.getLogger("rpcx.heartbeat")

_JOIN_TIMEOUT = 2.0  # close() waits this long at most for the thread
# While a peer is reported silent, calls to it are refused until a frame from it is
# counted, so how soon it is seen back after a partition is set by how often the watch
# looks: at the usual tick (heartbeat_interval, 1 s) a link that came back was seen up
# to a tick later. Only while some peer is silent does the watch look this often. Its
# pings keep their interval: pinged every 0.25 s, a gloo peer across a 7 s cut was
# sent enough slots that later calls queued behind them, and one cut in four was
# answered 6.4-6.7 s after the link returned instead of within 0.5 s.
_SILENT_TICK = 0.1


class Heartbeat:
    """Watches ``peers``: pings the quiet ones, reports the silent ones.

    Args:
        name: the worker's name, for the thread.
        peers: the ranks to watch.
        world_size: the size of ``heard``.
        interval: seconds of quiet after which a peer is pinged (again each interval).
        timeout: seconds of quiet after which ``on_silent(rank, seconds)`` is called,
            once; ``on_heard(rank, seconds)`` follows when a frame arrives again.
        ping: sends a ping to a rank; must not block (the agent hands it to its pool).
        heard: the per-rank count of frames received that the receiving side bumps
            (one of ``world_size`` zeros if not given).
        vouch: ``vouch(rank)``: why a silent peer is alive after all (its process runs),
            or ``None``; a peer vouched for is not reported while that holds.
        knows: ``knows(rank)``: whether ``vouch`` answers for ``rank`` from this host's
            kernel, at no cost to anyone else; such a peer is asked about, not pinged.
        connected: ``connected(rank)``: whether this worker has a connection to
            ``rank`` (a transport that connects pairs when they first talk): a peer
            without one is not watched until it has one.
    """

    def __init__(
        self,
        name: str,
        peers: list[int],
        world_size: int,
        *,
        interval: float,
        timeout: float,
        ping: Callable[[int], None],
        on_silent: Callable[[int, float], None],
        on_heard: Callable[[int, float], None],
        heard: list[int] | None = None,
        vouch: Callable[[int], str | None] = lambda rank: None,
        knows: Callable[[int], bool] = lambda rank: False,
        connected: Callable[[int], bool] = lambda rank: True,
    ) -> None:
        # Frames received per rank, bumped by the receiving side (``heard``, if given).
        self.heard = heard if heard is not None else [0] * world_size
        self._peers = list(peers)
        self._interval = interval
        self._timeout = timeout
        self._ping = ping
        self._on_silent = on_silent
        self._on_heard = on_heard
        self._vouch = vouch
        self._knows = knows
        self._connected = connected
        self._vouched: set[int] = set()  # silent peers whose processes run (logged once)
        self._stop = threading.Event()
        # Look often enough that a silent peer is reported within a quarter of the
        # timeout after it is due.
        self._tick = min(interval, timeout / 4)
        self._thread = threading.Thread(target=self._run, name=f"rpcx-{name}-heartbeat",
                                        daemon=True)
        self._forgotten: set[int] = set()
        self._joined: list[int] = []  # ranks to watch from the next tick (list.pop: atomic)

    def start(self) -> None:
        """Start watching."""
        self._thread.start()

    def forget(self, rank: int) -> None:
        """Stop watching ``rank`` (it is lost for good)."""
        self._forgotten.add(rank)

    def watch(self, rank: int) -> None:
        """Watch ``rank`` from now on (a worker that joined a dynamic world), as if just
        heard from."""
        self._joined.append(rank)

    def close(self) -> None:
        """Stop watching; waits (bounded) for the thread."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT)

    def _run(self) -> None:
        self._start_at(time.monotonic())
        while not self._stop.wait(self._next_wait()):
            self._step(time.monotonic())

    def _next_wait(self) -> float:
        """Seconds until the next look: a tick, less while a peer is silent."""
        self._waited = min(self._tick, _SILENT_TICK) if self._silent else self._tick
        return self._waited

    def _start_at(self, now: float) -> None:
        """Start the watch at ``now`` (every peer as if just heard from)."""
        self._counts = {rank: self.heard[rank] for rank in self._peers}
        self._heard_at = {rank: now for rank in self._peers}
        self._last_ping = {rank: now for rank in self._peers}
        self._silent: set[int] = set()
        self._last_step = now
        self._waited = self._tick  # how long the wait before the next look was
        self.stalled = 0.0  # seconds this thread lost to starvation, in all

    def _step(self, now: float) -> None:
        """One look at every peer, at time ``now`` (a tick after the last, or later)."""
        counts, heard_at, last_ping, silent = (
            self._counts, self._heard_at, self._last_ping, self._silent)
        late = now - self._last_step - self._waited
        self._last_step = now
        if late > self._tick:
            # This thread did not run for ``late`` seconds: neither could it count what
            # arrived meanwhile, so that time is not silence.
            self.stalled += late
            for rank in heard_at:
                heard_at[rank] += late
                last_ping[rank] += late
            log.debug("heartbeat ran %.2f s late (this worker was starved of CPU); that "
                      "time is not counted as any peer's silence", late)
        while self._joined:
            rank = self._joined.pop()
            self._forgotten.discard(rank)
            silent.discard(rank)
            if rank not in counts:
                self._peers.append(rank)
            counts[rank], heard_at[rank], last_ping[rank] = self.heard[rank], now, now
        for rank in self._peers:
            if rank in self._forgotten:
                continue
            if not self._connected(rank):  # nothing to hear yet: its silence starts later
                heard_at[rank] = last_ping[rank] = now
                continue
            count = self.heard[rank]
            if count != counts[rank]:
                counts[rank] = count
                if rank in self._vouched:
                    self._vouched.discard(rank)
                    log.info("peer rank %d heard from again after %.1f s", rank,
                             now - heard_at[rank])
                if rank in silent:
                    silent.discard(rank)
                    self._report(self._on_heard, rank, now - heard_at[rank])
                heard_at[rank] = now
            quiet = now - heard_at[rank]
            if quiet >= self._interval and now - last_ping[rank] >= self._interval:
                last_ping[rank] = now
                if rank in silent or not self._knows_of(rank):
                    self._report(self._ping, rank)
                elif self._ask(rank) is not None:
                    heard_at[rank], quiet = now, 0.0  # it runs: as good as a pong
                    self._vouched.discard(rank)
            if quiet >= self._timeout and rank not in silent:
                evidence = self._ask(rank)
                if evidence is not None:
                    if rank not in self._vouched:
                        self._vouched.add(rank)
                        log.info("peer rank %d silent for %.1f s, but %s: starved or busy, "
                                 "not lost (calls to it still time out as usual)", rank,
                                 quiet, evidence)
                    continue
                if rank in self._vouched:
                    self._vouched.discard(rank)
                    log.info("peer rank %d: its process no longer runs; silent for %.1f s",
                             rank, quiet)
                silent.add(rank)
                if self.stalled:
                    log.info("peer rank %d silent for %.1f s of this worker's running "
                             "time (starved of CPU, this worker lost %.1f s since the "
                             "watch began; not counted)", rank, quiet, self.stalled)
                self._report(self._on_silent, rank, quiet)

    def _knows_of(self, rank: int) -> bool:
        try:
            return self._knows(rank)
        except Exception:  # then ping, as for a peer on another host
            log.exception("heartbeat: whether the kernel knows rank %d failed", rank)
            return False

    def _ask(self, rank: int) -> str | None:
        try:
            return self._vouch(rank)
        except Exception:  # no evidence: the silence decides
            log.exception("heartbeat: asking whether rank %d runs failed", rank)
            return None

    @staticmethod
    def _report(callback: Callable[..., None], *args: object) -> None:
        try:
            callback(*args)
        except Exception:  # the watch must go on
            log.exception("heartbeat callback %r failed", callback)
