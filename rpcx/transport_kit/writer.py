"""A per-peer writer thread, so that ``send`` honours ``Frame.deadline``.

A peer that stops reading fills its connection; a ``send`` that then waits for room
would hold a call past its timeout, and the peer's lock (so every other sender to it)
with it. The rule every transport follows instead: write what the connection takes at
once, *never waiting*, and queue the rest on the peer's :class:`Backlog`, whose writer
thread writes it in order as the peer reads. Later frames to the peer queue behind it
while anything is queued (per-peer order). The sender waits for its queued frame
(:meth:`Pending.wait`) until its ``frame.deadline`` at most, without the lock: the
agent fails the call on time, and the frame still goes if the peer reads again.

How a transport uses it, under its per-peer lock::

    with link.lock:
        if not link.backlog and write_now(...) left nothing:   # the common case
            return
        pending = link.backlog.put(rest_of_the_frame)   # copies, or views + detach()
    pending.wait(frame.deadline)

Small frames may pass a large one (``put(job, overtake=True)``): a transport that writes
a large frame in pieces (its ``write`` returning ``False`` at a boundary between two)
lets a small frame sent meanwhile go between them, so a call beside a bulk transfer
waits for one piece, not for the whole transfer. Per-peer order still holds as the
transport contract states it: a frame passes only a frame whose sender is still waiting
for it (``job.passable``), so no ``send`` that returned is overtaken by a later one.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rpcx.transport_kit.sentences import lost_error

__all__ = ["Backlog", "Pending"]

log = logging.getLogger("rpcx.transport_kit")

# A sender waiting for its queued frame looks this often whether its call is over
# already (``Frame.settled``): a silent peer's calls fail at once, and their senders
# leave within this.
SETTLED_LOOK_S = 0.1


class Pending:
    """One queued job: what the writer writes, and whether it was (``done``, ``error``).

    ``job`` is the transport's own (whatever its ``write`` takes). It must hold nothing
    the sender may change after ``send`` returns: bytes, copies, descriptors of its own;
    or it has a ``detach()`` method, called when the sender stops waiting before the
    job was written, which makes it so (copies what is left: the sender's buffers are
    then the writer's to read only until that returns). A job with a ``release()``
    method has it called once, when done with (written or failed): close its
    descriptors there.
    """

    __slots__ = ("done", "error", "job")

    def __init__(self, job: Any) -> None:
        self.job = job
        self.done = threading.Event()
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        """Written (or never to be: ``error``)."""
        job, self.job = self.job, None
        release = getattr(job, "release", None)
        if release is not None:
            release()
        self.error = error
        self.done.set()

    def _detach(self) -> None:
        detach = getattr(self.job, "detach", None)  # (None once finished)
        if detach is not None:
            detach()

    def wait(self, deadline: float = 0.0, settled: Callable[[], bool] | None = None) -> bool:
        """Wait until written, or until ``deadline`` (a ``time.monotonic()`` value; 0:
        none) or ``settled()`` (``Frame.settled``, looked at every ``SETTLED_LOOK_S``).
        ``False`` if one of those came first (the writer still writes it later);
        ``PeerLostError`` if it will never be written."""
        left = None if not deadline else max(0.0, deadline - time.monotonic())
        try:
            if settled is None:
                written = self.done.wait(left)
            else:
                while not (written := self.done.wait(
                        SETTLED_LOOK_S if left is None else min(left, SETTLED_LOOK_S))):
                    if settled():
                        break
                    if deadline:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
        except BaseException:  # (interrupted: the sender leaves all the same)
            self._detach()
            raise
        if not written:
            self._detach()
            return False
        if self.error is not None:
            raise lost_error(self.error)
        return True


class Backlog:
    """The jobs a peer's connection did not take at once, written in order by one
    writer thread (started the first time a job is queued).

    Args:
        lock: the peer's send lock; :meth:`put` and ``bool(backlog)`` are called under it.
        write: writes one job, waiting for the peer as long as it takes (called on the
            writer thread, without the lock). Raises when the connection broke. It may
            return ``False`` at a boundary in a job written in pieces, where frames
            queued to overtake it (:attr:`overtaking`) go before it is called again.
        name: the writer thread's name.
        on_error: called, under ``lock``, when ``write`` raised: end the connection
            (every queued job fails with the same error).
        after: called on the writer thread after each job written (optional).
    """

    __slots__ = ("_after", "_failed", "_held", "_jobs", "_on_error", "_passing", "_running",
                 "_stopping", "_thread", "_wakeup", "_write", "lock", "name")

    def __init__(self, lock: threading.Lock, write: Callable[[Any], bool | None], name: str,
                 on_error: Callable[[BaseException], None] | None = None,
                 after: Callable[[], None] | None = None) -> None:
        self.lock = lock
        self.name = name
        self._write = write  # (False: stopped at a boundary between two pieces)
        self._on_error = on_error
        self._after = after
        self._jobs: collections.deque[Pending] = collections.deque()
        # Small jobs put to overtake the first job while its sender waits for it: the
        # writer writes them at its next boundary (in order among themselves).
        self._passing: collections.deque[Pending] = collections.deque()
        self._wakeup = threading.Condition(lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failed: BaseException | None = None  # why a write failed: the end
        self._running = False  # a writer thread serves the queue (set under lock)
        self._held = False  # queue, write nothing (a connection being made): hold()

    def __bool__(self) -> bool:
        """Whether later frames must queue: jobs are queued, or the queue is held."""
        return self._held or bool(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    @property
    def writer(self) -> threading.Thread | None:
        """The writer thread last started (``None`` before the first queued job)."""
        return self._thread

    @property
    def overtaking(self) -> int:
        """How many jobs wait to overtake the one being written (a racy read is fine:
        the writer looks again under the lock)."""
        return len(self._passing)

    def put(self, job: Any, overtake: bool = False) -> Pending:
        """Queue ``job`` behind the others (call under ``lock``). Once a write failed,
        the job fails at once with that error (the connection is over); a writer that
        ended after :meth:`stop` is started again.

        ``overtake``: ``job`` is small and may go ahead of the job being written, if
        that is the only one queued and its sender still waits for it (its
        ``passable`` is true: a large frame written in pieces). Otherwise it queues
        as any other."""
        pending = Pending(job)
        if self._failed is not None:
            pending.finish(self._failed)
            return pending
        # (Checked as the job is put: a job whose sender stopped waiting since is
        # still overtaken by those put before then, which began before it returned.)
        if overtake and self._running and len(self._jobs) == 1 and getattr(
                self._jobs[0].job, "passable", False):
            self._passing.append(pending)
            return pending
        self._jobs.append(pending)
        if not self._running and not self._held:
            self._start_writer()
        self._wakeup.notify()
        return pending

    @property
    def running(self) -> bool:
        """Whether a writer thread serves the queue now."""
        return self._running

    @property
    def held(self) -> bool:
        """Whether the queue is held (:meth:`hold`): nothing queued is written yet."""
        return self._held

    def hold(self) -> None:
        """Queue what is put from now on and write none of it (the peer's connection is
        being made) until :meth:`release` (call under ``lock``)."""
        self._held = True

    def release(self, write_now: Callable[[Any], bool]) -> None:
        """Stop holding (call under ``lock``): write the queued jobs on this thread, in
        order, while ``write_now(job)`` writes a whole job without waiting (``True``);
        the writer thread takes the rest. A ``write_now`` that raises fails them all
        and calls ``on_error``, as a writer's failed write does. (``after`` is not
        called for these: a backlog that is held has none.)"""
        assert self._after is None, "a held backlog has no after-write callback"
        if not self._held or self._failed is not None:  # (released, or failed: done)
            self._held = False
            return
        self._held = False
        while self._jobs:
            pending = self._jobs[0]
            try:
                written = write_now(pending.job)
            except BaseException as exc:
                for each in self._broken(exc):
                    each.finish(exc)
                return
            if not written:
                self._start_writer()
                return
            self._jobs.popleft()
            pending.finish()

    def fail(self, error: BaseException) -> None:
        """The connection is over, before any writer ran (a held backlog whose
        connection never came; call under ``lock``): every queued job fails with
        ``error``, and so does any put later. (Once a writer runs, end the connection
        instead: its failed write fails the queue.)"""
        assert not self._running, "fail() is for a backlog no writer serves"
        for each in self._take_all(error):
            each.finish(error)

    def _take_all(self, error: BaseException) -> list[Pending]:
        """(Under ``lock``.) The end: later puts fail with ``error``; returns the
        queued jobs, for the caller to fail."""
        self._held = False
        self._failed = error
        failed = [*self._passing, *self._jobs]
        self._passing.clear()
        self._jobs.clear()
        return failed

    def _broken(self, error: BaseException) -> list[Pending]:
        """(Under ``lock``.) A write failed: :meth:`_take_all`, then ``on_error`` (end
        the connection)."""
        failed = self._take_all(error)
        if self._on_error is not None:
            try:
                self._on_error(error)
            except Exception:
                log.exception("%s: ending the connection failed", self.name)
        return failed

    def _start_writer(self) -> None:
        self._running = True
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        try:
            self._thread.start()
        except BaseException:  # (a crowded host: a later put tries again)
            self._running = False
            raise

    def _write_overtaking(self, first: Pending | None, most: int = -1) -> None:
        """Write the jobs waiting to overtake: at a boundary, the ``most`` waiting when
        it was reached (a stream of small calls must not hold a large frame back for
        good); with ``first`` (the job just written) every one, then take that off the
        queue, under the lock once none are left, so no job put to overtake it is
        stranded."""
        while most:
            most -= 1
            with self.lock:
                if not self._passing:
                    if first is not None:
                        self._jobs.popleft()
                    return
                passing = self._passing[0]
            while self._write(passing.job) is False:  # (a small job has no boundary)
                pass
            with self.lock:
                self._passing.popleft()
            passing.finish()

    def stop(self) -> None:
        """Let the writer end once nothing is queued (at close). A writer blocked on a
        peer that reads nothing ends when the connection is shut down."""
        with self.lock:
            self._stopping = True
            self._wakeup.notify_all()

    def join(self, timeout: float) -> None:
        """Wait for the writer thread to end, at most ``timeout`` seconds."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, timeout))

    def _run(self) -> None:
        """Write the queued jobs in order. A job stays first in the queue until written,
        so no sender writes past it (only those put to overtake it, at its boundaries
        and before it is done with); a failed write fails every queued job."""
        while True:
            with self.lock:
                while not self._jobs and not self._stopping:
                    self._wakeup.wait()
                if not self._jobs:
                    self._running = False  # (a later put starts another)
                    return
                pending = self._jobs[0]
            try:
                while self._write(pending.job) is False:  # (a boundary)
                    self._write_overtaking(None, self.overtaking)
                self._write_overtaking(pending)
            except BaseException as exc:
                with self.lock:
                    self._running = False
                    failed = self._broken(exc)
                for each in failed:
                    each.finish(exc)
                return
            pending.finish()
            if self._after is not None:
                try:
                    self._after()
                except Exception:  # the writer must outlive it
                    log.exception("%s: after a frame", self.name)
