"""Shared-memory segments: the pool a sender fills for one peer, the peer's mappings of it.

Fresh shared memory is slow to fill: the kernel must find and zero every page first, and
for a 64 MiB tensor that cost more than the copy itself (measured: 0.73x torch's echo
with a fresh segment per tensor). So each worker keeps, per peer, a pool of segments it
has already paged in. A segment is busy from the send that fills it until the peer says
it freed the tensor over it (a ``FREE`` frame), then it is filled again. The peer maps
each segment once, when its descriptor first arrives, and keeps the mapping.

A tensor handed to rpcx on the receiving side is a view of the mapping, so it costs no
copy. The weak-reference finalizer of the memoryview under it reports when the last
tensor sharing that memory is gone, whatever views rpcx or the program made of it.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Callable

import torch

__all__ = ["ONE_OFF", "ReceivedSegments", "Segment", "SendPool", "one_off_copy"]

ONE_OFF = 0  # the segment id of a segment filled once and never pooled
_GRANULE = 1 << 20  # segments are sized in whole MiB, so a pool serves nearby sizes


def _shared_file(capacity: int) -> tuple[int, mmap.mmap]:
    """A new anonymous shared-memory file of ``capacity`` bytes, mapped and paged in."""
    fd = os.memfd_create("rpcx-shm", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, capacity)
        # MAP_POPULATE: the kernel allocates every page up front, much cheaper than one
        # fault per 4 KiB page during the first copy.
        mapping = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    except BaseException:
        os.close(fd)
        raise
    return fd, mapping


class Segment:
    """One pooled shared-memory file, mapped here for writing."""

    __slots__ = ("capacity", "fd", "id", "mapping", "memory")

    def __init__(self, segment_id: int, capacity: int) -> None:
        self.id = segment_id
        self.capacity = capacity
        fd, self.mapping = _shared_file(capacity)
        # The descriptor travels to the peer with the first frame that uses the segment;
        # after that only the id does, and the descriptor is closed.
        self.fd: int | None = fd
        self.memory = torch.frombuffer(self.mapping, dtype=torch.uint8)

    def descriptor_sent(self) -> None:
        """The peer has its own descriptor now: close this side's."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        """Release the descriptor; the mapping goes with the last reference to it."""
        self.descriptor_sent()
        del self.memory


class SendPool:
    """The segments this worker fills for one peer.

    ``limit`` bounds the bytes pooled for the peer; past it, free segments that are too
    small are dropped to make room, and when busy ones fill it a tensor goes through a
    one-off segment instead (see :func:`one_off_copy`).
    """

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)  # notified by release()
        self._segments: dict[int, Segment] = {}
        self._free: list[Segment] = []
        self._bytes = 0
        self._next_id = ONE_OFF + 1
        self._limit = limit
        self._retired: list[int] = []  # dropped segments the peer should unmap

    def acquire(self, size: int) -> Segment | None:
        """A segment of at least ``size`` bytes, now busy; None if the pool is full."""
        with self._lock:
            fits = [s for s in self._free if s.capacity >= size]
            if fits:
                best = min(fits, key=lambda s: s.capacity)
                self._free.remove(best)
                return best
            capacity = -(-size // _GRANULE) * _GRANULE
            free_bytes = sum(s.capacity for s in self._free)
            if self._bytes - free_bytes + capacity > self._limit:
                return None  # busy segments fill the pool: dropping free ones won't help
            self._free.sort(key=lambda s: s.capacity)
            while self._bytes + capacity > self._limit:
                self._drop(self._free.pop(0))  # free but too small: smallest first
            segment = Segment(self._next_id, capacity)
            self._next_id += 1
            self._segments[segment.id] = segment
            self._bytes += capacity
            return segment

    def release(self, ids: list[int]) -> None:
        """The peer freed these segments (or a send using them failed): reuse them."""
        with self._lock:
            for segment_id in ids:
                segment = self._segments.get(segment_id)
                if segment is not None and segment not in self._free:
                    self._free.append(segment)
            self._released.notify_all()

    def busy(self) -> int:
        """How many pooled segments the peer still holds (filled, not yet freed)."""
        with self._lock:
            return len(self._segments) - len(self._free)

    def wait_busy_at_most(self, count: int, timeout: float) -> bool:
        """Wait until the peer holds at most ``count`` segments; False after ``timeout``."""
        with self._lock:
            return self._released.wait_for(
                lambda: len(self._segments) - len(self._free) <= count, timeout)

    def take_retired(self) -> list[int]:
        """Ids of segments dropped since the last call (the peer should unmap them)."""
        with self._lock:
            retired, self._retired = self._retired, []
        return retired

    def close(self) -> None:
        """Drop every segment."""
        with self._lock:
            for segment in list(self._segments.values()):
                self._drop(segment)
            self._free.clear()

    def _drop(self, segment: Segment) -> None:
        del self._segments[segment.id]
        self._bytes -= segment.capacity
        self._retired.append(segment.id)
        segment.close()


class ReceivedSegments:
    """The segments one peer fills for this worker, each mapped once.

    ``on_free(segment_id)`` is called, from whichever thread drops the last tensor over
    a pooled segment, when that memory may be filled again.
    """

    def __init__(self, on_free: Callable[[int], None]) -> None:
        self._mappings: dict[int, mmap.mmap] = {}
        self._on_free = on_free

    def tensor(self, segment_id: int, size: int, fd: int | None) -> torch.Tensor:
        """A ``uint8`` tensor over the first ``size`` bytes of a segment (no copy).

        ``fd`` comes with a segment's first use (the caller closes it afterwards).
        """
        if fd is not None:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
            if segment_id == ONE_OFF:  # the tensor owns the mapping; nothing to report
                return torch.frombuffer(mapping, dtype=torch.uint8, count=size)
            self._mappings[segment_id] = mapping
        view = memoryview(self._mappings[segment_id])[:size]
        weakref.finalize(view, self._on_free, segment_id)
        return torch.frombuffer(view, dtype=torch.uint8)

    def retire(self, ids: list[int]) -> None:
        """The peer dropped these segments: forget them (tensors over them keep theirs)."""
        for segment_id in ids:
            self._mappings.pop(segment_id, None)

    def close(self) -> None:
        """Forget the mappings; tensors still over them keep theirs alive."""
        self._mappings.clear()


def one_off_copy(tensor: torch.Tensor) -> int:
    """A new shared-memory file holding ``tensor``'s bytes, for a full pool; its descriptor."""
    fd, mapping = _shared_file(max(tensor.numel(), 1))
    with mapping:
        target = torch.frombuffer(mapping, dtype=torch.uint8, count=tensor.numel())
        target.copy_(tensor)
        # torch keeps a reference to the mapping, not a buffer export, so closing it
        # under a live tensor would succeed and leave the tensor over unmapped memory.
        del target
    return fd
