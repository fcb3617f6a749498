"""Receive buffers for large tensors.

A freshly allocated multi-megabyte buffer is mapped page by page as data lands in it, and
on Linux those 4 KiB page faults, not the copy, dominate a large receive (measured here: a
64 MiB gloo receive takes 60-130 ms into fresh memory, 16 ms into reused memory). Asking
the kernel for transparent huge pages on such buffers (``madvise(MADV_HUGEPAGE)``) brings
it to about 23 ms. The advice is only a hint: where it is unavailable nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

__all__ = ["copy_of", "empty_bytes", "memory_at", "memory_of"]

log = logging.getLogger("rpcx.memory")

HUGE_PAGE = 2 << 20
_THRESHOLD = 4 << 20  # smaller buffers gain nothing measurable
# glibc maps an allocation this large afresh every time (its mmap threshold stops
# growing at 32 MiB on 64-bit), so its pages fault in on every receive; below it a
# freed buffer's pages are reused and aligning would only cost memory. Aligned, a 64
# MiB buffer filled here took 8 ms against 17 ms unaligned and 28-33 ms without advice.
_ALIGNED = 32 << 20
_MADV_HUGEPAGE = 14

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        _madvise = None


def empty_bytes(nbytes: int, exact: bool = False) -> torch.Tensor:
    """An uninitialised flat ``uint8`` CPU tensor of ``nbytes``, huge-page backed if large.

    From ``_ALIGNED`` bytes up it is a view into an allocation one huge page longer,
    starting on a huge-page boundary, so that all of it can be huge pages; ``exact``:
    never a view (its storage is exactly ``nbytes``, for what a transport may send whole,
    storage and all), so only the huge pages inside it.
    """
    if _madvise is not None and nbytes >= _ALIGNED and not exact:
        whole = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
        offset = -whole.data_ptr() % HUGE_PAGE
        buffer = whole[offset : offset + nbytes]
    else:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
    if _madvise is not None and nbytes >= _THRESHOLD:
        start = (buffer.data_ptr() + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        end = (buffer.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            _madvise(start, end - start, _MADV_HUGEPAGE)
    return buffer


def copy_of(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a contiguous CPU tensor, in a buffer from :func:`empty_bytes` when large."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < _THRESHOLD or tensor.device.type != "cpu":
        return tensor.clone()
    out = empty_bytes(nbytes)
    out.copy_(tensor.reshape(-1).view(torch.uint8))
    return out


def memory_of(tensor: torch.Tensor) -> memoryview:
    """A memoryview over a contiguous CPU tensor's bytes, without numpy (no copy).

    Valid only while the tensor lives: keep the tensor until the bytes are written.
    """
    return memory_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def memory_at(address: int, nbytes: int) -> memoryview:
    """:func:`memory_of` for a caller that has read the tensor's address and size
    already (the codec, per small tensor sent): the same view, no torch call."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
