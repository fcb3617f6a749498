"""``RecentIds``: has this id been seen? For ids that mostly grow, over an endless stream.

The agent uses it to drop duplicated frames (a transport that delivers a frame twice, the
fault injector's ``duplicate``) before anything in them runs: a request whose (caller,
request id) was already served, a reply to a call already answered; and
:class:`rpcx._wire.auth.FrameGuard` to refuse replayed sequence numbers.
"""

from __future__ import annotations

import collections
import threading

__all__ = ["RecentIds"]


class RecentIds:
    """Remembers the last ``size`` ids added. With ``floor=True`` (ids that arrive in
    nearly increasing order, like one caller's requests) ids at or below the oldest one
    forgotten count as seen too; without, forgotten ids are unknown again.

    Thread-safe. ``add`` returns ``False`` for an id already seen.
    """

    __slots__ = ("_floor", "_keep_floor", "_lock", "_order", "_recent", "_size")

    def __init__(self, size: int = 4096, *, floor: bool = True) -> None:
        self._size = size
        self._keep_floor = floor
        self._recent: set[int] = set()
        self._order: collections.deque[int] = collections.deque()
        self._floor = 0  # every id <= this counts as seen
        self._lock = threading.Lock()

    def add(self, item: int) -> bool:
        """Record ``item``; ``False`` if it was seen (or is older than what is kept)."""
        with self._lock:
            if item <= self._floor or item in self._recent:
                return False
            self._recent.add(item)
            self._order.append(item)
            if len(self._order) > self._size:
                oldest = self._order.popleft()
                self._recent.discard(oldest)
                if self._keep_floor:
                    self._floor = max(self._floor, oldest)
            return True

    def __contains__(self, item: object) -> bool:
        with self._lock:
            return isinstance(item, int) and (item <= self._floor or item in self._recent)
