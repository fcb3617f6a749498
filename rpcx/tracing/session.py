"""A worker's trace session: the ring it records into, its clock's offset to the
reference worker's, and the file it writes when the trace ends (docs/design/tracing.md).

``rpcx.tracing`` is the public face (``start``, ``stop``, ``trace``); ``init_rpc`` and
``shutdown`` start and end a session when ``$RPCX_TRACE`` or the ``trace_dir`` option
asks for one.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import socket
import threading
import time
from typing import Any

from rpcx._core import context as _context
from rpcx._core.service_host import CallLabel, ServiceHost
from rpcx.messages import MessageKind
from rpcx.tracing.ring import DEFAULT_CAPACITY, NoTrace, TraceRing

__all__ = [
    "CLOCK_PROBES",
    "CLOCK_REFRESH_S",
    "FORMAT",
    "TraceSession",
    "begin_session",
    "discard_session",
    "end_session",
    "session_of",
]

log = logging.getLogger("rpcx.tracing")

FORMAT = "rpcx-trace/1"
CLOCK_PROBES = 5
"""Round trips per clock sample; the one with the shortest round trip is kept."""
CLOCK_REFRESH_S = 10.0
"""Seconds between clock samples while a trace runs (clocks drift apart slowly)."""
CLOCK_PROBE_TIMEOUT_S = 10.0
"""Bound on one probe (a reference that does not answer costs a sample, not a hang)."""
_SERVICE = "tracing"


def _kind_name(kind: int) -> str:
    try:
        return MessageKind(kind).name
    except ValueError:
        return str(kind)


class TraceSession:
    """One worker's trace, from :meth:`begin` to :meth:`end`."""

    def __init__(self, agent: ServiceHost, directory: str | os.PathLike[str],
                 capacity: int = DEFAULT_CAPACITY) -> None:
        self.agent = agent
        self.directory = pathlib.Path(directory)
        self.ring = TraceRing(capacity, _kind_name)
        self.clock: list[dict[str, int]] = []
        self.reference = _reference(agent)
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        self._lock = threading.Lock()  # one clock sample at a time
        self._closing = False  # this worker is shutting down: peers leaving is expected

    # ------------------------------------------------------------------ life

    def begin(self, sample: bool = True, record: bool = True) -> None:
        """Sample the clock (if ``sample``: the world must be up), start recording (if
        ``record``, else at :meth:`record`), refresh the clock every so often."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if sample:
            self.sample_clock()
        self.agent.on_peer_lost.append(self._peer_lost)
        self.agent.on_peer_silent.append(self._peer_silent)
        if record:
            self.record()
        if self.reference.id != self.agent.rank:
            self._refresher = threading.Thread(
                target=self._refresh, name=f"rpcx-{self.agent.name}-trace-clock", daemon=True)
            self._refresher.start()

    def record(self) -> None:
        """Switch the ring on: this worker's calls are recorded from now."""
        self.agent.trace = self.ring

    def quiet(self) -> None:
        """Switch the ring off (calls are no longer recorded; the file is not written)."""
        if self.agent.trace is self.ring:
            self.agent.trace = NoTrace()
            self.ring.close()

    def end(self, sample: bool = True) -> pathlib.Path:
        """Stop recording, take a last clock sample (if ``sample``: the world must be
        up) and write the trace file; returns its path."""
        self._stop.set()
        if self._refresher is not None:
            # (a probe in flight ends within its bound)
            self._refresher.join(timeout=CLOCK_PROBES * CLOCK_PROBE_TIMEOUT_S)
        self.quiet()
        if sample:
            self.sample_clock()  # (after recording stopped: the probes are not the step's)
        for hooks, hook in ((self.agent.on_peer_lost, self._peer_lost),
                            (self.agent.on_peer_silent, self._peer_silent)):
            if hook in hooks:
                hooks.remove(hook)
        return self.write()

    def closing(self) -> None:
        """This worker's ``shutdown()`` started: peers that go from now on are recorded
        as having left, not as lost."""
        self._closing = True

    def _refresh(self) -> None:
        while not self._stop.wait(CLOCK_REFRESH_S):
            self.sample_clock()

    # ----------------------------------------------------------------- clock

    def sample_clock(self) -> None:
        """Estimate this worker's offset to the reference clock and keep the sample
        (the reference itself: offset 0). A failed probe is logged, not raised."""
        agent = self.agent
        with self._lock:
            if self.reference.id == agent.rank:
                now = time.monotonic_ns()
                self.clock.append({"at_ns": now, "offset_ns": 0, "error_ns": 0})
                return
            best: tuple[int, int, int] | None = None  # (round trip, at, offset)
            try:
                for _ in range(CLOCK_PROBES):
                    sent = time.monotonic_ns()
                    # (a CLOCK request, answered on the reference's receiving thread
                    # and never recorded in a trace)
                    remote = agent.request(
                        self.reference, MessageKind.CLOCK, None,
                        timeout=CLOCK_PROBE_TIMEOUT_S,
                        label=CallLabel("clock probe", self.reference.name)).wait()
                    back = time.monotonic_ns()
                    middle = (sent + back) // 2
                    if best is None or back - sent < best[0]:
                        best = (back - sent, middle, int(remote) - middle)
            except Exception as exc:
                log.info("%s: clock sample against %s failed (%s); the trace keeps %d "
                         "samples", agent.name, self.reference.name, exc, len(self.clock))
                if best is None:
                    return
            assert best is not None
            round_trip, at, offset = best
            self.clock.append({"at_ns": at, "offset_ns": offset, "error_ns": round_trip // 2})

    # ---------------------------------------------------------------- events

    def _peer_lost(self, rank: int) -> None:
        what = "peer left" if self._closing else "peer lost"
        self.ring.instant(f"{what}: {_worker_name(self.agent, rank)}", rank)

    def _peer_silent(self, rank: int) -> None:
        self.ring.instant(f"heartbeat missed: {_worker_name(self.agent, rank)}", rank)

    # ------------------------------------------------------------------ file

    def write(self) -> pathlib.Path:
        """Write ``<directory>/<worker>.rpcx-trace.json`` (atomically) and return it."""
        agent, ring = self.agent, self.ring
        events = ring.snapshot()
        record: dict[str, Any] = {
            "format": FORMAT,
            "worker": agent.name,
            "rank": agent.rank,
            "pid": os.getpid(),
            "backend": agent.backend,
            "host": socket.gethostname(),
            "reference": self.reference.name,
            "clock": list(self.clock),
            "wall": {"monotonic_ns": ring.wall[0], "unix_ns": ring.wall[1]},
            "threads": {str(tid): name for tid, name in dict(ring.threads).items()},
            "capacity": ring.capacity,
            "dropped": ring.dropped,
            "events": [list(event) for event in events],
        }
        path = self.directory / f"{agent.name}.rpcx-trace.json"
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(record, separators=(",", ":")))
        partial.replace(path)
        log.info("%s: trace of %d events written to %s%s", agent.name, len(events), path,
                 f" ({ring.dropped} older events dropped)" if ring.dropped else "")
        return path


def _reference(agent: ServiceHost) -> Any:
    """The worker whose clock the trace is aligned to: the lowest rank of the world."""
    return min(agent.members(), key=lambda w: w.id)


def _worker_name(agent: ServiceHost, rank: int) -> str:
    return agent.workers[rank].name if 0 <= rank < len(agent.workers) else f"rank {rank}"


def session_of(agent: ServiceHost | None = None) -> TraceSession | None:
    """The trace session of ``agent`` (default: the current worker), if one runs."""
    agent = agent if agent is not None else _context.current_agent()
    session = agent.services.get(_SERVICE)
    return session if isinstance(session, TraceSession) else None


def begin_session(directory: str | os.PathLike[str], capacity: int = DEFAULT_CAPACITY,
                  agent: ServiceHost | None = None, sample: bool = True,
                  record: bool = True) -> TraceSession:
    """Start tracing ``agent`` (default: the current worker) into ``directory``
    (``sample=False``: the caller takes the first clock sample, once the world is up;
    ``record=False``: the ring is switched on later, with ``TraceSession.record``)."""
    agent = agent if agent is not None else _context.current_agent()
    if session_of(agent) is not None:
        raise RuntimeError(f"worker {agent.name!r} is already tracing")
    session = TraceSession(agent, directory, capacity)
    agent.services[_SERVICE] = session
    try:
        session.begin(sample, record)
    except BaseException:
        agent.services.pop(_SERVICE, None)
        raise
    return session


def discard_session(agent: ServiceHost) -> None:
    """Stop ``agent``'s trace session without writing a file (``init_rpc`` failed)."""
    session = agent.services.pop(_SERVICE, None)
    if isinstance(session, TraceSession):
        session._stop.set()
        session.quiet()


def end_session(agent: ServiceHost | None = None, sample: bool = True) -> pathlib.Path | None:
    """End ``agent``'s trace session and write its file; ``None`` if none ran."""
    agent = agent if agent is not None else _context.current_agent()
    session = session_of(agent)
    if session is None:
        return None
    agent.services.pop(_SERVICE, None)
    return session.end(sample=sample)
