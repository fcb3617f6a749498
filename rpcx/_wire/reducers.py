"""What the pickler runs for objects that are not plain data: tensors, which leave the
byte stream for the frame's buffer list, and the extension types services register
(RRefs, :class:`Placed`), through one ``dispatch_table``.

Each reduce function names a module-level rebuild function in the stream; the codec's
unpicklers allow exactly those (``rpcx._wire.codec``). Both sides reach the message
through :mod:`rpcx._wire.contexts`. Tensors that require grad in a scoped message pass
through the scope hooks (:func:`set_scope_hooks`): how distributed autograd records the
edges of its graph on both sides of a call.
"""

from __future__ import annotations

import copyreg
import logging
import math
import os
import pickle
from collections.abc import Callable
from typing import Any

import torch

from rpcx._util.memory import memory_at
from rpcx._wire.contexts import (
    DecodeContext,
    EncodeContext,
    current_decode_context,
    current_encode_context,
)
from rpcx.errors import SerializationError

__all__ = [
    "PROTOCOL",
    "Pickler",
    "Placed",
    "refresh_dispatch_table",
    "register_extension",
    "set_scope_hooks",
]

log = logging.getLogger("rpcx.codec")

PROTOCOL = 5
"""The pickle protocol of every message (5: buffers out of band)."""


def _limit_from_environment(default: int) -> int:
    """``$RPCX_INLINE_MAX_BYTES`` if it is set (a number of bytes), else ``default``."""
    raw = os.environ.get("RPCX_INLINE_MAX_BYTES")
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        log.warning("RPCX_INLINE_MAX_BYTES=%r is not a number of bytes; using %d", raw,
                    default)
        return default


INLINE_MAX_BYTES = _limit_from_environment(32 << 10)
"""Small CPU tensors travel inside the header (their bytes copied into the pickle), not
beside it as buffers of the frame, while the message's tensors in the header add up to
at most this many bytes. Each buffer costs the transports, the byte budget and the
receiver a fixed amount of Python and torch calls a side: a 3x3 tensor echo on ``auto``
took 83-93 us more CPU per process than an int echo as a buffer, 30 us in the header.
Echoes of one 3x3 to 64 KiB tensor, one setting against the other in the same processes,
were 1.07-1.49x faster in the header on auto, gloo, tensorpipe and zmq. The bound per
message keeps a header small enough to pass a bulk transfer (the socket backends'
``_PASS_MAX``, 64 KiB): a message with many small tensors (a state dict) sends the rest
as buffers. ``$RPCX_INLINE_MAX_BYTES`` sets it in a process that imports rpcx (0: every
tensor a buffer; the test suite runs some passes so, to exercise transports' paths for
small buffers)."""
_DTYPES: dict[str, torch.dtype] = {
    str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
# The dtypes a tensor in the header may have, by dtype and by name: plain numbers whose
# bytes are the values (no quantized dtypes: a tensor built over bytes with one has no
# quantizer, and crashes the process when read; no sub-byte or experimental ones).
_IN_HEADER: dict[torch.dtype, str] = {
    dtype: str(dtype) for dtype in (
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
        torch.complex128,
        *(getattr(torch, name) for name in ("uint16", "uint32", "uint64")
          if isinstance(getattr(torch, name, None), torch.dtype)),
    )
}
_IN_HEADER_BY_NAME = {name: dtype for dtype, name in _IN_HEADER.items()}

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


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    if tensor.layout is not torch.strided or tensor.is_quantized:
        if tensor.layout in _SPARSE_LAYOUTS:
            return _reduce_sparse(tensor)
        return tensor.__reduce_ex__(PROTOCOL)  # type: ignore[no-untyped-call]  # rare layouts: torch's own pickling, in band
    ctx = current_encode_context()
    if tensor.is_cpu and tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg()):
        # The common small tensor, in the header (see INLINE_MAX_BYTES), with as few
        # torch calls as it takes: a contiguous tensor's bytes are dense, in order,
        # whatever the strides of its size-1 dimensions.
        inline = _in_header(ctx, tensor, tensor)
        if inline is not None:
            _seen(ctx, tensor)
            return (_rebuild_inline, inline)
    target: torch.device | None = None
    if not tensor.is_cpu:
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
    if copied and target is None and stride is None:
        # A small tensor made contiguous here (a conjugated or negated view, a narrow
        # view of a wide storage): the header takes it too. (A plain one was offered
        # it above already.)
        inline = _in_header(ctx, tensor, data)
        if inline is not None:
            _seen(ctx, tensor)
            return (_rebuild_inline, inline)
    args: tuple[Any, ...] = (
        len(ctx.buffers), str(tensor.dtype), tuple(tensor.shape), tensor.requires_grad,
        type(tensor) is torch.nn.Parameter,
    )
    if target is not None:
        args += (str(target), str(tensor.device))
    ctx.buffers.append(data)
    if copied:
        ctx.owned.append(len(ctx.buffers) - 1)
    _seen(ctx, tensor)
    if stride is not None:
        return (_rebuild_view, (stride, *args))
    return (_rebuild_tensor, args)


def _in_header(ctx: EncodeContext, tensor: torch.Tensor, data: torch.Tensor
               ) -> tuple[Any, ...] | None:
    """``_rebuild_inline``'s arguments for ``tensor`` (its bytes: ``data``, contiguous,
    on the CPU), or ``None`` if it goes beside the header: too large for what is left of
    the message's room (INLINE_MAX_BYTES), a dtype the header does not carry, or no
    memory to read (a storage freed in place, a tensor of zeros that has none)."""
    nbytes = data.nbytes
    name = _IN_HEADER.get(tensor.dtype)
    if name is None or ctx.in_header + nbytes > INLINE_MAX_BYTES:
        return None
    address = data.data_ptr()
    if nbytes and not address:
        return None
    ctx.in_header += nbytes
    payload = bytearray(memory_at(address, nbytes)) if nbytes else bytearray()
    return (payload, name, tuple(tensor.shape), tensor.requires_grad,
            type(tensor) is torch.nn.Parameter)


def _seen(ctx: EncodeContext, tensor: torch.Tensor) -> None:
    """Every tensor sent goes through this, in the order the stream holds them, once
    its arguments are built (a tensor that cannot be sent records nothing)."""
    ctx.tensors.append(tensor)
    if (ctx.scope is not None and tensor.requires_grad and _scope_hooks is not None
            and torch.is_grad_enabled()):
        # (As torch's RPC: a message sent with grad mode off records no autograd edge.)
        _scope_hooks[0](ctx, tensor)


def _rebuild_inline(data: bytearray, dtype_name: str, shape: tuple[int, ...],
                    requires_grad: bool, param: bool) -> torch.Tensor:
    """A small tensor that travelled in the header: a tensor over its own bytes. What a
    peer sent is checked first: a plain dtype, a shape of non-negative ints, and bytes
    (a ``bytearray``) that fill it exactly."""
    dtype = _IN_HEADER_BY_NAME.get(dtype_name)
    if dtype is None:
        raise SerializationError(f"malformed tensor in the message: dtype {dtype_name!r} "
                                 "cannot travel in the header")
    if type(data) is not bytearray:
        raise SerializationError("malformed tensor in the message: its bytes are "
                                 f"{type(data).__name__}, not a bytearray")
    if type(shape) is not tuple or not all(type(n) is int and n >= 0 for n in shape):
        raise SerializationError(f"malformed tensor in the message: shape {shape!r}")
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise SerializationError(f"malformed tensor in the message: {len(data)} bytes for "
                                 f"shape {shape} of {dtype_name}")
    if data:
        tensor = torch.frombuffer(data, dtype=dtype).view(shape)
    else:
        tensor = torch.empty(shape, dtype=dtype)
    return _finish(current_decode_context(), tensor, bool(requires_grad), bool(param), None)


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


def refresh_dispatch_table() -> dict[type, Callable[[Any], Any]]:
    """copyreg's reducers (re-read when one is added) with ours on top."""
    global _copyreg_size
    if len(copyreg.dispatch_table) != _copyreg_size:
        _dispatch.clear()
        _dispatch.update(copyreg.dispatch_table)
        _dispatch.update(_own)
        _copyreg_size = len(copyreg.dispatch_table)
    return _dispatch


class Pickler(pickle.Pickler):
    """The codec's pickler: rpcx's reducers through a shared ``dispatch_table``."""

    # The table as a class attribute: the pickler finds it at creation, with no
    # per-message assignment. ``_dispatch`` is updated in place (refresh_dispatch_table).
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
