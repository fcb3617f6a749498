"""The trace policy the call path calls at each step of a call.

:class:`NoTrace`, the default, does nothing; :mod:`rpcx.tracing` plugs a recording one
in (``rpcx.tracing.ring.TraceRing``) while a trace runs. It lives here, below the call
path, so that the core never imports tracing: tracing builds on the core, not the other
way round (docs/design/tracing.md lists the events).
"""

from __future__ import annotations

from rpcx._core.label import CallLabel

__all__ = ["NoTrace"]


class NoTrace:
    """The trace policy when tracing is off: every method does nothing."""

    on = False

    def sent(self, peer: int, rid: int, kind: int, label: CallLabel) -> None:
        """Request ``rid`` (of ``kind``) to ``peer`` is about to go to the transport."""

    def arrived(self, peer: int, rid: int, kind: int) -> None:
        """Request ``rid`` (of ``kind``) from ``peer`` was delivered."""

    def serving(self, peer: int, rid: int, kind: int) -> None:
        """Request ``rid`` from ``peer`` starts being served (decoding included)."""

    def served(self, peer: int, rid: int) -> None:
        """The handler of request ``rid`` from ``peer`` has finished."""

    def replied(self, peer: int, rid: int, ok: bool) -> None:
        """The reply to request ``rid`` from ``peer`` is handed to the transport."""

    def completed(self, peer: int, rid: int, outcome: str) -> None:
        """Call ``rid`` to ``peer`` was settled: ``ok``, or how it failed."""

    def posted(self, peer: int, kind: int) -> None:
        """A one-way message of ``kind`` (a backward hop, an RRef deletion) is sent."""

    def delivered(self, peer: int, kind: int) -> None:
        """A one-way message of ``kind`` from ``peer`` was delivered."""

    def instant(self, label: str, peer: int = -1) -> None:
        """A point event (an RRef created, a peer lost, an optimizer step...)."""
