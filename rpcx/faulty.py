"""Fault injection: ``backend="faulty:<name>"`` runs backend ``<name>`` with frames dropped,
duplicated or delayed, chosen by message kind.

For tests of rpcx and of plugins: what a flaky network, a retrying transport or a slow
peer would do, on demand and reproducibly (a seeded generator per worker). Say which
frames to disturb with :class:`Faults`, either on the options object
(``options.faults = rpcx.faulty.Faults(drop={"RREF_DELETE": 0.1})``) or, for every
worker a program starts, as JSON in ``$RPCX_FAULTS``
(``{"duplicate": {"AUTOGRAD_BACKWARD": 1.0}}``). Kinds are :class:`rpcx.messages.MessageKind`
names.

Delays keep each peer's frames in order (the sender waits, holding that peer's turn):
rpcx's protocol relies on per-pair order, and a network never reorders one connection.
The wrapper reads each frame's kind from its envelope, so it cannot run where frames are
sealed (a world key): it refuses to start there.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rpcx._retransmit import copy_of_frame
from rpcx.messages import MessageKind
from rpcx.serialization import decode_envelope
from rpcx.transport import Capabilities, Frame, Transport, TransportContext

__all__ = ["FAULTS_ENV", "PREFIX", "Faults", "FaultyTransport", "faulty_class"]

log = logging.getLogger("rpcx.faulty")

PREFIX = "faulty:"
FAULTS_ENV = "RPCX_FAULTS"


@dataclass
class Faults:
    """Which frames to disturb: message kind name -> probability, per fault.

    Attributes:
        drop: the frame is not sent.
        duplicate: the frame is sent twice.
        delay: the frame (and so every later frame to that peer) waits ``delay_seconds``.
        seed: seeds each worker's generator (with its rank), so runs repeat.
    """

    drop: Mapping[str, float] = field(default_factory=dict)
    duplicate: Mapping[str, float] = field(default_factory=dict)
    delay: Mapping[str, float] = field(default_factory=dict)
    delay_seconds: float = 0.05
    seed: int = 0

    def validate(self) -> None:
        """Raise ``ValueError`` for an unknown kind name or a probability outside [0, 1]."""
        for fault in ("drop", "duplicate", "delay"):
            for kind, probability in getattr(self, fault).items():
                if kind not in MessageKind.__members__:
                    raise ValueError(f"faults: {fault}: unknown message kind {kind!r}; "
                                     f"kinds: {', '.join(MessageKind.__members__)}")
                if not 0.0 <= float(probability) <= 1.0:
                    raise ValueError(f"faults: {fault}[{kind}] = {probability} is no "
                                     "probability (0 to 1)")
        if self.delay_seconds < 0:
            raise ValueError(f"faults: delay_seconds must be >= 0, got {self.delay_seconds}")

    @classmethod
    def from_environment(cls) -> Faults | None:
        """The faults ``$RPCX_FAULTS`` describes (JSON of this class's fields), or ``None``."""
        text = os.environ.get(FAULTS_ENV)
        if not text:
            return None
        try:
            fields = json.loads(text)
            faults = cls(**fields)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"${FAULTS_ENV} is not a Faults description: {exc}") from None
        return faults


class FaultyTransport:
    """Wraps another backend's transport; disturbs the frames :class:`Faults` names.

    ``injected`` counts what was done, by ``(fault, kind name)``.
    """

    capabilities: ClassVar[Capabilities]
    inner_factory: ClassVar[Any]

    def __init__(self) -> None:
        self.inner: Transport = type(self).inner_factory()
        self.injected: collections.Counter[tuple[str, str]] = collections.Counter()
        self._faults = Faults()
        self._rng = random.Random()
        self._lock = threading.Lock()  # the generator and the counters
        self._turns: dict[int, threading.Lock] = collections.defaultdict(threading.Lock)

    def start(self, ctx: TransportContext) -> None:
        """Read the faults (options, then ``$RPCX_FAULTS``) and start the inner transport."""
        if ctx.auth is not None:
            raise ValueError("the faulty backend reads each frame's message kind, which a "
                             "world key seals: run it without RPCX_AUTH_KEY")
        faults = getattr(ctx.options, "faults", None) or Faults.from_environment() or Faults()
        faults.validate()
        self._faults = faults
        self._rng = random.Random(faults.seed * 1_000_003 + ctx.rank)
        log.info("%s: injecting %s", ctx.names[ctx.rank], faults)
        self.inner.start(ctx)

    def send(self, dst: int, frame: Frame) -> None:
        """Send ``frame`` unless dropped; twice if duplicated; late if delayed."""
        kind = MessageKind(decode_envelope(frame)[0]).name
        faults = self._faults
        with self._lock:
            drop = self._roll(faults.drop, kind)
            duplicate = not drop and self._roll(faults.duplicate, kind)
            delay = not drop and self._roll(faults.delay, kind)
            for fault, done in (("drop", drop), ("duplicate", duplicate), ("delay", delay)):
                if done:
                    self.injected[(fault, kind)] += 1
            turn = self._turns[dst]  # (made under the lock: one per peer, never two)
        if drop:
            return
        with turn:
            if delay:
                time.sleep(faults.delay_seconds)  # the injected fault itself
            self.inner.send(dst, frame)
            if duplicate:
                self.inner.send(dst, copy_of_frame(frame))

    def close(self, timeout: float) -> None:
        """Close the inner transport."""
        self.inner.close(timeout)

    def _roll(self, table: Mapping[str, float], kind: str) -> bool:
        probability = table.get(kind, 0.0)
        return probability > 0 and self._rng.random() < probability


def faulty_class(inner_name: str, inner_factory: Any,
                 capabilities: Capabilities) -> type[FaultyTransport]:
    """A :class:`FaultyTransport` subclass wrapping ``inner_factory`` (one per backend)."""
    return type(f"Faulty_{inner_name}", (FaultyTransport,), {
        "capabilities": capabilities, "inner_factory": staticmethod(inner_factory),
    })
