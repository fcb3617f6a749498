"""The small things every transport spells: sentences, size checks, byte views, options.

Everything here is public and stable for plugin authors; :mod:`rpcx.transport_kit`
re-exports it.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from rpcx._util.environ import environment_variable
from rpcx._util.memory import copy_of, empty_bytes
from rpcx.errors import (
    CLOSED_CONNECTION,
    LostCause,
    PeerLostError,
    ProtocolError,
    RpcTimeoutError,
    lost_reason,
    without_cpp_locations,
)
from rpcx.options import RpcBackendOptions, converted_options
from rpcx.transport import TransportContext

__all__ = [
    "CLOSED_CONNECTION", "SHUT_DOWN", "as_bytes", "check_count", "check_frame_size",
    "classify", "connect_limit", "connect_timeout", "copy_of", "describe", "empty_bytes",
    "environment_variable", "lost_error", "lost_reason", "memory_of", "options_as",
    "owning_memory", "run_bounded", "unreachable", "without_cpp_locations",
]

# ------------------------------------------------------------------------ sentences
# A transport reports a lost peer as ``ctx.peer_lost(rank, cause, detail)`` and rpcx
# writes the sentence (:func:`rpcx.errors.lost_reason`). These are the few sentences a
# transport still writes itself: the ``PeerLostError`` its ``send`` raises.

SHUT_DOWN = "has shut down"
"""What ``send`` raises (in a ``PeerLostError``) for a peer that said goodbye, or after
this worker said its own: the end of "worker 'x' (rank N) has shut down"."""


def unreachable(detail: str) -> str:
    """``"is unreachable: <detail>"``: ``send``'s ``PeerLostError`` for a broken link."""
    return lost_reason(LostCause.CONNECTION_LOST, detail)


def describe(exc: BaseException) -> str:
    """What went wrong, in a few words: an ``OSError``'s ``strerror``, otherwise the
    message's first line without C++ source locations (torch and gloo add them)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    lines = str(exc).strip().splitlines()
    text = without_cpp_locations(lines[0]) if lines else ""
    return text or type(exc).__name__


def lost_error(exc: BaseException) -> PeerLostError:
    """The ``PeerLostError`` a ``send`` raises when writing failed with ``exc``."""
    if isinstance(exc, PeerLostError):
        return exc
    return PeerLostError(unreachable(describe(exc)), cause=LostCause.CONNECTION_LOST)


def classify(exc: BaseException) -> tuple[LostCause, str]:
    """``(cause, detail)`` for ``peer_lost`` from what ended a receive loop.

    End of file or a reset: the peer's process went away (``CLOSED_CONNECTION``).
    Another ``OSError``: the connection broke (its type and message). A
    :class:`~rpcx.errors.ProtocolError`, or any other exception reading a frame: the
    peer sent what is no frame (``PROTOCOL_ERROR``).
    """
    if isinstance(exc, EOFError | ConnectionResetError):
        return LostCause.CONNECTION_LOST, CLOSED_CONNECTION
    if isinstance(exc, ProtocolError):
        return LostCause.PROTOCOL_ERROR, str(exc)
    if isinstance(exc, OSError):
        return LostCause.CONNECTION_LOST, f"{type(exc).__name__}: {exc}"
    return LostCause.PROTOCOL_ERROR, f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------- size checks


def check_frame_size(nbytes: int, max_frame: int, what: str = "a frame") -> None:
    """Refuse ``what`` announcing ``nbytes`` bytes when over ``max_frame_bytes``.

    Call it with the sizes a peer *announces*, before anything is read or allocated for
    them: ``ProtocolError("a frame of N bytes, over max_frame_bytes (M)")``.
    """
    if nbytes > max_frame:
        raise ProtocolError(f"{what} of {nbytes} bytes, over max_frame_bytes ({max_frame})")


def check_count(count: int, limit: int, what: str = "buffers") -> None:
    """Refuse a frame announcing more than ``limit`` ``what`` (read up front)."""
    if count > limit:
        raise ProtocolError(f"a frame announcing {count} {what} (at most {limit})")


# ----------------------------------------------------------------------- byte views


# A tensor larger than this travels in pieces of this size where a transport cannot
# see a message arrive part by part (gloo, ZeroMQ): the receiver calls
# TransportContext.progress after each piece, so a peer whose 2 GiB tensor takes 17 s at
# 1 Gbit/s (longer than heartbeat_timeout) is not taken for silent. A piece lands every
# 1.7 s at 20 Mbit/s.
PIECE_BYTES = 4 << 20


def pieces(data: torch.Tensor, size: int = PIECE_BYTES) -> list[torch.Tensor]:
    """``data`` (flat bytes) as the views it travels in: pieces of ``size`` bytes, the
    last one shorter; ``[data]`` when it is no larger than one."""
    total = data.numel()
    if total <= size:
        return [data]
    return [data[start : start + size] for start in range(0, total, size)]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a contiguous tensor's memory (no copy)."""
    flat = tensor.reshape(-1)
    return flat if flat.dtype is torch.uint8 else flat.view(torch.uint8)


def memory_of(tensor: torch.Tensor) -> memoryview:
    """A memoryview over a contiguous CPU tensor's bytes, without numpy (no copy).

    Valid only while the tensor lives: keep the tensor until the bytes are written.
    """
    nbytes = tensor.numel() * tensor.element_size()
    array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


def owning_memory(tensor: torch.Tensor) -> ctypes.Array[ctypes.c_char]:
    """A buffer over a contiguous CPU tensor's bytes that keeps the tensor alive.

    For libraries that hold a buffer past the call (ZeroMQ's zero-copy sends).
    """
    nbytes = tensor.numel() * tensor.element_size()
    memory = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    memory.tensor = tensor  # type: ignore[attr-defined]  # ctypes objects take attributes
    return memory


# -------------------------------------------------------------------------- options

OptionsT = TypeVar("OptionsT", bound=RpcBackendOptions)


def options_as(ctx: TransportContext, cls: type[OptionsT]) -> OptionsT:
    """``ctx.options`` as the transport's own options type ``cls``.

    rpcx hands each transport options of its registered ``options_type`` (``init_rpc``
    converts them once); any other options object (a test's, torch's) becomes a ``cls``
    with the fields the two share and the defaults of the rest.
    """
    options = ctx.options
    if isinstance(options, cls):
        return options
    return converted_options(options, cls)


# ---------------------------------------------------------------- bounded connecting


def connect_limit(ctx: TransportContext) -> float | None:
    """How long connecting to the mesh may take: ``rpc_timeout`` (``None``: no bound)."""
    return ctx.options.rpc_timeout or None


def connect_timeout(ctx: TransportContext, what: str,
                    hint: str = "a peer probably died after joining the world") -> RpcTimeoutError:
    """The error for a mesh not connected in time::

        init_rpc: worker 'w' (rank 1) could not connect <what> within 30 s
        (rpc_timeout); <hint>
    """
    limit = connect_limit(ctx) or 0.0
    return RpcTimeoutError(
        f"init_rpc: worker {ctx.names[ctx.rank]!r} (rank {ctx.rank}) could not connect "
        f"{what} within {limit:g} s (rpc_timeout); {hint}"
    )


T = TypeVar("T")


def run_bounded(ctx: TransportContext, connect: Callable[[], T], what: str,
                hint: str = "a peer probably died after joining the world") -> T:
    """``connect()`` on a helper thread, waited for at most ``rpc_timeout``.

    For a library call that cannot be given a timeout of its own (gloo's mesh): past
    the bound the thread is abandoned, still blocked, and :func:`connect_timeout`'s
    error is raised. An exception from ``connect`` is raised on the caller's thread.
    """
    done: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(connect())
        except BaseException as exc:  # surfaced on the caller's thread below
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True,
                              name=f"rpcx-{ctx.names[ctx.rank]}-connect")
    thread.start()
    thread.join(connect_limit(ctx))
    if failed:
        raise failed[0]
    if not done:
        raise connect_timeout(ctx, what, hint)
    return done[0]
