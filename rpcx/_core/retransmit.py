"""Bookkeeping that survives a transport that loses frames.

rpcx's built-in transports are reliable per pair (TCP, gloo's pairs, shared memory): a
frame arrives once, in order, or the peer is reported lost. A transport that declares
``Capabilities.lossy`` (the fault injector, ``backend="faulty:<name>"``, or a datagram
plugin) may drop or duplicate frames. On such a transport the agent makes rpcx's own
bookkeeping reliable, with this module:

* every bookkeeping request (:data:`RETRIED_KINDS`) is sent again, with growing pauses,
  until its reply comes or its timeout ends;
* bookkeeping that is one-way on a reliable transport (:data:`ACKED_KINDS`) is sent as a
  request, so that it is acknowledged and sent again too;
* the callee serves each (caller, request id) once: a copy of a request already answered
  gets the same answer again (:class:`ReplyCache`), a copy of one still running gets
  nothing (the answer is on its way). Fetches too: serving one again would pickle the
  value anew, forking every RRef inside it for a reply the caller then drops unread as
  a duplicate, and those forks would never be released.

User calls are not retried: a function runs at most once, and a call whose request or
reply is lost fails with its timeout, as on a network that drops a connection. Nothing
here runs on a reliable transport.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable

from rpcx._util.timer import DeadlineTimer
from rpcx.messages import MessageKind
from rpcx.transport import Frame

__all__ = ["ACKED_KINDS", "RETRIED_KINDS", "NoRetransmission", "ReplyCache", "Resender",
           "Retransmission"]

# Requests sent again until answered, and one-way messages sent as such requests.
ACKED_KINDS = frozenset({
    MessageKind.RREF_DELETE, MessageKind.RREF_CONFIRM,
    MessageKind.AUTOGRAD_CHAIN, MessageKind.AUTOGRAD_CHAIN_END, MessageKind.AUTOGRAD_FORGET,
})
RETRIED_KINDS = ACKED_KINDS | {
    MessageKind.RREF_FETCH, MessageKind.RREF_FORKS, MessageKind.AUTOGRAD_BACKWARD,
    MessageKind.AUTOGRAD_RELEASE, MessageKind.AUTOGRAD_RUN,
}

FIRST_PAUSE = 0.05  # seconds before the first copy; doubled after each, up to LAST_PAUSE
LAST_PAUSE = 1.0
_REPLIES_KEPT = 1024  # answers remembered per caller


class Resender:
    """Sends a request again, with growing pauses, until ``is_pending(rid)`` is false.

    ``send(dst, frame)`` is called from the timer's thread and must not block: the agent
    passes one that hands the send to its request pool.
    """

    def __init__(self, name: str, send: Callable[[int, Frame], None],
                 is_pending: Callable[[int], bool], on_thread_start: Callable[[], None]) -> None:
        self._send = send
        self._is_pending = is_pending
        self._lock = threading.Lock()
        self._waiting: dict[int, tuple[int, Frame, float]] = {}  # rid -> dst, frame, pause
        self._timer = DeadlineTimer(f"{name}-resend", self._due, self._is_waiting,
                                    on_thread_start)
        self.resent = 0  # copies sent, for debug_info()

    def track(self, rid: int, dst: int, frame: Frame) -> None:
        """Send ``frame`` (request ``rid`` to ``dst``) again if no reply comes soon."""
        kept = frame.shallow_copy()
        # Not the frame's own settled (the caller's future.done): the record outlives the
        # call by up to a pause, and the future would keep the call's result alive with
        # it (an RRef in it: its owner kept the value past the caller's flush()).
        kept.settled = functools.partial(self._settled, rid)
        with self._lock:
            self._waiting[rid] = (dst, kept, FIRST_PAUSE)
        self._timer.schedule(time.monotonic() + FIRST_PAUSE, rid)

    def _settled(self, rid: int) -> bool:
        """Whether request ``rid`` is over (a copy being written may stop waiting)."""
        return not self._is_pending(rid)

    def _is_waiting(self, rid: int) -> bool:
        with self._lock:
            return rid in self._waiting

    def _due(self, rid: int) -> None:
        with self._lock:
            entry = self._waiting.pop(rid, None)
            if entry is None or not self._is_pending(rid):
                return
            dst, frame, pause = entry
            pause = min(pause * 2, LAST_PAUSE)
            self._waiting[rid] = (dst, frame, pause)
            self.resent += 1
        self._send(dst, frame.shallow_copy())
        self._timer.schedule(time.monotonic() + pause, rid)

    def close(self, timeout: float) -> None:
        """Stop sending copies."""
        with self._lock:
            self._waiting.clear()
        self._timer.close(timeout)


class ReplyCache:
    """The callee's side: each caller's recent bookkeeping requests and their answers."""

    def __init__(self, world_size: int) -> None:
        self._lock = threading.Lock()
        # caller rank -> request id -> the reply sent, or None while it runs.
        self._replies: list[collections.OrderedDict[int, Frame | None]] = [
            collections.OrderedDict() for _ in range(world_size)
        ]

    def grow(self, size: int) -> None:
        """Room for callers of ``size`` ranks (a worker joined a dynamic world)."""
        with self._lock:
            self._replies.extend(collections.OrderedDict()
                                 for _ in range(size - len(self._replies)))

    def running(self, src: int, rid: int) -> None:
        """Request ``rid`` from ``src`` is served now; its reply will be kept."""
        with self._lock:
            replies = self._replies[src]
            replies[rid] = None
            if len(replies) > _REPLIES_KEPT:
                replies.popitem(last=False)

    def answered(self, src: int, rid: int, frame: Frame) -> None:
        """Keep the reply to ``rid`` if it is a request :meth:`running` was told of."""
        with self._lock:
            replies = self._replies[src]
            if rid in replies:
                replies[rid] = frame.shallow_copy()

    def reply_to_copy(self, src: int, rid: int) -> Frame | None:
        """The answer for a copy of request ``rid`` from ``src``: the kept reply, or
        ``None`` (still running, or not kept: the copy is dropped)."""
        with self._lock:
            frame = self._replies[src].get(rid)
        return None if frame is None else frame.shallow_copy()

    def forget(self, src: int) -> None:
        """``src`` is gone: drop what was kept for it."""
        with self._lock:
            self._replies[src].clear()


class NoRetransmission:
    """The call path's policy on a reliable transport: nothing is kept or sent again.

    :class:`Retransmission` is the one for lossy transports; the call path calls the
    same methods on either, so its hot path has no branch for the lossy case.
    """

    lossy = False

    @property
    def resent(self) -> int:
        """Copies of requests sent again so far."""
        return 0

    @staticmethod
    def acknowledges(kind: int) -> bool:
        """Whether a one-way message of ``kind`` goes as an acknowledged request: no."""
        return False

    def sent(self, kind: int, rid: int, dst: int, frame: Frame) -> None:
        """Request ``rid`` is being sent."""

    def received(self, src: int, kind: int, rid: int) -> None:
        """Request ``rid`` from ``src`` arrived for the first time."""

    def copy_received(self, src: int, rid: int) -> None:
        """A copy of request ``rid`` from ``src`` arrived (a duplicating transport)."""

    def answered(self, src: int, rid: int, frame: Frame) -> None:
        """The reply to ``src``'s request ``rid`` is being sent."""

    def forget(self, rank: int) -> None:
        """Worker ``rank`` is gone."""

    def grow(self, size: int) -> None:
        """The roster grew to ``size`` ranks (a worker joined a dynamic world)."""

    def close(self, timeout: float) -> None:
        """The worker closes."""


class Retransmission(NoRetransmission):
    """Both ends of a worker's bookkeeping on a lossy transport: what the call path calls.

    ``send_copy(dst, frame)`` sends a spare copy without waiting (the agent hands it to
    its request pool).
    """

    lossy = True

    def __init__(self, name: str, world_size: int, send_copy: Callable[[int, Frame], None],
                 is_pending: Callable[[int], bool], on_thread_start: Callable[[], None]) -> None:
        self._send_copy = send_copy
        self._resender = Resender(name, send_copy, is_pending, on_thread_start)
        self._replies = ReplyCache(world_size)

    @property
    def resent(self) -> int:
        """Copies of requests sent again so far."""
        return self._resender.resent

    @staticmethod
    def acknowledges(kind: int) -> bool:
        """Whether a one-way message of ``kind`` goes as an acknowledged request."""
        return kind in ACKED_KINDS

    def sent(self, kind: int, rid: int, dst: int, frame: Frame) -> None:
        """Request ``rid`` is being sent: send it again until answered, if bookkeeping."""
        if kind in RETRIED_KINDS:
            self._resender.track(rid, dst, frame)

    def received(self, src: int, kind: int, rid: int) -> None:
        """Request ``rid`` from ``src`` arrived for the first time: keep its answer."""
        if kind in RETRIED_KINDS:
            self._replies.running(src, rid)

    def copy_received(self, src: int, rid: int) -> None:
        """A copy of request ``rid`` from ``src`` arrived: send the kept answer again, if
        there is one (none yet: the request still runs, and its answer will come)."""
        reply = self._replies.reply_to_copy(src, rid)
        if reply is not None:
            self._send_copy(src, reply)

    def answered(self, src: int, rid: int, frame: Frame) -> None:
        """The reply to ``src``'s request ``rid`` is being sent (kept if bookkeeping)."""
        self._replies.answered(src, rid, frame)

    def forget(self, rank: int) -> None:
        """Worker ``rank`` is gone."""
        self._replies.forget(rank)

    def grow(self, size: int) -> None:
        """Room for callers of ``size`` ranks."""
        self._replies.grow(size)

    def close(self, timeout: float) -> None:
        """Stop sending copies."""
        self._resender.close(timeout)
