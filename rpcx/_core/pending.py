"""The table of calls a worker made that wait for their reply, and its one lock rule.

Registering a call, failing every call to a peer that was lost and cancelling all calls
at close each happen under the table's lock, so no call slips in between them: a call
to a peer already lost is refused with the reason, and a call made after close is
refused, where it would otherwise wait forever for a reply nobody sends (the timer that
would have failed it is stopped by then too).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from rpcx._core.label import CallLabel
from rpcx.futures import RpcFuture
from rpcx.worker import WorkerInfo

__all__ = ["PendingCall", "PendingCalls", "Refused"]


class Refused(NamedTuple):
    """Why :meth:`PendingCalls.register` refused a call."""

    closed: bool
    """The worker closed (its table refuses every call)."""
    reason: str
    """Otherwise: why the destination is lost or unresponsive."""


_CLOSED = Refused(True, "")


@dataclass(eq=False)
class PendingCall:
    """One call waiting for its reply: what error messages need to name it."""

    future: RpcFuture[Any]
    dst: WorkerInfo
    label: CallLabel
    started: float
    timeout: float | None
    nbytes: int = 0  # counted against the back-pressure budget to ``dst`` until done
    span: Any = None  # rpcx._core.profiling.CallSpan of a request sent wrapped as PROFILED

    @property
    def call(self) -> str:
        """``api(target)``, as messages name the call: ``rpc_sync(mod.f)``."""
        return self.label.call

    @property
    def elapsed(self) -> float:
        """Seconds since the call was made."""
        return time.monotonic() - self.started


class PendingCalls:
    """Calls waiting for a reply, by request id; thread-safe."""

    def __init__(self) -> None:
        self._calls: dict[int, PendingCall] = {}
        self._lost: dict[int, str] = {}  # rank -> why it is gone
        self._silent: dict[int, str] = {}  # rank -> why it is unresponsive (may come back)
        self._closed = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the table empties

    def __len__(self) -> int:
        return len(self._calls)

    def __contains__(self, rid: object) -> bool:
        return rid in self._calls

    def register(self, rid: int, call: PendingCall) -> Refused | None:
        """Register ``call`` as request ``rid``; ``None``, or why it was refused."""
        with self._lock:
            if self._closed:
                return _CLOSED
            reason = self._lost.get(call.dst.id) or self._silent.get(call.dst.id)
            if reason is None:
                self._calls[rid] = call
                return None
            return Refused(False, reason)

    def get(self, rid: int) -> PendingCall | None:
        """The call waiting for reply ``rid``, still registered."""
        return self._calls.get(rid)

    def pop(self, rid: int) -> PendingCall | None:
        """Remove and return the call ``rid`` (``None`` if it already completed)."""
        with self._lock:
            call = self._calls.pop(rid, None)
            if not self._calls:
                self._idle.notify_all()
        return call

    def lose(self, rank: int, reason: str) -> list[int] | None:
        """Mark ``rank`` lost; the calls waiting on it (``None`` if it already was)."""
        with self._lock:
            if rank in self._lost:
                return None
            self._lost[rank] = reason
            return [rid for rid, call in self._calls.items() if call.dst.id == rank]

    def revive(self, rank: int) -> None:
        """A worker holds ``rank`` again (a dynamic world): calls to it are accepted."""
        with self._lock:
            self._lost.pop(rank, None)
            self._silent.pop(rank, None)

    def silence(self, rank: int, reason: str) -> list[int] | None:
        """Mark ``rank`` unresponsive: new calls to it are refused with ``reason`` until
        :meth:`hear`; the calls waiting on it (``None`` if it is lost or silent)."""
        with self._lock:
            if rank in self._lost or rank in self._silent:
                return None
            self._silent[rank] = reason
            return [rid for rid, call in self._calls.items() if call.dst.id == rank]

    def hear(self, rank: int) -> bool:
        """``rank`` answers again: calls to it are accepted. True if it was silent."""
        with self._lock:
            return self._silent.pop(rank, None) is not None

    def is_silent(self, rank: int) -> bool:
        """Whether ``rank`` is unresponsive right now."""
        return rank in self._silent

    def lost_reason(self, rank: int) -> str | None:
        """Why ``rank`` is gone, or ``None`` while it is not."""
        return self._lost.get(rank)

    def lost(self) -> dict[int, str]:
        """Every lost rank with its reason."""
        return dict(self._lost)

    def close(self) -> list[int]:
        """Refuse new calls; the ids of every call still waiting."""
        with self._lock:
            self._closed = True
            return list(self._calls)

    def wait_empty(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the table to empty; True if it did."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._calls, timeout)
