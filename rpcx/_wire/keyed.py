"""The world key as a transport decorator: every frame sealed on its way out and
checked on its way in (:class:`~rpcx._wire.auth.FrameGuard`).

``init_rpc`` wraps the backend's transport in :class:`KeyedTransport` when the world
has a key, as ``backend="faulty:<name>"`` wraps it in the fault injector; the agent and
the call path never see the key. The seals go next to the wire, under any other
decorator: the fault injector reads each frame's kind, so it wraps the seals, and the
two compose. A frame that fails its check is dropped, its sender
reported lost with a protocol error (once), and its connection ended by the transport.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from rpcx._wire.auth import FrameGuard
from rpcx.errors import LostCause
from rpcx.transport import (
    Capabilities,
    Frame,
    Transport,
    TransportContext,
    TransportDecorator,
)

__all__ = ["KeyedTransport", "keyed"]


class KeyedTransport(TransportDecorator):
    """``inner``, with every frame sealed by ``guard`` for its destination and every
    frame delivered checked first.

    The rest passes through (:class:`~rpcx.transport.TransportDecorator`). Made by
    :func:`keyed`, which gives each the inner one's capabilities.
    """

    capabilities: ClassVar[Capabilities]

    def __init__(self, inner: Transport, guard: FrameGuard) -> None:
        self.inner = inner
        self.guard = guard

    def start(self, ctx: TransportContext) -> None:
        """Start the inner transport with a ``deliver`` that checks each frame."""
        def refuse(src: int, why: str) -> None:
            ctx.peer_lost(src, LostCause.PROTOCOL_ERROR, why)

        self.inner.start(dataclasses.replace(
            ctx, deliver=self.guard.guarding(ctx.deliver, refuse)))

    def send(self, dst: int, frame: Frame) -> None:
        """Seal ``frame`` for ``dst`` and send it."""
        self.inner.send(dst, self.guard.seal(dst, frame))


def keyed(inner: Transport, guard: FrameGuard) -> Transport:
    """``inner`` behind the world key's seals (a :class:`KeyedTransport` with its
    capabilities). When ``inner`` is a decorator, the seals go under it, around the
    transport it decorates: what it sees of a frame (the fault injector reads the kind)
    is never sealed."""
    if isinstance(inner, TransportDecorator) and not isinstance(inner, KeyedTransport):
        inner.inner = keyed(inner.inner, guard)
        return inner
    cls = type(f"Keyed{type(inner).__name__}", (KeyedTransport,),
               {"capabilities": inner.capabilities})
    transport: Transport = cls(inner, guard)
    return transport
