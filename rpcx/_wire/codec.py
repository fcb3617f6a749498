"""The codec: message envelopes to :class:`~rpcx.transport.Frame` and back.

The only module that touches pickle. One pickling pass per message. A tensor becomes a
reference to a slot in the frame's buffer list, with its dtype and shape, so a transport
moves tensor memory as-is; small CPU tensors are the exception, their bytes pickled into
the header (up to ``INLINE_MAX_BYTES`` a message: a buffer costs more than copying them).

Speed matters here (it is on every call), so the pickler runs Python code only for the
types that need it: a per-pickler ``dispatch_table`` maps ``torch.Tensor`` and every
registered *extension* type to a reduce function. Those functions, and the rebuild
functions the pickle stream names, find the message being encoded or decoded through a
thread-local context (set for the duration of one ``encode``/``decode_payload`` call).

Services that need custom treatment of their objects on the wire (RRefs) register an
extension: a type, a reduce function run while encoding and a module-level rebuild
function run while decoding. The reduce and rebuild functions live in
:mod:`rpcx._wire.reducers`, the per-message contexts in :mod:`rpcx._wire.contexts`;
this module is the envelope, the pickling passes and the unpicklers' allow-lists, and
the one import the rest of rpcx needs.

A message may carry a *scope*: an integer a service attaches to it (distributed
autograd's context id) plus a tag the service may set while encoding. Scoped messages
pass every tensor that requires grad through the scope hooks (:func:`set_scope_hooks`),
which is how autograd records the edges of its graph on both sides of a call.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Callable
from typing import Any

from rpcx._wire.contexts import (
    DecodeContext,
    EncodeContext,
    ReduceError,
    contexts,
    current_decode_context,
    current_encode_context,
)
from rpcx._wire.reducers import (
    PROTOCOL,
    Pickler,
    Placed,
    refresh_dispatch_table,
    register_extension,
    set_scope_hooks,
)
from rpcx.errors import SerializationError, use_exception_pickling
from rpcx.messages import CONTROL_KINDS
from rpcx.transport import Frame

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


# ----------------------------------------------------------------------------- messages


def encode(kind: int, request_id: int, payload: Any, ctx: EncodeContext) -> Frame:
    """Encode one envelope. Raises :class:`SerializationError` if ``payload`` cannot be pickled."""
    if not 0 <= kind <= _KIND_MASK:
        raise ValueError(f"message kind {kind} out of range (0-{_KIND_MASK})")
    file = io.BytesIO()
    file.write(_ENVELOPE.pack(kind, request_id))
    if ctx.scope is not None:
        file.write(bytes(_SCOPE.size))  # filled in below: hooks may set the tag meanwhile
    refresh_dispatch_table()  # (if copyreg gained a reducer)
    pickler = Pickler(file, PROTOCOL)
    outer = contexts.encoding
    contexts.encoding = ctx
    try:
        pickler.dump(payload)
    except ReduceError as exc:
        raise exc.error  # noqa: B904  (the original error is the whole story)
    except SerializationError:
        raise
    except Exception as exc:  # pickle raises PicklingError, TypeError, AttributeError, ...
        raise SerializationError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        contexts.encoding = outer
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
        notes = pickle.dumps([(int(kind), payload) for kind, payload in ctx.notes], PROTOCOL)
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
        return pickle.dumps(exc, protocol=PROTOCOL)
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
        ("rpcx._wire.reducers", "_rebuild_tensor"),
        ("rpcx._wire.reducers", "_rebuild_inline"),
        ("rpcx._wire.reducers", "_rebuild_view"),
        ("rpcx._wire.reducers", "_rebuild_sparse"),
        ("rpcx._wire.reducers", "_rebuild_placed"),  # (a gradient bound for a device)
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
    outer = contexts.decoding
    contexts.decoding = ctx
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
        contexts.decoding = outer
