"""What a worker records for ``rpcx.tracing``: its calls' events, in a bounded ring.

The call path calls a trace policy at each step of a call (docs/design/tracing.md lists
the events): :class:`~rpcx._core.trace_policy.NoTrace` when tracing is off.
:class:`TraceRing`, plugged in while a trace runs, appends one tuple per event to a
``deque`` of fixed length: no lock beyond the deque's own, no I/O, no formatting beyond
the label of a sent call. The file is written when the trace ends.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from rpcx._core.label import CallLabel
from rpcx._core.trace_policy import NoTrace
from rpcx.messages import MessageKind

__all__ = ["DEFAULT_CAPACITY", "NoTrace", "TraceEvent", "TraceRing"]

DEFAULT_CAPACITY = 200_000
"""Events a worker keeps (the newest); about 100 bytes each."""

TraceEvent = tuple[int, str, int, int, int, str]
"""``(t_ns, kind, thread id, peer rank, call id, label)``; see docs/design/tracing.md."""

_now = time.monotonic_ns
# liveness chatter and clock probes, not the program's traffic
_HEARTBEAT, _CLOCK = int(MessageKind.HEARTBEAT), int(MessageKind.CLOCK)
_thread_ids = threading.local()


def _thread_id() -> int:
    """The calling thread's OS id (small, and what py-spy and perf show), asked of the
    OS once per thread: ``get_native_id`` is a system call."""
    try:
        return _thread_ids.value  # type: ignore[no-any-return]
    except AttributeError:
        _thread_ids.value = threading.get_native_id()
        return _thread_ids.value  # type: ignore[no-any-return]


class TraceRing(NoTrace):
    """The trace policy when tracing is on: events go to a ring of ``capacity``.

    A call is recorded from its start: the end of one sent or served before the ring
    was switched on is not (the trace would show a call without a beginning).
    """

    on = True

    def __init__(self, capacity: int = DEFAULT_CAPACITY,
                 kind_names: Callable[[int], str] = str) -> None:
        if capacity <= 0:
            raise ValueError(f"a trace ring needs a positive capacity, not {capacity}")
        self.capacity = capacity
        self.events: collections.deque[TraceEvent] = collections.deque(maxlen=capacity)
        self.threads: dict[int, str] = {}  # thread id: name, of the threads that recorded
        self._kind_names = kind_names
        self._recorded = 0
        self._calling: set[tuple[int, int]] = set()  # (callee, id): sent, not completed
        self._serving: set[tuple[int, int]] = set()  # (caller, id): serve started, not ended
        self._replying: set[tuple[int, int]] = set()  # (caller, id): served, not replied
        self.started_ns = _now()
        self.wall = (self.started_ns, time.time_ns())

    @property
    def dropped(self) -> int:
        """Events pushed out of the ring by newer ones."""
        return max(0, self._recorded - self.capacity)

    def _add(self, kind: str, peer: int, rid: int, label: str) -> None:
        tid = _thread_id()
        if tid not in self.threads:
            self.threads[tid] = threading.current_thread().name
        self.events.append((_now(), kind, tid, peer, rid, label))
        self._recorded += 1  # (racing threads may lose a count: only ``dropped`` reads it)

    def sent(self, peer: int, rid: int, kind: int, label: CallLabel) -> None:
        if kind == _CLOCK:  # (rpcx.tracing's own clock probes)
            return
        try:
            name = f"{label.api}#{label.describe(label.target)}"
        except Exception:  # (recording must never fail a call)
            name = f"{label.api}#{type(label.target).__name__}"
        self._calling.add((peer, rid))
        self._add("send", peer, rid, name)

    def arrived(self, peer: int, rid: int, kind: int) -> None:
        if kind != _CLOCK:
            self._add("arrive", peer, rid, "")

    def serving(self, peer: int, rid: int, kind: int) -> None:
        if not rid or kind == _CLOCK:  # (one-way messages are instants: posted/delivered)
            return
        self._serving.add((peer, rid))
        self._add("serve_start", peer, rid, self._kind_names(kind))

    def served(self, peer: int, rid: int) -> None:
        key = (peer, rid)
        if key in self._serving:
            self._serving.discard(key)
            self._replying.add(key)
            self._add("serve_end", peer, rid, "")

    def replied(self, peer: int, rid: int, ok: bool) -> None:
        key = (peer, rid)
        if key in self._replying:
            self._replying.discard(key)
            self._add("reply", peer, rid, "ok" if ok else "error")

    def completed(self, peer: int, rid: int, outcome: str) -> None:
        key = (peer, rid)
        if key in self._calling:
            self._calling.discard(key)
            self._add("complete", peer, rid, outcome)

    def close(self) -> None:
        """The ring was switched off: drop the arrivals and starts of requests not
        served to the end (when the trace ends from inside a call, that call's serve
        never ends in it). Calls sent and still in flight stay: they were in flight
        when the trace ended."""
        open_serves, self._serving = self._serving, set()
        events = self.snapshot()
        ended = {(e[3], e[4]) for e in events if e[1] == "serve_end"}
        kept = [e for e in events
                if not ((e[1] == "serve_start" and (e[3], e[4]) in open_serves)
                        or (e[1] == "arrive" and (e[3], e[4]) not in ended))]
        if len(kept) != len(events):
            self.events = collections.deque(kept, maxlen=self.capacity)

    def posted(self, peer: int, kind: int) -> None:
        if kind != _HEARTBEAT:  # (liveness chatter, not the program's traffic)
            self._add("instant", peer, 0, f"sent {self._kind_names(kind)}")

    def delivered(self, peer: int, kind: int) -> None:
        if kind != _HEARTBEAT:
            self._add("instant", peer, 0, f"received {self._kind_names(kind)}")

    def instant(self, label: str, peer: int = -1) -> None:
        self._add("instant", peer, 0, label)

    def snapshot(self) -> list[TraceEvent]:
        """The events held now, oldest first (safe while others record)."""
        while True:
            try:
                return list(self.events)
            except RuntimeError:  # "deque mutated during iteration": try again
                continue
