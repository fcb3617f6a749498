"""Context releases owed to peers: notes in frames sent anyway, acknowledged on demand.

When a distributed autograd context is released, every peer that took part in it must
forget it too. A training loop releases one context per step and, a moment later, calls
the same peers again for the next step; so the word rides as a note in that next frame
(``AUTOGRAD_FORGET``) instead of costing a request and its reply per peer per step (two
of the twelve frames of the RPC tutorial's RNN step, and four of the sixteen of the DDP +
RPC hybrid's). What no frame takes within :data:`LINGER` seconds a flusher thread sends
on its own, one way. A peer that forgets a context passes the word to its own peers the
same way.

One way means nobody hears back, and two things must:

* **Waiting for releases** (``dist_autograd._wait_released``, a graceful shutdown):
  :meth:`ReleaseNotes.flush_acknowledged` sends each peer that is owed releases, or was
  sent some since it last acknowledged, an ``AUTOGRAD_RELEASE`` request. Its handler
  forgets what the request carries, flushes its own peers the same way and answers when
  they have: frames between a pair arrive in order, so the answer covers every note sent
  before the request, down the whole tree of peers.
* **A peer lost before it passed the word on**: the ids sent to each peer since its last
  acknowledgement are kept (an acknowledgement is asked for every :data:`ACK_EVERY` of
  them, so the list stays short) and, when that peer is lost, told to every other worker
  (one that never had the context only remembers the id); so is anything owed to a peer
  already lost.

On a transport that may lose frames no notes ride, and what the flusher sends is an
acknowledged request, sent again until answered. One window is left: a note taken into a
frame counts as sent when the frame is encoded, so an acknowledgement asked for between
that frame's encoding and its write does not cover it (a reply encoded on a receiving
thread is written from the pool, a little later).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rpcx._core.service_host import CallLabel, ServiceHost
from rpcx.errors import RpcError
from rpcx.futures import RpcFuture, add_internal_callback
from rpcx.messages import MessageKind

__all__ = ["ACK_EVERY", "LINGER", "ReleaseNotes"]

log = logging.getLogger("rpcx.autograd")

LINGER = 0.01  # seconds a release waits for a frame to ride in before going alone
ACK_EVERY = 1024  # ids sent one way to a peer before an acknowledgement is asked for

_FORGET = int(MessageKind.AUTOGRAD_FORGET)


class ReleaseNotes:
    """The context releases one worker owes its peers, and those not yet acknowledged.

    Args:
        agent: the worker's agent (sends, the world, lost peers).
        describe: names a batch of context ids in messages (``"contexts [..]"``).
    """

    def __init__(self, agent: ServiceHost,
                 describe: Callable[[Any], str] = lambda ids: f"contexts {ids}") -> None:
        self._agent = agent
        self._describe = describe
        self._lock = threading.Lock()
        self._owed: dict[int, list[int]] = {}  # peer -> ids not sent to it yet
        self._owed_since: dict[int, float] = {}  # peer -> when its oldest owed id came
        self._unacked: dict[int, list[int]] = {}  # peer -> ids sent one way since its ack
        self._asking: dict[int, list[int]] = {}  # peer -> ids an ack request covers now
        self._in_flight: set[RpcFuture[Any]] = set()  # acknowledged requests out
        # One sender at a time of what the flusher and the acknowledgements take: an
        # acknowledgement asked for must not overtake a one-way release taken before it.
        self._send_lock = threading.RLock()
        self._lost: set[int] = set()  # peers gone: what they are owed goes to the others
        self._wake: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._due = False  # the flusher will look soon
        self._closed = False
        self._flusher = threading.Thread(target=self._flush_loop,
                                         name=f"rpcx-{agent.name}-releases", daemon=True)
        self._flusher.start()

    # -------------------------------------------------------------- owing releases

    def owe(self, ranks: list[int], context_id: int) -> None:
        """Tell each of ``ranks`` to forget ``context_id``: in its next frame, or soon."""
        if not ranks or self._closed:
            return
        if self._lost.intersection(ranks):  # a peer lost since the caller looked
            ranks = self._others(self._lost)
        now = time.monotonic()
        with self._lock:
            for rank in ranks:
                if rank not in self._owed:
                    self._owed[rank] = []
                    self._owed_since[rank] = now
                self._owed[rank].append(context_id)
        self._schedule()

    def notes_for(self, dst: int) -> list[tuple[int, Any]]:
        """The releases owed to ``dst``, as a note for a frame about to be sent to it."""
        if not self._owed:
            return []
        with self._lock:
            ids = self._owed.pop(dst, None)
            if not ids:
                return []
            del self._owed_since[dst]
            self._sent_locked(dst, ids)
        return [(_FORGET, ids)]

    def notes_not_sent(self, dst: int, notes: list[tuple[int, Any]]) -> None:
        """Take back releases from :meth:`notes_for` whose frame was never sent."""
        with self._lock:
            for kind, ids in notes:
                if kind == _FORGET:
                    self._owed.setdefault(dst, []).extend(ids)
                    self._owed_since.setdefault(dst, time.monotonic())
                    taken = set(ids)
                    unacked = self._unacked.get(dst, [])
                    self._unacked[dst] = [i for i in unacked if i not in taken]
        self._schedule()

    def _sent_locked(self, dst: int, ids: list[int]) -> None:
        unacked = self._unacked.setdefault(dst, [])
        unacked.extend(ids)
        if len(unacked) >= ACK_EVERY:
            self._schedule()  # the flusher asks for an acknowledgement

    def in_flight(self) -> list[RpcFuture[Any]]:
        """The acknowledged releases not answered yet."""
        with self._lock:
            return list(self._in_flight)

    def pending(self) -> int:
        """Releases not yet sent, plus acknowledgement requests not yet answered."""
        with self._lock:
            owed = sum(len(ids) for ids in self._owed.values())
            flights = list(self._in_flight)
        return owed + sum(1 for future in flights if not future.done())

    # ------------------------------------------------------------------- flushing

    def _schedule(self) -> None:
        if not self._due and not self._closed:
            self._due = True
            self._wake.put(True)

    def _flush_loop(self) -> None:
        while self._wake.get():
            time.sleep(LINGER)  # let frames about to leave carry the releases
            self._due = False  # before taking: a later release wakes the loop again
            try:
                self._flush_one_way()
            except Exception:
                log.exception("%s: sending context releases failed", self._agent.name)

    def _flush_one_way(self) -> None:
        """Send what no frame took within :data:`LINGER`, one way (a release owed for
        less time is left for the next look); ask peers owed many ids to acknowledge.
        On a transport that may lose frames, each batch is an acknowledged request
        instead, so that waiting for releases waits for the ones lost and sent again."""
        with self._send_lock:
            self._flush_one_way_locked()

    def _flush_one_way_locked(self) -> None:
        ripe = time.monotonic() - LINGER
        with self._lock:
            owed = {dst: self._owed.pop(dst) for dst, since in list(self._owed_since.items())
                    if since <= ripe}
            lossy = self._agent.lossy
            for dst in owed:
                del self._owed_since[dst]
                if not lossy:
                    self._sent_locked(dst, owed[dst])
            if self._owed:
                self._schedule()
            due = [dst for dst, ids in self._unacked.items() if len(ids) >= ACK_EVERY]
        for dst, ids in owed.items():
            if lossy:
                self._ask(dst, ids)
                continue
            self._agent.send_one_way(self._agent.workers[dst], MessageKind.AUTOGRAD_FORGET,
                                     ids)
        for dst in due:
            self._ask(dst, [])

    def flush_acknowledged(self) -> list[RpcFuture[Any]]:
        """Send every peer owed releases, or sent some since it last acknowledged, an
        ``AUTOGRAD_RELEASE`` request carrying what it is owed; the futures of their
        answers (each answer covers every release sent to that peer before it, and
        everything that peer passed on)."""
        with self._send_lock:
            with self._lock:
                owed, self._owed = self._owed, {}
                self._owed_since.clear()
                peers = sorted(owed.keys() | {d for d, ids in self._unacked.items() if ids})
            return [future for dst in peers
                    if (future := self._ask(dst, owed.get(dst, []))) is not None]

    def _ask(self, dst: int, ids: list[int]) -> RpcFuture[Any] | None:
        """An acknowledged release of ``ids`` (and of every id sent ``dst`` before)."""
        with self._send_lock:  # (reentrant: the flusher and flush_acknowledged hold it)
            return self._ask_locked(dst, ids)

    def _ask_locked(self, dst: int, ids: list[int]) -> RpcFuture[Any] | None:
        agent = self._agent
        with self._lock:
            covered = self._unacked.pop(dst, []) + ids
            self._asking.setdefault(dst, []).extend(covered)
        try:
            future = agent.request(
                agent.workers[dst], MessageKind.AUTOGRAD_RELEASE, ids,
                timeout=agent.timeout_for(None),
                label=CallLabel("dist_autograd.release", ids, self._describe),
            )
        except RpcError as exc:
            log.debug("%s: release of %s not sent to %s: %s", agent.name,
                      self._describe(ids), agent.workers[dst].name, exc)
            self._answered(dst, covered, failed=True)
            return None
        with self._lock:
            self._in_flight.add(future)
        add_internal_callback(future, lambda done: self._on_answer(done, dst, covered))
        return future

    def _on_answer(self, done: torch.futures.Future[Any], dst: int, covered: list[int]
                   ) -> None:
        # An internal callback (never blocks, never sends: a broadcast goes to the lane).
        try:
            done.value()
            failed = False
        except Exception as exc:
            failed = True
            log.debug("%s: release to %s not acknowledged: %s", self._agent.name,
                      self._agent.workers[dst].name, exc)
        with self._lock:
            self._in_flight.discard(done)
        self._answered(dst, covered, failed)

    def _answered(self, dst: int, covered: list[int], failed: bool) -> None:
        with self._lock:
            asking = self._asking.get(dst, [])
            done = set(covered)
            self._asking[dst] = [i for i in asking if i not in done]
            if not self._asking[dst]:
                del self._asking[dst]
        if failed and covered and self._agent.is_running:
            # The peer may not have passed them on: tell everyone else.
            self._agent.call_soon(self._broadcast, covered, dst)

    # ---------------------------------------------------------------- lost peers

    def on_peer_lost(self, rank: int) -> None:
        """``rank`` is gone: whatever it was told and may not have passed on goes to
        every other live worker."""
        with self._lock:
            self._lost.add(rank)
            ids = (self._owed.pop(rank, []) + self._unacked.pop(rank, [])
                   + self._asking.pop(rank, []))
            self._owed_since.pop(rank, None)
        if ids:
            self._broadcast(ids, rank)

    def rank_reused(self, rank: int) -> None:
        """A new worker took ``rank`` (a dynamic world): it is owed releases of the
        contexts it takes part in, like any other peer."""
        with self._lock:
            self._lost.discard(rank)

    def _others(self, lost: set[int]) -> list[int]:
        agent = self._agent
        return [r for r in range(agent.world_size)
                if r != agent.rank and r not in lost and not agent.is_lost(r)]

    def _broadcast(self, ids: list[int], lost: int) -> None:
        others = self._others({lost})
        for context_id in dict.fromkeys(ids):
            self.owe(others, context_id)

    def close(self) -> None:
        """Stop the flusher (the worker closed: nothing more is sent)."""
        self._closed = True
        self._wake.put(False)
