"""The codec: message envelopes to :class:`~rpcx.transport.Frame` and back.

The only module that touches pickle. One pickling pass per message; tensors never enter
pickle's byte stream: each becomes a reference to a slot in the frame's buffer list, with
its dtype and shape, so a transport moves tensor memory as-is.

Speed matters here (it is on every call), so the pickler runs Python code only for the
types that need it: a per-pickler ``dispatch_table`` maps ``torch.Tensor`` and every
registered *extension* type to a reduce function. Those functions, and the rebuild
functions the pickle stream names, find the message being encoded or decoded through a
thread-local context (set for the duration of one ``encode``/``decode_payload`` call).

Services that need custom treatment of their objects on the wire (RRefs) register an
extension: a type, a reduce function run while encoding and a module-level rebuild
function run while decoding.

A message may carry a *scope*: an integer a service attaches to it (distributed
autograd's context id) plus a tag the service may set while encoding. Scoped messages
pass every tensor that requires grad through the scope hooks (:func:`set_scope_hooks`),
which is how autograd records the edges of its graph on both sides of a call.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rpcx.errors import SerializationError, use_exception_pickling
from rpcx.messages import CONTROL_KINDS
from rpcx.transport import Frame

if TYPE_CHECKING:
    from rpcx.devices import DeviceRoutes

__all__ = [
    "DecodeContext",
    "EncodeContext",
    "Placed",
    "ReduceError",
    "current_decode_context",
    "current_encode_context",
    "decode_envelope",
    "decode_notes",
    "decode_payload",
    "decode_scope",
    "encode",
    "has_notes",
    "register_extension",
    "set_scope_hooks",
]

_ENVELOPE = struct.Struct("<BQ")  # message kind, request id
_SCOPE = struct.Struct("<qQ")  # scope, scope tag; follows the envelope when kind & _SCOPED
_SCOPED = 0x80
_NOTES_LEN = struct.Struct("<I")  # length of the pickled notes; next when kind & _NOTED
_NOTED = 0x40
_KIND_MASK = 0x3F
_PROTOCOL = 5
_DTYPES: dict[str, torch.dtype] = {
    str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}


class EncodeContext:
    """Per-message state while encoding.

    Attributes:
        peer: the destination rank.
        buffers: the tensor data that travels beside the header, in order.
        tensors: the original tensors, in buffer order (services inspect them, for
            example to record which ones require grad).
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
        routes: the sender's device routes (:mod:`rpcx.devices`); consulted only when a
            non-CPU tensor is sent. ``None``: no non-CPU tensor may be sent.
        response: this message answers a request of ``peer`` (it travels along the
            inverse of the peer's map).
        stage_devices: copy non-CPU tensors to host memory for the transport (which
            cannot move device memory); the receiver places them on the mapped device.
        placements: ``id(tensor) -> device`` overriding the map for single tensors
            (set through :class:`Placed`).
        owned: indices of buffers the codec copied while encoding (``Frame.owned``).
    """

    # A plain class with slots, not a dataclass: one is made per message sent, and the
    # dataclass's default factories cost a call each.
    __slots__ = ("agent", "before_send", "buffers", "keep_alive", "notes", "owned", "peer",
                 "placements", "response", "routes", "scope", "scope_tag", "stage_devices",
                 "tensors")

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


class DecodeContext:
    """Per-message state while decoding.

    Attributes:
        peer: the source rank.
        agent: the receiving agent, for extensions that rebuild objects bound to it.
        buffers: the frame's tensor data.
        tensors: the rebuilt tensors, in buffer order.
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


_contexts = _Contexts()

# Scope hooks: (on_encode(ctx, tensor), on_decode(ctx, tensor) -> tensor), or None.
_scope_hooks: tuple[
    Callable[[EncodeContext, torch.Tensor], None],
    Callable[[DecodeContext, torch.Tensor], torch.Tensor],
] | None = None


def set_scope_hooks(
    on_encode: Callable[[EncodeContext, torch.Tensor], None],
    on_decode: Callable[[DecodeContext, torch.Tensor], torch.Tensor],
) -> None:
    """Route the tensors that require grad in scoped messages through these hooks.

    ``on_encode(ctx, tensor)`` sees each such tensor as it is sent (it may set
    ``ctx.scope_tag``); ``on_decode(ctx, tensor)`` gets each as it arrives, detached, and
    returns the tensor the receiver sees in its place. One pair per process.
    """
    global _scope_hooks
    _scope_hooks = (on_encode, on_decode)


def current_encode_context() -> EncodeContext:
    """The message being encoded on this thread (only valid inside a reduce function)."""
    ctx = _contexts.encoding
    if ctx is None:
        raise SerializationError("this object can only be pickled by rpcx while sending it")
    return ctx


def current_decode_context() -> DecodeContext:
    """The message being decoded on this thread (only valid inside a rebuild function)."""
    ctx = _contexts.decoding
    if ctx is None:
        raise SerializationError("this object can only be unpickled by rpcx while receiving it")
    return ctx


# ------------------------------------------------------------------------------ tensors


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    if tensor.layout is not torch.strided or tensor.is_quantized:
        if tensor.layout in _SPARSE_LAYOUTS:
            return _reduce_sparse(tensor)
        return tensor.__reduce_ex__(_PROTOCOL)  # type: ignore[no-untyped-call]  # rare layouts: torch's own pickling, in band
    ctx = current_encode_context()
    target: torch.device | None = None
    if tensor.device.type != "cpu":
        target = _target_of(tensor, ctx)
    # Lazily conjugated or negated views must be materialized before a raw byte view.
    # ``copied``: the buffer is a copy made here, so transports need not copy it again.
    copied = tensor.is_conj() or tensor.is_neg()
    data = tensor.detach().resolve_conj().resolve_neg()
    stride: tuple[int, ...] | None = None
    if not data.is_contiguous():
        data, stride = _view_buffer(data)
        copied = copied or stride is None
    elif data.dim() and data.stride(-1) != 1:
        # Contiguous by torch's rules yet not viewable as bytes: a size-1 dimension with
        # stride 0 (gradients of sum() look like this). Give it ordinary strides.
        data = data.clone(memory_format=torch.contiguous_format)
        copied = True
    if target is not None and ctx.stage_devices:
        data = data.cpu()  # staged: the receiver puts it on ``target``
        copied = True
    index = len(ctx.buffers)
    ctx.buffers.append(data)
    if copied:
        ctx.owned.append(index)
    ctx.tensors.append(tensor)
    if (ctx.scope is not None and tensor.requires_grad and _scope_hooks is not None
            and torch.is_grad_enabled()):
        # (As torch's RPC: a message sent with grad mode off records no autograd edge.)
        _scope_hooks[0](ctx, tensor)
    is_param = type(tensor) is torch.nn.Parameter
    args: tuple[Any, ...] = (
        index, str(tensor.dtype), tuple(tensor.shape), tensor.requires_grad, is_param
    )
    if target is not None:
        args += (str(target), str(tensor.device))
    if stride is not None:
        return (_rebuild_view, (stride, *args))
    return (_rebuild_tensor, args)


# A non-contiguous view travels as the span of storage it covers, with its strides, so
# that it arrives with the same strides (as in torch), unless that span is both large
# and mostly not the view's (torch's rule: 8 KiB, twice the view's size): then it
# travels as a contiguous copy, and arrives contiguous.
_VIEW_SPAN_SMALL = 8 << 10
_VIEW_SPAN_FACTOR = 2


def _view_buffer(data: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """``(buffer, strides)`` for a non-contiguous tensor; strides ``None``: contiguous copy."""
    # Not contiguous implies at least one element; torch strides are never negative.
    span = 1 + sum((n - 1) * s for n, s in zip(data.shape, data.stride(), strict=True))
    numel = data.numel()
    if span * data.element_size() < _VIEW_SPAN_SMALL or span < _VIEW_SPAN_FACTOR * numel:
        return data.as_strided((span,), (1,)), tuple(data.stride())
    return data.contiguous(), None


def _target_of(tensor: torch.Tensor, ctx: EncodeContext) -> torch.device:
    """The device a non-CPU tensor lands on at the receiver, or a SerializationError."""
    target = ctx.placements.get(id(tensor)) if ctx.placements else None
    routes = ctx.routes
    if target is None and routes is not None:
        target = routes.target(ctx.peer, tensor.device, ctx.response)
    if target is None:
        if routes is not None:
            reason = routes.explain_missing(ctx.peer, tensor.device, ctx.response)
        else:
            reason = (f"no device map covers {tensor.device}; set one with "
                      "TensorPipeRpcBackendOptions.set_device_map, or move it to the CPU")
        raise SerializationError(f"cannot send a tensor on {tensor.device}: {reason}")
    return target


def _typed_buffer(ctx: DecodeContext, index: int, dtype_name: str) -> torch.Tensor:
    """Buffer ``index`` of the message, as elements of ``dtype_name``."""
    data = ctx.buffers[index]
    dtype = _DTYPES[dtype_name]
    if data.dtype is not dtype:
        data = data.view(-1).view(dtype)
    return data


def _rebuild_tensor(
    index: int,
    dtype_name: str,
    shape: tuple[int, ...],
    requires_grad: bool,
    param: bool,
    device: str | None = None,
    source: str | None = None,
) -> torch.Tensor:
    ctx = current_decode_context()
    tensor = _typed_buffer(ctx, index, dtype_name).reshape(shape)
    if device is not None and tensor.device != torch.device(device):
        tensor = tensor.to(device)  # staged through host memory, or routed elsewhere
    return _finish(ctx, tensor, requires_grad, param, source)


def _rebuild_view(
    stride: tuple[int, ...],
    index: int,
    dtype_name: str,
    shape: tuple[int, ...],
    requires_grad: bool,
    param: bool,
    device: str | None = None,
    source: str | None = None,
) -> torch.Tensor:
    """A non-contiguous tensor: its storage span, viewed with the sender's strides."""
    ctx = current_decode_context()
    data = _typed_buffer(ctx, index, dtype_name)
    if device is not None and data.device != torch.device(device):
        data = data.to(device)  # the span first: moving the view would make it contiguous
    if data.dim() != 1 or any(n < 0 for n in shape) or any(s < 0 for s in stride):
        raise SerializationError("malformed tensor view in the message")
    if shape and min(shape) > 0:
        reach = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
        if reach > data.numel():
            raise SerializationError("tensor view reaches past its buffer")
    return _finish(ctx, data.as_strided(shape, stride), requires_grad, param, source)


def _finish(
    ctx: DecodeContext,
    tensor: torch.Tensor,
    requires_grad: bool,
    param: bool,
    source: str | None,
) -> torch.Tensor:
    """What every rebuilt tensor goes through last: the device it came from (for the
    scope hooks) and its autograd role."""
    ctx.source_device = torch.device(source) if source is not None else None
    if requires_grad and ctx.scope_tag and _scope_hooks is not None:
        tensor = _scope_hooks[1](ctx, tensor)
    elif param:
        tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
    elif requires_grad:
        tensor.requires_grad_(True)
    ctx.tensors.append(tensor)
    return tensor


# Sparse tensors travel as their parts (each a dense tensor, out of band), rebuilt and
# validated by rpcx, with ``requires_grad`` and the scope hooks applied to the sparse
# tensor itself: so a sparse tensor keeps its autograd graph across a call in a
# distributed autograd context. (torch's own pickling drops ``requires_grad``, leaves
# the parts unvalidated until a ``torch.load`` that never comes, and keeps every sparse
# tensor it rebuilds in a module-level list until then.)
_SPARSE_LAYOUTS = frozenset({
    torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc
})


def _sparse_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if tensor.layout is torch.sparse_coo:
        return tensor._indices(), tensor._values()
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return tensor.crow_indices(), tensor.col_indices(), tensor.values()
    return tensor.ccol_indices(), tensor.row_indices(), tensor.values()


def _reduce_sparse(tensor: torch.Tensor) -> Any:
    ctx = current_encode_context()
    parts = tuple(part.detach() for part in _sparse_parts(tensor))
    source: str | None = None
    if tensor.device.type != "cpu":
        # The parts go where the sparse tensor itself is routed (a gradient sent back
        # with Placed has its own target).
        target = _target_of(tensor, ctx)
        for part in parts:
            ctx.placements[id(part)] = target
        source = str(tensor.device)
    if (ctx.scope is not None and tensor.requires_grad and _scope_hooks is not None
            and torch.is_grad_enabled()):
        # (As torch's RPC: a message sent with grad mode off records no autograd edge.)
        _scope_hooks[0](ctx, tensor)
    coalesced = tensor.is_coalesced() if tensor.layout is torch.sparse_coo else None
    return (
        _rebuild_sparse,
        (str(tensor.layout), parts, tuple(tensor.shape), coalesced, tensor.requires_grad,
         source),
    )


_LAYOUTS = {str(layout): layout for layout in _SPARSE_LAYOUTS}


def _rebuild_sparse(
    layout_name: str,
    parts: tuple[torch.Tensor, ...],
    size: tuple[int, ...],
    coalesced: bool | None,
    requires_grad: bool,
    source: str | None,
) -> torch.Tensor:
    ctx = current_decode_context()
    layout = _LAYOUTS[layout_name]
    tensor: torch.Tensor
    # Checked before use, as torch.load does: a malformed sparse tensor can make later
    # operations read out of bounds.
    if layout is torch.sparse_coo:
        indices, values = parts
        torch._validate_sparse_coo_tensor_args(indices, values, size, coalesced)
        tensor = torch.sparse_coo_tensor(
            indices, values, size, is_coalesced=coalesced, check_invariants=False
        )
    else:
        compressed, plain, values = parts
        torch._validate_sparse_compressed_tensor_args(compressed, plain, values, size, layout)
        tensor = torch.sparse_compressed_tensor(
            compressed, plain, values, size, layout=layout, check_invariants=False
        )
    return _finish(ctx, tensor, requires_grad, False, source)


_dispatch: dict[type, Callable[[Any], Any]] = {}
_own: dict[type, Callable[[Any], Any]] = {
    torch.Tensor: _reduce_tensor,
    torch.nn.Parameter: _reduce_tensor,
}
_copyreg_size = -1


def _dispatch_table() -> dict[type, Callable[[Any], Any]]:
    """copyreg's reducers (re-read when one is added) with ours on top."""
    global _copyreg_size
    if len(copyreg.dispatch_table) != _copyreg_size:
        _dispatch.clear()
        _dispatch.update(copyreg.dispatch_table)
        _dispatch.update(_own)
        _copyreg_size = len(copyreg.dispatch_table)
    return _dispatch


class _Pickler(pickle.Pickler):
    # The table as a class attribute: the pickler finds it at creation, with no
    # per-message assignment. ``_dispatch`` is updated in place (_dispatch_table).
    dispatch_table = _dispatch


def register_extension(cls: type, reduce: Callable[[Any, EncodeContext], Any]) -> None:
    """Pickle instances of exactly ``cls`` with ``reduce(obj, ctx)``.

    ``reduce`` returns what ``__reduce__`` would, ``(rebuild, args)``, where ``rebuild`` is
    a module-level function; it can call :func:`current_decode_context` to reach the
    receiving agent. ``args`` may hold tensors and other extension objects.
    """
    if cls in _own and cls not in (torch.Tensor, torch.nn.Parameter):
        existing = _own[cls]
        if getattr(existing, "__wrapped_reduce__", None) is not reduce:
            raise ValueError(f"a codec extension for {cls.__qualname__} is already registered")

    def dispatch(obj: Any) -> Any:
        return reduce(obj, current_encode_context())

    dispatch.__wrapped_reduce__ = reduce  # type: ignore[attr-defined]
    global _copyreg_size
    _own[cls] = dispatch
    _copyreg_size = -1  # rebuild the table on next use


class Placed:
    """A tensor that lands on ``device`` at the receiver, whatever the device map says.

    Distributed autograd sends each gradient back to the device its forward tensor
    came from, which the maps of the backward direction need not cover.
    """

    __slots__ = ("device", "tensor")

    def __init__(self, tensor: torch.Tensor, device: torch.device) -> None:
        self.tensor = tensor
        self.device = device


def _reduce_placed(obj: Placed, ctx: EncodeContext) -> Any:
    if obj.tensor.device.type != "cpu":
        ctx.placements[id(obj.tensor)] = obj.device
    return (_rebuild_placed, (obj.tensor,))


def _rebuild_placed(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


register_extension(Placed, _reduce_placed)


# ----------------------------------------------------------------------------- messages


def encode(kind: int, request_id: int, payload: Any, ctx: EncodeContext) -> Frame:
    """Encode one envelope. Raises :class:`SerializationError` if ``payload`` cannot be pickled."""
    if not 0 <= kind <= _KIND_MASK:
        raise ValueError(f"message kind {kind} out of range (0-{_KIND_MASK})")
    file = io.BytesIO()
    file.write(_ENVELOPE.pack(kind, request_id))
    if ctx.scope is not None:
        file.write(bytes(_SCOPE.size))  # filled in below: hooks may set the tag meanwhile
    _dispatch_table()  # (refreshed if copyreg gained a reducer)
    pickler = _Pickler(file, _PROTOCOL)
    outer = _contexts.encoding
    _contexts.encoding = ctx
    try:
        pickler.dump(payload)
    except ReduceError as exc:
        raise exc.error  # noqa: B904  (the original error is the whole story)
    except SerializationError:
        raise
    except Exception as exc:  # pickle raises PicklingError, TypeError, AttributeError, ...
        raise SerializationError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        _contexts.encoding = outer
    flags = 0
    if ctx.scope is not None:
        flags |= _SCOPED
        view = file.getbuffer()
        _SCOPE.pack_into(view, _ENVELOPE.size, ctx.scope, ctx.scope_tag)
        del view
    header = file.getvalue()
    if ctx.notes:
        # Notes are known only once the payload is pickled (extensions add them), so
        # they are spliced in between the envelope (and scope) and the payload.
        flags |= _NOTED
        # Kinds as plain ints: notes are read by an unpickler that refuses every global
        # (decode_notes), so they cannot name a class or function, let alone run one.
        notes = pickle.dumps([(int(kind), payload) for kind, payload in ctx.notes], _PROTOCOL)
        at = _ENVELOPE.size + (_SCOPE.size if ctx.scope is not None else 0)
        header = b"".join((header[:at], _NOTES_LEN.pack(len(notes)), notes, header[at:]))
    if flags:
        header = _ENVELOPE.pack(kind | flags, request_id) + header[_ENVELOPE.size :]
    return Frame(header, ctx.buffers, owned=frozenset(ctx.owned))


def decode_envelope(frame: Frame) -> tuple[int, int]:
    """The ``(kind, request_id)`` of a frame; never fails on a well-formed frame."""
    kind, request_id = _ENVELOPE.unpack_from(frame.header)
    return kind & _KIND_MASK, request_id


def has_notes(frame: Frame) -> bool:
    """True if one-way messages ride in this frame (see ``EncodeContext.notes``)."""
    return bool(frame.header[0] & _NOTED)


class _PlainDataUnpickler(pickle.Unpickler):
    """Reads plain data only (numbers, strings, bytes, tuples, lists, dicts, sets):
    any class or function the stream names is refused, so nothing can run."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(
            f"plain data expected, but the stream names {module}.{name}"
        )


def decode_notes(frame: Frame) -> list[tuple[int, Any]]:
    """The one-way messages riding in ``frame``; ``[]`` if none.

    Raises :class:`SerializationError` if they are not plain data (see ``encode``).
    """
    if not frame.header[0] & _NOTED:
        return []
    start = _ENVELOPE.size + (_SCOPE.size if frame.header[0] & _SCOPED else 0)
    (length,) = _NOTES_LEN.unpack_from(frame.header, start)
    start += _NOTES_LEN.size
    data = memoryview(frame.header)[start : start + length]
    try:
        notes = _PlainDataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise SerializationError(f"unreadable notes: {type(exc).__name__}: {exc}") from None
    if not isinstance(notes, list) or not all(
        isinstance(note, tuple) and len(note) == 2 and type(note[0]) is int for note in notes
    ):
        raise SerializationError("unreadable notes: not a list of (kind, payload) pairs")
    return notes


def _payload_start(header: bytes) -> int:
    start = _ENVELOPE.size
    if header[0] & _SCOPED:
        start += _SCOPE.size
    if header[0] & _NOTED:
        (length,) = _NOTES_LEN.unpack_from(header, start)
        start += _NOTES_LEN.size + length
    return start


def decode_scope(frame: Frame) -> tuple[int | None, int]:
    """The ``(scope, scope_tag)`` of a frame; ``(None, 0)`` if it has none."""
    if not frame.header[0] & _SCOPED:
        return None, 0
    scope, tag = _SCOPE.unpack_from(frame.header, _ENVELOPE.size)
    return scope, tag


class _Missing:
    """Stands in, in a lenient decode, for a class or function that cannot be found."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Missing:
        return self

    def __setstate__(self, state: Any) -> None:
        pass


class _Tolerant:
    """Wraps a reconstructor in a lenient decode so that one that raises yields a
    :class:`_Missing` instead of aborting the whole decode."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._fn(*args, **kwargs)
        except Exception:
            return _Missing()


class _LenientUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            found = super().find_class(module, name)
        except (ImportError, AttributeError):
            return _Missing
        # Classes stay as they are: NEWOBJ insists on a real type. Reconstructor
        # functions (what ``__reduce__`` usually returns) may raise; tolerate that.
        if isinstance(found, type) or not callable(found):
            return found
        return _Tolerant(found)


def pickle_exception(exc: BaseException) -> bytes | None:
    """``exc`` pickled on its own (see :class:`rpcx.errors.RemoteErrorInfo`), or ``None``
    if it carries state pickle cannot take: the error is still reported, by description."""
    try:
        return pickle.dumps(exc, protocol=_PROTOCOL)
    except Exception:
        return None


def unpickle_exception(data: bytes | None) -> BaseException | None:
    """The exception :func:`pickle_exception` made, or ``None`` if it cannot be rebuilt
    here (its class is missing, its ``__init__`` takes other arguments, ...).

    The bytes came inside a frame (checked with the world key before the codec read it,
    when there is one), from a worker of the world.
    """
    if data is None:
        return None
    try:
        candidate = pickle.loads(data)
    except Exception:
        return None
    return candidate if isinstance(candidate, BaseException) else None


# RemoteErrorInfo (rpcx.errors, below the codec) pickles the exceptions it carries with these.
use_exception_pickling(pickle_exception, unpickle_exception)


class _ControlUnpickler(pickle.Unpickler):
    """Reads the payload of an RRef or autograd bookkeeping message: plain data, tensors
    (rebuilt by the codec's own functions from plain arguments) and rpcx's record of a
    remote error. Any other class or function the stream names is refused."""

    _ALLOWED = frozenset({
        ("rpcx.serialization", "_rebuild_tensor"),
        ("rpcx.serialization", "_rebuild_view"),
        ("rpcx.serialization", "_rebuild_sparse"),
        ("rpcx.serialization", "_rebuild_placed"),  # (a gradient bound for a device)
        ("rpcx.errors", "RemoteErrorInfo"),
    })

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(
                f"a bookkeeping message holds plain data and tensors only, but the stream "
                f"names {module}.{name}"
            )
        return super().find_class(module, name)


class _LenientControlUnpickler(_ControlUnpickler):
    """The recovery read of a bookkeeping message that failed: what the strict read
    refuses becomes an inert placeholder, so nothing it names is imported or run, but
    the message's frame (an autograd chain's driver and token) can still be read."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except pickle.UnpicklingError:
            return _Missing


def decode_payload(frame: Frame, ctx: DecodeContext, lenient: bool = False) -> Any:
    """Unpickle a frame's payload. Raises :class:`SerializationError` saying what failed.

    ``lenient=True`` replaces classes and functions that cannot be found by inert
    placeholders, to recover what can be recovered from a message that failed to decode.
    Requests of the bookkeeping kinds (``CONTROL_KINDS``) are read by an unpickler that
    refuses anything but plain data and tensors; leniently, it puts placeholders where
    the strict read refused, and still imports and calls nothing else.
    """
    ctx.buffers = frame.buffers
    start = _payload_start(frame.header)
    outer = _contexts.decoding
    _contexts.decoding = ctx
    try:
        data = memoryview(frame.header)[start:]
        if frame.header[0] & _KIND_MASK in CONTROL_KINDS:
            control = _LenientControlUnpickler if lenient else _ControlUnpickler
            return control(io.BytesIO(data)).load()
        if lenient:
            return _LenientUnpickler(io.BytesIO(data)).load()
        return pickle.loads(data)
    except SerializationError:
        raise
    except Exception as exc:  # a missing module or class, a failing __setstate__, ...
        raise SerializationError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        _contexts.decoding = outer
