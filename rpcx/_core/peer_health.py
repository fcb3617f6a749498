"""Peer health: lost peers, silent peers, and the heartbeat that finds the silent ones.

A transport reports a peer gone (``peer_lost(rank, cause, detail)``); a heartbeat
(:mod:`rpcx._core.heartbeat`, multi-process backends) reports one silent past
``heartbeat_timeout``. Either way every call pending to it fails at once with an error
that names the worker, the call and why; a lost peer stays lost, a silent one is
accepted again when it answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rpcx._core.heartbeat import Heartbeat
from rpcx._core.pending import PendingCall, PendingCalls
from rpcx._core.shutdown import Lifecycle
from rpcx._util.pool import WorkerPool
from rpcx.errors import LostCause, PeerLostError, RpcShutdownError, lost_reason
from rpcx.messages import LEAVING_AT_EXIT, LEAVING_THREAD_ENDED, PING, PONG, MessageKind
from rpcx.worker import WorkerInfo, is_member

__all__ = ["PeerHealth"]

log = logging.getLogger("rpcx.agent")


# What a LEAVING message's code says of its sender, as the end of "worker 'name' (rank N) ...".
_FAREWELLS = {
    LEAVING_AT_EXIT: "left without calling shutdown(): its program exited",
    LEAVING_THREAD_ENDED: "left without calling shutdown(): its spawned thread ended",
}


class PeerHealth:
    """What this worker knows of its peers' health, and what it does about it.

    Args:
        name: this worker's name; ``workers``: every worker, by rank.
        lifecycle: this worker's state (a peer leaving while it stops is expected).
        pending: the calls waiting for replies (it also records lost and silent peers).
        fail: ``fail(rids, error)`` settles those calls with ``error(pending)``.
        on_forget: run with a rank when it is lost (policies drop what they keep for it).
        heartbeat_timeout: the option's value, for messages.
        send_one_way: sends the heartbeat's pings and pongs.
        departures_expected: a peer that shuts down is news, not a warning (a dynamic
            world, where workers leave when they are done).
    """

    def __init__(
        self, *, name: str, workers: list[WorkerInfo], lifecycle: Lifecycle,
        pending: PendingCalls,
        fail: Callable[[list[int], Callable[[PendingCall], BaseException]], None],
        on_forget: list[Callable[[int], None]], heartbeat_timeout: float,
        send_one_way: Callable[[WorkerInfo, MessageKind, Any], None],
        departures_expected: bool = False,
    ) -> None:
        self._departures_expected = departures_expected
        self._send_one_way = send_one_way
        self._name = name
        self._workers = workers
        self._life = lifecycle
        self._pending = pending
        self._fail = fail
        self._on_forget = on_forget
        self.on_peer_lost: list[Callable[[int], None]] = []  # services' hooks
        self.on_peer_silent: list[Callable[[int], None]] = []  # (rpcx.tracing's)
        self._lock = threading.Lock()
        self._lost_handled: set[int] = set()  # lost peers whose hooks ran
        self._lost_causes: dict[int, LostCause] = {}  # why each lost peer is gone
        self._farewells: dict[int, str] = {}  # peers leaving without shutdown(): how
        self._lost_cond = threading.Condition(self._lock)
        self._heard_again = threading.Condition(self._lock)
        self._heartbeat: Heartbeat | None = None
        self._heartbeat_timeout = heartbeat_timeout
        self._beating: set[tuple[int, int]] = set()  # (peer, ping or pong) on its way
        self._said_alive: dict[int, float] = {}  # when each sender last got our pong
        self._interval = 0.0  # the heartbeat's, once it runs
        self._pool: WorkerPool | None = None
        # Frames received per peer, bumped by the call path; the heartbeat reads it.
        self.heard = [0] * len(workers)

    def progress(self, rank: int) -> None:
        """Part of a large frame from ``rank`` arrived (``TransportContext.progress``).

        As good as a frame from it for our heartbeat; and, once per heartbeat interval,
        this worker tells ``rank`` it is alive (a pong): that peer's pings wait behind
        the frame it is still sending, and without the word it would find this worker
        silent. The word comes from this process, so a peer that stops reading (a
        stopped process, whose kernel still takes bytes) is found silent on time."""
        heard = self.heard
        if rank >= len(heard):
            return
        heard[rank] += 1  # (a lost increment between threads still counts)
        if self._heartbeat is None:
            return
        now = time.monotonic()
        if now - self._said_alive.get(rank, -self._interval) >= self._interval:
            self._said_alive[rank] = now
            self._beat(rank, PONG)

    # ------------------------------------------------------------------ lost

    def peer_lost(self, rank: int, cause: LostCause, detail: str = "") -> None:
        """A transport says worker ``rank`` is gone (``TransportContext.peer_lost``)."""
        self.lost(rank, lost_reason(cause, detail), cause)

    def lost(self, rank: int, reason: str, cause: LostCause) -> None:
        """Worker ``rank`` is gone for ``reason``: fail its calls, run the hooks; once."""
        text = f"worker {self._workers[rank].name!r} (rank {rank}) {reason}"
        self._lost_causes.setdefault(rank, cause)  # (before the calls fail: they read it)
        if self._heartbeat is not None:
            self._heartbeat.forget(rank)
        for forget in self._on_forget:
            forget(rank)
        victims = self._pending.lose(rank, text)
        if victims is None:
            return  # already known
        # A peer that leaves while we shut down is expected; one that dies never is.
        # In a dynamic world workers leave when they are done: news, unless calls to
        # it were still waiting.
        running = self._life.running
        expected = cause is LostCause.DEPARTED and (self._departures_expected or not running)
        if not expected or (victims and running):
            log.warning("%s: %s; failing %d pending calls", self._name, text, len(victims))
        else:
            log.log(logging.INFO if running else logging.DEBUG, "%s: %s", self._name, text)
        self._fail(victims, lambda p: self.lost_error(p, text))
        for hook in self.on_peer_lost:
            try:
                hook(rank)
            except Exception:
                log.exception("%s: peer-lost hook failed", self._name)
        with self._lock:
            self._lost_handled.add(rank)
            self._lost_cond.notify_all()

    def lost_error(self, pending: PendingCall, reason: str) -> BaseException:
        """The error of ``pending``, whose peer is lost or silent for ``reason``."""
        rank = pending.dst.id
        cause = self._lost_causes.get(rank) or (
            LostCause.UNRESPONSIVE if self._pending.is_silent(rank) else None)
        return PeerLostError(f"{pending.call} to worker {pending.dst.name!r} failed: {reason}",
                             cause=cause)

    def is_lost(self, rank: int) -> bool:
        """Whether worker ``rank`` is known to be gone (died, or left the world)."""
        return self._pending.lost_reason(rank) is not None

    def error_for(self, rank: int, call: str) -> PeerLostError:
        """The error of ``call`` to worker ``rank``, known gone: worded as every call's."""
        name = self._workers[rank].name
        why = self._pending.lost_reason(rank) or f"worker {name!r} is gone"
        return PeerLostError(f"{call} to worker {name!r} failed: {why}",
                             cause=self._lost_causes.get(rank))

    def wait_lost(self, rank: int, timeout: float | None) -> bool:
        """Wait until worker ``rank`` is known gone and handled; False after ``timeout``."""
        with self._lock:
            return self._lost_cond.wait_for(lambda: rank in self._lost_handled, timeout)

    def lost_causes(self) -> dict[str, LostCause]:
        """Workers known to be gone, with the cause their transport reported, by name."""
        return {self._workers[r].name: cause for r, cause in self._lost_causes.items()
                if self._pending.lost_reason(r) is not None}

    def stats(self) -> dict[str, Any]:
        """``lost_peers``, ``lost_causes`` (values) and ``unresponsive_peers`` (names)."""
        return {
            "lost_peers": self.lost_peers(),
            "lost_causes": {name: cause.value for name, cause in self.lost_causes().items()},
            "unresponsive_peers": [w.name for w in self._workers
                                   if is_member(w) and self.is_unresponsive(w.id)],
        }

    def lost_peers(self) -> dict[str, str]:
        """Workers known to be gone, with the reason, by name."""
        return {self._workers[r].name: why for r, why in self._pending.lost().items()}

    # ------------------------------------------------------ a dynamic world

    def grow(self, size: int) -> None:
        """The roster grew to ``size`` ranks (a worker joined past the end)."""
        self.heard.extend([0] * (size - len(self.heard)))

    def watch(self, rank: int) -> None:
        """A worker took ``rank`` (it joined a dynamic world): it is healthy until it
        says otherwise, and the heartbeat watches it."""
        self._pending.revive(rank)
        with self._lock:
            self._lost_causes.pop(rank, None)
            self._lost_handled.discard(rank)
            self._farewells.pop(rank, None)  # (the rank's last holder's, if it came late)
        if self._heartbeat is not None:
            self._heartbeat.watch(rank)

    # ---------------------------------------------------------------- silent

    def start_heartbeat(self, rank: int, interval: float, pool: WorkerPool,
                        vouch: Callable[[int], str | None] = lambda rank: None,
                        knows: Callable[[int], bool] = lambda rank: False,
                        connected: Callable[[int], bool] = lambda rank: True) -> None:
        """Ping quiet peers every ``interval`` s (or ask the kernel, where ``knows(rank)``);
        report those silent past the timeout, unless ``vouch(rank)`` says the peer's
        process still runs; peers not ``connected`` are not watched (see Heartbeat)."""
        self._interval, self._pool = interval, pool

        def ping(peer: int) -> None:
            self._beat(peer, PING)

        self._heartbeat = Heartbeat(
            self._name, [w.id for w in self._workers
                         if w.id != rank and is_member(w) and w.id not in self._lost_causes],
            len(self._workers),
            interval=interval, timeout=self._heartbeat_timeout, ping=ping, on_silent=self.on_silent,
            on_heard=self.on_heard_again, heard=self.heard, vouch=vouch, knows=knows,
            connected=connected,
        )
        self._heartbeat.start()

    def _beat(self, peer: int, payload: int) -> None:
        """Send ``peer`` a ping or a pong from the pool (a send may wait); one of each in
        flight per peer. Pings stop once shutdown starts; pongs do not (a worker in
        ``shutdown()`` still serves, as a parameter server that called it at once)."""
        key = (peer, payload)
        with self._lock:
            if key in self._beating or self._pool is None or (
                    payload == PING and not self._life.running):
                return
            self._beating.add(key)
            pool = self._pool

        def send() -> None:
            try:
                self._send_one_way(self._workers[peer], MessageKind.HEARTBEAT, payload)
            finally:
                with self._lock:
                    self._beating.discard(key)

        try:
            pool.submit(send)
        except RpcShutdownError:
            with self._lock:
                self._beating.discard(key)

    def stop_heartbeat(self) -> None:
        """Peers leave now: silence is no news."""
        if self._heartbeat is not None:
            self._heartbeat.close()

    def on_leaving(self, caller: WorkerInfo, payload: Any) -> None:
        """A ``LEAVING`` message: ``caller`` leaves without having called ``shutdown()``.
        Its goodbye follows; it is reported with these words instead of "has shut down"."""
        if self.is_lost(caller.id):
            return  # (too late: its departure is told already)
        how = _FAREWELLS.get(payload if isinstance(payload, int) else -1,
                             "left without calling shutdown()")
        with self._lock:
            self._farewells[caller.id] = how

    def farewell(self, rank: int) -> str | None:
        """How worker ``rank`` said it leaves, if it said so (``LEAVING``); once."""
        with self._lock:
            return self._farewells.pop(rank, None)

    def on_heartbeat(self, caller: WorkerInfo, payload: Any) -> None:
        """A heartbeat message: answer a ping (any frame counts as heard)."""
        if payload == PING:
            self._send_one_way(caller, MessageKind.HEARTBEAT, PONG)

    def on_silent(self, rank: int, quiet: float) -> None:
        """Worker ``rank`` was silent for ``quiet`` s: fail its calls, refuse new ones."""
        text = (f"worker {self._workers[rank].name!r} (rank {rank}) is unresponsive: silent "
                f"for {quiet:.1f} s (heartbeat_timeout {self._heartbeat_timeout:g} s)")
        victims = self._pending.silence(rank, text)
        if victims is None:
            return
        log.warning("%s: %s; failing %d pending calls; calls to it fail until it answers",
                    self._name, text, len(victims))
        self._fail(victims, lambda p: self.lost_error(p, text))
        for hook in self.on_peer_silent:
            try:
                hook(rank)
            except Exception:
                log.exception("%s: silent-peer hook failed", self._name)

    def on_heard_again(self, rank: int, quiet: float) -> None:
        """Worker ``rank`` answers again after ``quiet`` s: calls to it are accepted."""
        if self._pending.hear(rank):
            log.warning("%s: worker %r (rank %d) answers again after %.1f s of silence",
                        self._name, self._workers[rank].name, rank, quiet)
        with self._lock:
            self._heard_again.notify_all()

    def wait_responsive(self, rank: int, timeout: float) -> bool:
        """Wait (at most ``timeout``) until worker ``rank`` is not marked unresponsive."""
        with self._lock:
            return self._heard_again.wait_for(lambda: not self._pending.is_silent(rank),
                                              timeout)

    def is_unresponsive(self, rank: int) -> bool:
        """Whether worker ``rank`` is silent past ``heartbeat_timeout`` right now."""
        return self._pending.is_silent(rank)
