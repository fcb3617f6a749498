"""The message being encoded or decoded, as the codec's reduce and rebuild functions see
it: :class:`EncodeContext`, :class:`DecodeContext`, one of each per thread at a time.

The pickler calls module-level functions, which cannot take arguments from the caller;
they find the message through these thread-local contexts, set by
:func:`rpcx._wire.codec.encode` and :func:`~rpcx._wire.codec.decode_payload` for the
duration of one call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rpcx.errors import SerializationError

if TYPE_CHECKING:
    from rpcx._wire.devices import DeviceRoutes

__all__ = ["DecodeContext", "EncodeContext", "ReduceError", "contexts",
           "current_decode_context", "current_encode_context"]


class EncodeContext:
    """Per-message state while encoding.

    Attributes:
        peer: the destination rank.
        buffers: the tensor data that travels beside the header, in order.
        tensors: the original tensors, in the order the stream holds them (services
            inspect them, for example to record which ones require grad).
        before_send: callbacks the agent runs, in order, after the message was encoded
            and just before it is sent (an RRef registers its new fork with the owner).
        agent: the sending agent (set for scoped messages).
        scope: the message's scope (see the module docstring), or ``None``.
        scope_tag: set by the scope hooks while encoding; travels with the scope.
        notes: one-way messages ``(kind, payload)`` that ride in this frame and are
            handled, in order, by the receiver's in-order handlers as the frame
            arrives, before the frame itself is served (payloads: plain data only).
        keep_alive: objects the sender holds until the frame has been handed to the
            transport (what the notes refer to, say).
        routes: the sender's device routes (:mod:`rpcx._wire.devices`); consulted only when a
            non-CPU tensor is sent. ``None``: no non-CPU tensor may be sent.
        response: this message answers a request of ``peer`` (it travels along the
            inverse of the peer's map).
        stage_devices: copy non-CPU tensors to host memory for the transport (which
            cannot move device memory); the receiver places them on the mapped device.
        placements: ``id(tensor) -> device`` overriding the map for single tensors
            (set through :class:`Placed`).
        owned: indices of buffers the codec copied while encoding (``Frame.owned``).
        in_header: bytes of small tensors the codec pickled into the header so far (it
            stops at ``INLINE_MAX_BYTES`` a message: rpcx._wire.reducers).
    """

    # A plain class with slots, not a dataclass: one is made per message sent, and the
    # dataclass's default factories cost a call each.
    __slots__ = ("agent", "before_send", "buffers", "in_header", "keep_alive", "notes", "owned",
                 "peer", "placements", "response", "routes", "scope", "scope_tag",
                 "stage_devices", "tensors")

    def __init__(
        self,
        peer: int,
        agent: Any = None,
        buffers: list[torch.Tensor] | None = None,
        tensors: list[torch.Tensor] | None = None,
        before_send: list[Callable[[], None]] | None = None,
        scope: int | None = None,
        scope_tag: int = 0,
        notes: list[tuple[int, Any]] | None = None,
        keep_alive: list[Any] | None = None,
        routes: DeviceRoutes | None = None,
        response: bool = False,
        stage_devices: bool = True,
        placements: dict[int, torch.device] | None = None,
        owned: list[int] | None = None,
    ) -> None:
        self.peer = peer
        self.agent = agent
        self.buffers: list[torch.Tensor] = [] if buffers is None else buffers
        self.tensors: list[torch.Tensor] = [] if tensors is None else tensors
        self.before_send: list[Callable[[], None]] = [] if before_send is None else before_send
        self.scope = scope
        self.scope_tag = scope_tag
        self.notes: list[tuple[int, Any]] = [] if notes is None else notes
        self.keep_alive: list[Any] = [] if keep_alive is None else keep_alive
        self.routes = routes
        self.response = response
        self.stage_devices = stage_devices
        self.placements: dict[int, torch.device] = {} if placements is None else placements
        self.owned: list[int] = [] if owned is None else owned
        self.in_header = 0  # bytes of small tensors pickled into the header so far


class DecodeContext:
    """Per-message state while decoding.

    Attributes:
        peer: the source rank.
        agent: the receiving agent, for extensions that rebuild objects bound to it.
        buffers: the frame's tensor data.
        tensors: the rebuilt tensors, in the order the stream holds them.
        scope, scope_tag: the message's scope and tag (``None``, 0 if unscoped).
        scope_count: how many tensors the scope hooks have seen in this message.
        source_device: while a tensor is rebuilt, the device it was on at the sender
            (``None`` for CPU tensors); the scope hooks read it.
        before_serve: callables the agent runs, in order, after decoding a request and
            before its handler runs, on the thread that will run the handler (an RRef
            forked by a third worker waits there for its owner's confirmation).
            ``None`` until an extension adds one; ignored for responses.
    """

    __slots__ = ("agent", "before_serve", "buffers", "peer", "scope", "scope_count",
                 "scope_tag", "source_device", "tensors")

    def __init__(
        self,
        peer: int,
        agent: Any = None,
        buffers: list[torch.Tensor] | None = None,
        tensors: list[torch.Tensor] | None = None,
        scope: int | None = None,
        scope_tag: int = 0,
        scope_count: int = 0,
        source_device: torch.device | None = None,
        before_serve: list[Callable[[], None]] | None = None,
    ) -> None:
        self.peer = peer
        self.agent = agent
        self.buffers: list[torch.Tensor] = [] if buffers is None else buffers
        self.tensors: list[torch.Tensor] = [] if tensors is None else tensors
        self.scope = scope
        self.scope_tag = scope_tag
        self.scope_count = scope_count
        self.source_device = source_device
        self.before_serve = before_serve


class ReduceError(Exception):
    """Raised by an extension's reduce function to abort encoding with ``error`` itself.

    ``encode`` raises ``error`` unchanged instead of wrapping it in SerializationError:
    for example, an RRef whose ``remote()`` failed re-raises that failure when sent.
    """

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _Contexts(threading.local):
    encoding: EncodeContext | None = None
    decoding: DecodeContext | None = None


contexts = _Contexts()
"""This thread's message being encoded and decoded (``None`` outside the codec)."""

def current_encode_context() -> EncodeContext:
    """The message being encoded on this thread (only valid inside a reduce function)."""
    ctx = contexts.encoding
    if ctx is None:
        raise SerializationError("this object can only be pickled by rpcx while sending it")
    return ctx


def current_decode_context() -> DecodeContext:
    """The message being decoded on this thread (only valid inside a rebuild function)."""
    ctx = contexts.decoding
    if ctx is None:
        raise SerializationError("this object can only be unpickled by rpcx while receiving it")
    return ctx
