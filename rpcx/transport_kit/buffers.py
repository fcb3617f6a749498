"""A frame's bytes: checks of what a peer announces, byte views of tensors without
copies, and the pieces a large tensor travels in.

Public and stable for plugin authors; :mod:`rpcx.transport_kit` re-exports them.
"""

from __future__ import annotations

import ctypes

import torch

from rpcx._util.memory import copy_of, empty_bytes, memory_of
from rpcx.errors import ProtocolError

__all__ = ["PIECE_BYTES", "as_bytes", "check_count", "check_frame_size", "copy_of",
           "empty_bytes", "memory_of", "owning_memory", "pieces"]


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


def owning_memory(tensor: torch.Tensor) -> ctypes.Array[ctypes.c_char]:
    """A buffer over a contiguous CPU tensor's bytes that keeps the tensor alive.

    For libraries that hold a buffer past the call (ZeroMQ's zero-copy sends).
    """
    nbytes = tensor.numel() * tensor.element_size()
    memory = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    memory.tensor = tensor  # type: ignore[attr-defined]  # ctypes objects take attributes
    return memory
