"""The world key as a transport decorator: every frame sealed on its way out and
checked on its way in (:class:`~rpcx._wire.auth.FrameGuard`).

``init_rpc`` wraps the backend's transport in :class:`KeyedTransport` when the world
has a key, as ``backend="faulty:<name>"`` wraps it in the fault injector; the agent and
the call path never see the key. The seals go next to the wire, under any other
decorator: the fault injector reads each frame's kind, so it wraps the seals, and the
two compose. A frame that fails its check is dropped, its sender
reported lost with a protocol error (once), and its connection ended by the transport.

In a dynamic world the transport's ``admit`` goes through here too: the pair with a
worker that joins is keyed (from the session record it published) before the agent
admits it, so its first frame is checked like every other; a newcomer without a
genuine record is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

from rpcx._wire.auth import ConnectionAuth, FrameGuard
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

    def __init__(self, inner: Transport, guard: FrameGuard,
                 admit_keys: Callable[[int], None] | None = None) -> None:
        self.inner = inner
        self.guard = guard
        self._admit_keys = admit_keys

    def start(self, ctx: TransportContext) -> None:
        """Start the inner transport with a ``deliver`` that checks each frame (and in a
        dynamic world an ``admit`` that keys each newcomer first)."""
        def refuse(src: int, why: str) -> None:
            ctx.peer_lost(src, LostCause.PROTOCOL_ERROR, why)

        admit, peer_lost = ctx.admit, ctx.peer_lost
        if ctx.admit is not None and self._admit_keys is not None:
            admit_keys, admit_worker, guard = self._admit_keys, ctx.admit, self.guard
            report_lost, connections = ctx.peer_lost, ctx.auth

            def keyed_admit(rank: int) -> str:
                admit_keys(rank)  # (raises for a newcomer without a genuine record)
                name = admit_worker(rank)
                guard.named(rank, name)
                return name

            def keys_lost(rank: int, cause: LostCause, detail: str = "") -> None:
                report_lost(rank, cause, detail)
                # (its keys go with it: nothing to or from the rank verifies until a
                # worker joins there)
                guard.forget(rank)
                if isinstance(connections, ConnectionAuth):
                    connections.forget(rank)

            admit, peer_lost = keyed_admit, keys_lost
        self.inner.start(dataclasses.replace(
            ctx, deliver=self.guard.guarding(ctx.deliver, refuse), admit=admit,
            peer_lost=peer_lost))

    def close(self, timeout: float) -> None:
        """Close the inner transport, then the guard (what it keeps for sends goes)."""
        try:
            self.inner.close(timeout)
        finally:
            self.guard.close()

    def send(self, dst: int, frame: Frame) -> None:
        """Seal ``frame`` for ``dst`` and send it. Until the inner send returns, frames
        sealed for ``dst`` may arrive before it; after, none does (the transport's order:
        the receiver refuses a frame held back past later ones)."""
        sealed, token = self.guard.sealing(dst, frame)
        try:
            self.inner.send(dst, sealed)
        finally:
            self.guard.sent(dst, token)


def keyed(inner: Transport, guard: FrameGuard,
          admit_keys: Callable[[int], None] | None = None) -> Transport:
    """``inner`` behind the world key's seals (a :class:`KeyedTransport` with its
    capabilities). When ``inner`` is a decorator, the seals go under it, around the
    transport it decorates: what it sees of a frame (the fault injector reads the kind)
    is never sealed. ``admit_keys(rank)``: in a dynamic world, keys the pair with a
    worker joining at ``rank`` (:meth:`rpcx._wire.sessions.Sessions.admit`)."""
    if isinstance(inner, TransportDecorator) and not isinstance(inner, KeyedTransport):
        inner.inner = keyed(inner.inner, guard, admit_keys)
        return inner
    cls = type(f"Keyed{type(inner).__name__}", (KeyedTransport,),
               {"capabilities": inner.capabilities})
    transport: Transport = cls(inner, guard, admit_keys)
    return transport
