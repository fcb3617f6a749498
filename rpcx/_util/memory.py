"""Buffers for large tensors: received ones, and send buffers used again.

A freshly allocated multi-megabyte buffer is mapped page by page as data lands in it, and
on Linux those 4 KiB page faults, not the copy, dominate a large receive (measured here: a
64 MiB gloo receive takes 60-130 ms into fresh memory, 16 ms into reused memory). Asking
the kernel for transparent huge pages on such buffers (``madvise(MADV_HUGEPAGE)``) brings
it to about 23 ms. The advice is only a hint: where it is unavailable nothing changes.

A buffer that only carries bytes out (an encrypted copy of a tensor, see
:mod:`rpcx._wire.cipher`) need not be fresh each time: :class:`ReusedBuffers` hands out
one again once nothing holds it any more, so its pages are faulted in once, not per send.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading

import torch

__all__ = ["ReusedBuffers", "copy_of", "empty_bytes", "memory_at", "memory_of", "reuses_buffers"]

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


# How many tensors share a storage (torch's own count, private: without it every buffer
# is fresh, as before).
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def reuses_buffers() -> bool:
    """Whether :class:`ReusedBuffers` can tell a buffer is free (this torch counts a
    storage's tensors); if not, it hands out fresh buffers only."""
    return _storage_use_count is not None


class _Kept:
    """A buffer kept for use again, with the counts it has when nothing else holds it:
    tensors over its storage, and references to the storage's one Python object (torch
    hands out the same object each time: ``tensor.untyped_storage()`` held alone)."""

    __slots__ = ("buffer", "idle_count", "idle_refs", "storage")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.storage = buffer.untyped_storage()  # (held: counted once, in idle_count)
        self.idle_count = self._count()
        self.idle_refs = sys.getrefcount(self.storage)

    def _count(self) -> int:
        assert _storage_use_count is not None
        count: int = _storage_use_count(self.storage._cdata)
        return count

    def idle(self) -> bool:
        """Nothing but this record holds the buffer: no frame, no transport, no view."""
        return (self._count() == self.idle_count
                and sys.getrefcount(self.storage) == self.idle_refs)


class ReusedBuffers:
    """Large flat ``uint8`` buffers of exact sizes, each handed out again once nothing
    holds what was handed out before (a transport, a frame, a receiver in this process).

    For buffers that carry bytes out and are dropped when the send is over, as an
    encrypted copy of a tensor is: a fresh 64 MiB buffer costs about 3 ms of page
    faults and zeroing each time (the kernel's, measured here) before a byte is written.
    Whether a buffer is still held is torch's count of the tensors over its storage, so
    whoever keeps a view of it, for as long as it likes, keeps it from being reused; a
    holder of only its raw address must be done with it when its call returns, as a
    transport's ``send`` is. At most ``limit`` bytes are kept, idle or not; a buffer past
    that is a fresh one, as are buffers under ``smallest`` bytes (the allocator reuses
    those by itself).
    """

    def __init__(self, limit: int = 256 << 20, smallest: int = _THRESHOLD) -> None:
        self.limit = limit
        self.smallest = smallest
        self._kept: list[_Kept] = []  # (oldest first)
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused = 0  # buffers handed out again (for tests and debugging)

    @property
    def kept_bytes(self) -> int:
        """Bytes kept now, idle or handed out."""
        return self._bytes

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of exactly ``nbytes`` (its storage too), filled with anything: one
        kept and idle, else a new one (kept if there is room). Hold the tensor returned
        for as long as its bytes are needed; drop it to give the buffer back."""
        if _storage_use_count is None or not self.smallest <= nbytes <= self.limit:
            return empty_bytes(nbytes, exact=True)
        with self._lock:
            for kept in self._kept:
                if kept.buffer.numel() == nbytes and kept.idle():
                    self.reused += 1
                    # (a view: a tensor of its own over the storage, which counts it)
                    return kept.buffer.view(-1)
            if self._bytes + nbytes > self.limit:
                self._drop_idle(self._bytes + nbytes - self.limit)
            if self._bytes + nbytes > self.limit:
                return empty_bytes(nbytes, exact=True)
            kept = _Kept(empty_bytes(nbytes, exact=True))
            self._kept.append(kept)
            self._bytes += nbytes
            return kept.buffer.view(-1)

    def _drop_idle(self, at_least: int) -> None:
        # Oldest first: a size no longer sent makes room for the one sent now.
        freed = 0
        for kept in list(self._kept):
            if freed >= at_least:
                break
            if kept.idle():
                self._kept.remove(kept)
                self._bytes -= kept.buffer.numel()
                freed += kept.buffer.numel()

    def clear(self) -> None:
        """Forget every kept buffer (those handed out live on with their holders)."""
        with self._lock:
            self._kept.clear()
            self._bytes = 0
