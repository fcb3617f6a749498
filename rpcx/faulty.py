"""Fault injection: ``backend="faulty:<name>"`` runs backend ``<name>`` with frames dropped,
duplicated or delayed, chosen by message kind.

For tests of rpcx and of plugins: what a flaky network, a retrying transport or a slow
peer would do, on demand and reproducibly (a seeded generator per worker). Say which
frames to disturb with :class:`Faults`, either on the options object
(``options.faults = rpcx.faulty.Faults(drop={"RREF_DELETE": 0.1})``) or, for every
worker a program starts, as JSON in ``$RPCX_FAULTS``
(``{"duplicate": {"AUTOGRAD_BACKWARD": 1.0}}``). Kinds are :class:`rpcx.messages.MessageKind`
names; ``"reply:<KIND>"`` names the replies to requests of one kind (see :class:`Faults`).

Delays keep each peer's frames in order (the sender waits, holding that peer's turn):
rpcx's protocol relies on per-pair order, and a network never reorders one connection.
The wrapper reads each frame's kind from its envelope. In a world with a key it wraps
the seals (``init_rpc`` puts them under it, next to the wire): it sees frames before
they are sealed and after they are checked, and a duplicate it sends is sealed anew.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rpcx._wire.codec import decode_envelope
from rpcx.messages import MessageKind
from rpcx.transport import (
    Capabilities,
    Frame,
    Transport,
    TransportContext,
    TransportDecorator,
)

__all__ = ["FAULTS_ENV", "PREFIX", "REPLY_PREFIX", "Faults", "FaultyTransport", "faulty_class"]

log = logging.getLogger("rpcx.faulty")

PREFIX = "faulty:"
FAULTS_ENV = "RPCX_FAULTS"
REPLY_PREFIX = "reply:"  # "reply:RREF_FETCH": the RESULT or ERROR answering an RREF_FETCH

_REPLY_KINDS = frozenset({MessageKind.RESULT, MessageKind.ERROR})
_REQUESTS_KEPT = 1 << 16  # requests whose kind is remembered, for their replies


@dataclass
class Faults:
    """Which frames to disturb: message kind name -> probability, per fault.

    A name ``"reply:<KIND>"`` stands for the replies (``RESULT`` or ``ERROR``) to requests
    of kind ``<KIND>``, copies of a reply sent again included: ``drop={"reply:RREF_FETCH":
    0.4}`` loses 40% of the answers to RRef fetches and no other reply, where ``"RESULT"``
    would hit every call's result. For a reply that a table names both ways, the
    ``"reply:"`` entry is the one used. ``injected`` counts under the name used.

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
                asked = kind.removeprefix(REPLY_PREFIX)
                if asked not in MessageKind.__members__:
                    raise ValueError(f"faults: {fault}: unknown message kind {asked!r}; "
                                     f"kinds: {', '.join(MessageKind.__members__)}")
                if asked != kind and MessageKind[asked] in _REPLY_KINDS:
                    raise ValueError(f"faults: {fault}: {kind!r}: a reply answers a request, "
                                     f"never a {asked}")
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

    def answered_kinds(self) -> frozenset[int]:
        """The kinds of request whose replies some fault names (``"reply:<KIND>"``)."""
        return frozenset(
            MessageKind[kind.removeprefix(REPLY_PREFIX)]
            for table in (self.drop, self.duplicate, self.delay)
            for kind in table if kind.startswith(REPLY_PREFIX)
        )


class FaultyTransport(TransportDecorator):
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
        # (caller rank, request id) -> kind, for the requests "reply:<KIND>" faults name.
        self._requests: collections.OrderedDict[tuple[int, int], int] = (
            collections.OrderedDict())

    def start(self, ctx: TransportContext) -> None:
        """Read the faults (options, then ``$RPCX_FAULTS``) and start the inner transport."""
        faults = getattr(ctx.options, "faults", None) or Faults.from_environment() or Faults()
        faults.validate()
        self._faults = faults
        self._rng = random.Random(faults.seed * 1_000_003 + ctx.rank)
        log.info("%s: injecting %s", ctx.names[ctx.rank], faults)
        answered = faults.answered_kinds()
        if answered:  # (otherwise incoming frames are not looked at)
            ctx = dataclasses.replace(ctx, deliver=self._noting_requests(ctx.deliver, answered))
        self.inner.start(ctx)

    def send(self, dst: int, frame: Frame) -> None:
        """Send ``frame`` unless dropped; twice if duplicated; late if delayed."""
        kind, rid = decode_envelope(frame)
        faults = self._faults
        with self._lock:
            names = self._names(dst, kind, rid)
            drop = self._roll("drop", faults.drop, names)
            duplicate = not drop and self._roll("duplicate", faults.duplicate, names)
            delay = not drop and self._roll("delay", faults.delay, names)
            turn = self._turns[dst]  # (made under the lock: one per peer, never two)
        if drop:
            return
        with turn:
            if delay:
                time.sleep(faults.delay_seconds)  # the injected fault itself
            # (copied first: a send below may seal or encrypt the frame in place)
            again = frame.shallow_copy() if duplicate else None
            self.inner.send(dst, frame)
            if again is not None:
                self.inner.send(dst, again)

    def _noting_requests(self, deliver: Callable[[int, Frame], None],
                         answered: frozenset[int]) -> Callable[[int, Frame], None]:
        """``deliver``, remembering the kind of each request in ``answered`` that arrives,
        so that its reply can be told from other replies when it is sent."""
        def noting(src: int, frame: Frame) -> None:
            kind, rid = decode_envelope(frame)
            if rid and kind in answered:
                with self._lock:
                    self._requests[(src, rid)] = kind
                    if len(self._requests) > _REQUESTS_KEPT:
                        self._requests.popitem(last=False)
            deliver(src, frame)

        return noting

    def _names(self, dst: int, kind: int, rid: int) -> tuple[str, ...]:
        """What the faults may call a frame to ``dst``, most specific first: a reply to a
        request noted by :meth:`_noting_requests` is ``"reply:<its kind>"``, then its own
        kind (under the lock)."""
        name = MessageKind(kind).name
        asked = self._requests.get((dst, rid)) if kind in _REPLY_KINDS else None
        return (name,) if asked is None else (REPLY_PREFIX + MessageKind(asked).name, name)

    def _roll(self, fault: str, table: Mapping[str, float], names: tuple[str, ...]) -> bool:
        """Whether ``fault`` hits a frame, by the first of ``names`` in ``table``; counted
        in ``injected`` (under the lock)."""
        name = next((n for n in names if n in table), None)
        if name is None:
            return False
        probability = table[name]
        if probability > 0 and self._rng.random() < probability:
            self.injected[(fault, name)] += 1
            return True
        return False


def faulty_class(inner_name: str, inner_factory: Any,
                 capabilities: Capabilities) -> type[FaultyTransport]:
    """A :class:`FaultyTransport` subclass wrapping ``inner_factory`` (one per backend)."""
    return type(f"Faulty_{inner_name}", (FaultyTransport,), {
        "capabilities": capabilities, "inner_factory": staticmethod(inner_factory),
    })
