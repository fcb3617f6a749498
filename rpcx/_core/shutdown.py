"""Leaving the world: the worker's state, the graceful waits, the teardown order.

``shutdown(graceful=True, timeout=t)`` waits until this worker's own calls are done,
then for every live worker at a barrier in the store, then lets services settle what
they owe each other (drain rounds); the teardown follows. The waits get ``t`` less a
teardown share (a quarter, at most a second); the teardown gets the rest, each step at
most what is left (or its own bound, without a timeout). See docs/design/workers.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rpcx._core.pending import PendingCalls
from rpcx._util.timer import remaining, within
from rpcx.errors import RpcTimeoutError

__all__ = ["Lifecycle", "Shutdown", "TeardownStep", "bounded", "each_hook", "step_bound"]

log = logging.getLogger("rpcx.agent")

_PROGRESS_EVERY = 30.0  # seconds between "still waiting" log lines during long waits
_CLOSE_TIMEOUT = 10.0  # bound on each teardown step when shutdown() has no timeout
# shutdown(timeout=t) keeps this share of t (at most _TEARDOWN_MAX seconds) for the
# teardown after the waits for peers: the goodbye exchange above all, which a live peer
# answers in milliseconds (and a gloo process that exits with a receive pending aborts).
_TEARDOWN_SHARE, _TEARDOWN_MAX = 0.25, 1.0
_DRAIN_ROUNDS = 8

# One teardown step: a name (for the log) and what it runs, given shutdown's deadline
# (a time.monotonic() value; None: no timeout was given).
TeardownStep = tuple[str, Callable[[float | None], None]]


def step_bound(deadline: float | None, default: float = _CLOSE_TIMEOUT) -> float:
    """Seconds a teardown step may take: what is left until ``deadline``, and without a
    deadline still at most ``default``."""
    return within(default, remaining(deadline)) or 0.0


def bounded(step: Callable[[float], None]) -> Callable[[float | None], None]:
    """A teardown step from a ``close(timeout)`` that needs a bound in seconds."""
    return lambda deadline: step(step_bound(deadline))


def each_hook(hooks: list[Callable[[float | None], None]], worker: str
              ) -> Callable[[float | None], None]:
    """A teardown step that runs services' close hooks with the seconds left (``None``:
    no bound), logging one that fails and going on."""
    def run(deadline: float | None) -> None:
        for hook in hooks:
            try:
                hook(remaining(deadline))
            except Exception:
                log.exception("%s: close hook failed", worker)
    return run


class Lifecycle:
    """A worker's state: running, then stopping (``shutdown`` began), then closed."""

    RUNNING, STOPPING, CLOSED = "running", "stopping", "closed"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.state = self.RUNNING
        self.stopping = threading.Event()  # set when shutdown() starts

    @property
    def running(self) -> bool:
        """True until ``shutdown`` starts."""
        return self.state == self.RUNNING

    @property
    def closed(self) -> bool:
        """True once the teardown started: no call may be made."""
        return self.state == self.CLOSED

    def begin_stopping(self) -> bool:
        """Move from running to stopping; False if another thread did already."""
        with self.lock:
            if self.state != self.RUNNING:
                return False
            self.state = self.STOPPING
        self.stopping.set()
        return True

    def close(self) -> None:
        """Closed, from any state."""
        with self.lock:
            self.state = self.CLOSED


class Shutdown:
    """One worker's way out of the world.

    Args:
        name, rank, world_size: the worker's.
        alone: a worker of a dynamic world leaves alone: it waits for its own calls and
            settles what it owes, but meets nobody at a barrier (as torch's).
        lifecycle: its state.
        pending: its table of calls waiting for replies.
        store: the rendezvous store (``set``/``get`` with a timeout).
        barrier: ``barrier(tag, timeout)`` over every live worker.
        is_lost: whether a rank is known gone.
        on_drain: services' drain hooks (see ``RpcAgent.on_drain``).
        before_waits: run first (the heartbeat stops: silence is no news now).
        cancel_pending: fails every call still pending (the table is closed).
        teardown: ``teardown(graceful)``: the steps, in order, once the waits are over
            or given up.
    """

    def __init__(
        self, *, name: str, rank: int, world_size: int, lifecycle: Lifecycle,
        alone: bool = False, pending: PendingCalls, store: Any,
        barrier: Callable[[str, float | None], None],
        is_lost: Callable[[int], bool], on_drain: list[Callable[[float | None], int]],
        before_waits: Callable[[], None], cancel_pending: Callable[[], None],
        teardown: Callable[[bool], Sequence[TeardownStep]],
    ) -> None:
        self._name, self._rank, self._world_size = name, rank, world_size
        self._alone = alone
        self._life = lifecycle
        self._pending = pending
        self._store = store
        self._barrier = barrier
        self._is_lost = is_lost
        self._on_drain = on_drain
        self._before_waits = before_waits
        self._cancel_pending = cancel_pending
        self._teardown = teardown

    def run(self, graceful: bool, timeout: float | None) -> bool:
        """Leave the world (see ``RpcAgent.shutdown``); False if already leaving."""
        if not self._life.begin_stopping():
            return False  # another thread is shutting this worker down
        self._before_waits()
        deadline = waits_end = None
        if timeout is not None:
            deadline = time.monotonic() + timeout
            waits_end = deadline - min(timeout * _TEARDOWN_SHARE, _TEARDOWN_MAX)
        try:
            if graceful and self._alone:
                self.wait_until_idle(waits_end)
                for hook in self._on_drain:  # (acknowledged: returns once settled)
                    hook(remaining(waits_end))
                self.wait_until_idle(waits_end)
            elif graceful:
                self.wait_until_idle(waits_end)
                self._barrier("shutdown", remaining(waits_end))
                self._drain(waits_end)
        except Exception as exc:
            log.warning("%s: graceful shutdown incomplete: %s", self._name, exc)
        finally:
            self._close(deadline, graceful)
        return True

    def _drain(self, deadline: float | None) -> None:
        """Let services settle what they owe each other (RRef deletions, say).

        Handling one worker's messages can make another send more (freeing a value can
        release the RRefs inside it), so this runs in rounds, each ending in a barrier,
        until a round in which no worker sent anything.
        """
        for round_ in range(_DRAIN_ROUNDS):
            sent = 0
            for hook in self._on_drain:
                sent += hook(remaining(deadline))
            self.wait_until_idle(deadline)
            tag = f"drained/{round_}"
            # One counter for the world, not a key per worker to read back: a worker
            # lost after adding only costs another round.
            self._store.add(f"{tag}/sent", sent, remaining(deadline))
            self._barrier(tag, remaining(deadline))
            if self._store.add(f"{tag}/sent", 0, remaining(deadline)) == 0:
                return
        log.warning("%s: services still busy after %d drain rounds", self._name,
                    _DRAIN_ROUNDS)

    def wait_until_idle(self, deadline: float | None) -> None:
        """Wait until this worker's calls are all done; ``RpcTimeoutError`` at deadline."""
        started = time.monotonic()
        while True:
            now = time.monotonic()
            left = _PROGRESS_EVERY if deadline is None else min(deadline - now, _PROGRESS_EVERY)
            if self._pending.wait_empty(max(left, 0.0)):
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise RpcTimeoutError(
                    f"{len(self._pending)} calls still pending after {now - started:.1f} s"
                )
            if now - started >= _PROGRESS_EVERY:
                log.info("%s: shutdown waits for %d pending calls (%.0f s so far)",
                         self._name, len(self._pending), now - started)

    def _close(self, deadline: float | None, graceful: bool) -> None:
        self._life.close()
        self._cancel_pending()
        for name, step in self._teardown(graceful):
            try:
                step(deadline)
            except Exception:
                log.exception("%s: error while closing the %s", self._name, name)
        self._store = None  # the last reference may host the rendezvous server: release it
