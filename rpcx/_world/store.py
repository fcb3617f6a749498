"""The rendezvous store, with a deadline on every operation that rpcx enforces itself.

A ``torch.distributed`` store call can block for good, and no timeout of the store's own
prevents it: ``FileStore`` takes an ``flock`` with no timeout, so a worker stopped
(``SIGSTOP``, a debugger, a swapped-out process) while it holds the lock wedges every
other worker's store calls; a ``TCPStore`` client waits for a host process that stopped
as long as its socket timeout, which rpcx sets to days for the store of a world without a
join timeout. A thread blocked in such a call cannot be interrupted either (the C++ call
retries on ``EINTR``, so even pytest-timeout's signal cannot end it).

So the thread that waits never makes the call. Each operation is handed to the store's
own *caller* thread, and the waiting thread gives up at its deadline with an error that
names the store and the operation. An operation given up on finishes (or not) in the
background; the ones queued behind it run in order once it does, and those whose callers
have given up meanwhile are skipped, so a wedged store holds one thread, not one per try.

Waiting for keys polls :meth:`BoundedStore.check` instead of calling the store's
``wait``: a ``TCPStore`` wait that times out prints two c10d warning lines, and waits in
slices (to notice dead peers between them) printed hundreds in a large world's start-up.

A ``TCPStore`` client's connection can break while the world lives on: a partition
between the hosts outlasted by the workers (the store's host closes the connection it
took for dead; the client's next call fails, "Failed to recv, got 0 bytes"). A store
given ``reopen`` (a client of rank 0's store) then connects again and makes the call
again, once, where making it twice is harmless (everything but ``add``). A call that
went out during the cut may also just wait: TCP sends it again only when its backed-off
retransmission timer fires, seconds after the link is back. So a call unanswered for
:data:`STUCK_S` on a connection that TCP is retransmitting on (``stalled()``: a store
host that is only slow, on a starved machine, is left alone) gets a new connection too
(made on its own thread, and only if the store's address takes one), where it is made
again; the old connection's thread is left to its fate.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.distributed import DistNetworkError
from torch.distributed.distributed_c10d import PrefixStore

from rpcx.errors import RpcError, RpcTimeoutError

if TYPE_CHECKING:
    from rpcx._wire.auth import ValueSeal

__all__ = ["BoundedStore"]

log = logging.getLogger("rpcx.rendezvous")

# Without a deadline of the caller's, one operation may take this long: longer means the
# store is wedged (a live store answers in milliseconds), and the wait fails saying so.
OPERATION_BOUND = 30.0
_IDLE_EXIT = 2.0  # the caller thread ends after this long with nothing to do
# Polling for keys: the first look at once, then at growing intervals up to _POLL_MAX,
# and up to _POLL_MAX per _KEYS_PER_PAUSE keys waited for: every worker of a world polls
# the one store, so a large world polls less often (64 workers at 20 ms each kept a
# 2-core host's store busy enough to starve the workers themselves).
_POLL_FIRST, _POLL_MAX = 0.0005, 0.02
_KEYS_PER_PAUSE = 16
_LOOK_MIN = 0.02  # what a look for keys may take past the deadline (see wait_for)
_NARROW_MAX = 1.0  # what finding the missing keys one by one may take past the deadline
# A call unanswered this long, on a store that can connect again, gets a new connection
# (see the module's notes): a live store answers in milliseconds, a busy one in a second.
STUCK_S = 3.0
_LOOK_S = 0.25  # how often a waiting thread looks whether that happened


class _Operation:
    """One store call, its outcome, and whether its caller still waits for it."""

    __slots__ = ("args", "call", "done", "error", "given_up", "result")

    def __init__(self, call: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.call, self.args = call, args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.given_up = False


class _Caller:
    """The thread that makes one store connection's calls, one after another.

    Started on demand and ended when idle, so a closed world leaves no thread behind.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._queue: collections.deque[_Operation] = collections.deque()
        self._running = False

    def submit(self, operation: _Operation) -> None:
        with self._lock:
            self._queue.append(operation)
            if self._running:
                self._ready.notify()
                return
            self._running = True
        threading.Thread(target=self._loop, name=self.name, daemon=True).start()

    def give_up(self, operation: _Operation) -> bool:
        """Mark ``operation`` abandoned; False if it completed meanwhile."""
        with self._lock:
            if operation.done.is_set():
                return False
            operation.given_up = True
            return True

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._ready.wait(_IDLE_EXIT)
                if not self._queue:
                    self._running = False
                    return
                operation = self._queue.popleft()
                if operation.given_up:
                    continue
            try:
                operation.result = operation.call(*operation.args)
            except BaseException as exc:  # handed to the waiting thread
                operation.error = exc
            with self._lock:
                operation.done.set()
            # Hold nothing while idle: the call is bound to the store, and the last
            # reference to a TCPStore's host must go when the world drops it.
            del operation


class _Connection:
    """The store connection a store and its views share, the thread that makes its
    calls, and how to make it again."""

    def __init__(self, raw: Any, reopen: Callable[[], Any] | None, caller: _Caller,
                 stalled: Callable[[], bool] = lambda: False) -> None:
        self.raw = raw
        self.reopen = reopen
        self.stalled = stalled
        self.caller = caller
        self.generation = 0  # connections made again so far
        self._lock = threading.Lock()
        self._replacing = False

    def replace(self, broken: int, why: str, where: str) -> bool:
        """Connect again, ``why``, if connection number ``broken`` is still the one in
        use (a view that saw the same break finds it replaced already); later calls go to
        a caller thread of the new connection. Whether there is a new connection."""
        if self.reopen is None:
            return False
        with self._lock:
            if self.generation != broken:
                return True
            self.raw = self.reopen()  # (raises where the store cannot be reached)
            self.caller = _Caller(self.caller.name)
            self.generation += 1
        log.info("the rendezvous store connection to %s %s; connected again", where, why)
        return True

    def replace_if_stuck(self, stuck: int, where: str) -> None:
        """A call on connection number ``stuck`` is unanswered for STUCK_S: connect
        again on a thread of its own (at most one at a time; a store that cannot be
        reached leaves the old connection as it is)."""
        with self._lock:
            if self._replacing or self.reopen is None or self.generation != stuck:
                return
            self._replacing = True
        if not self._stalled():
            with self._lock:
                self._replacing = False
            return

        def connect() -> None:
            try:
                self.replace(stuck, f"left a call unanswered for {STUCK_S:g} s", where)
            except Exception as exc:  # still cut off: the calls wait on (or time out)
                log.debug("the rendezvous store at %s: no new connection: %s", where,
                          _first_line(exc))
            finally:
                with self._lock:
                    self._replacing = False

        threading.Thread(target=connect, name="rpcx-store-reconnect", daemon=True).start()

    def _stalled(self) -> bool:
        try:
            return self.stalled()
        except Exception as exc:  # (no way to tell: leave the connection as it is)
            log.debug("whether the store connection stalls: %s", exc)
            return False


class BoundedStore:
    """A rendezvous store whose every operation returns or fails by a deadline.

    ``raw`` is the ``torch.distributed`` store itself, for what must be handed a real
    one (a transport's address exchange, gloo's process group). ``where`` names the
    store in errors (``file:///tmp/x``, ``tcp://10.0.0.1:29500``). Timeouts are seconds;
    ``None`` means :data:`OPERATION_BOUND`. ``reopen``: makes the store's connection
    again when it breaks; ``stalled()``: whether TCP is retransmitting on it now (see the
    module's notes).
    """

    def __init__(self, raw: Any, where: str, *, reopen: Callable[[], Any] | None = None,
                 stalled: Callable[[], bool] = lambda: False,
                 _connection: _Connection | None = None,
                 _prefixes: tuple[str, ...] = (), _seal: ValueSeal | None = None) -> None:
        self._connection = _connection or _Connection(raw, reopen, _Caller("rpcx-store"),
                                                      stalled)
        self._prefixes = _prefixes  # each view's prefix, outermost first
        self._raw = raw
        self._generation = self._connection.generation
        self.where = where
        self._prefix = "".join(f"{p}/" for p in _prefixes)
        # The world key's seal for the values that steer a keyed world (rpcx._world.sealed
        # uses it); plain set and get never seal.
        self.seal = _seal

    @property
    def raw(self) -> Any:
        """The torch store this view reads and writes (over the connection of now)."""
        connection = self._connection
        if self._generation != connection.generation:  # connected again: the same view
            raw = connection.raw
            for prefix in self._prefixes:
                raw = PrefixStore(prefix + "/", raw)
            self._raw, self._generation = raw, connection.generation
        return self._raw

    def prefixed(self, prefix: str) -> BoundedStore:
        """A view whose keys all start with ``prefix/``, sharing this one's caller (and
        seal)."""
        return BoundedStore(PrefixStore(prefix + "/", self.raw), self.where,
                            _connection=self._connection, _prefixes=(*self._prefixes, prefix),
                            _seal=self.seal)

    def with_seal(self, seal: ValueSeal | None) -> BoundedStore:
        """This view, carrying the world key's ``seal`` (see :mod:`rpcx._world.sealed`)."""
        view = BoundedStore(self.raw, self.where, _connection=self._connection,
                            _prefixes=self._prefixes, _seal=seal)
        view._raw = self._raw
        return view

    def label(self, key: str) -> str:
        """``key``'s full name in the store (with every prefix): what a seal covers."""
        return self._prefix + key

    def set(self, key: str, value: bytes | str, timeout: float | None = None) -> None:
        """Store ``value`` under ``key``."""
        self._run(f"setting {key!r}", "set", (key, value), timeout)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, which must exist (wait for it first: a missing key
        makes the store's own ``get`` block until the store's timeout)."""
        return bytes(self._run(f"reading {key!r}", "get", (key,), timeout))

    def add(self, key: str, amount: int, timeout: float | None = None) -> int:
        """Add ``amount`` to the counter ``key``; its new value."""
        # (not made again after a break: the first may have counted)
        return int(self._run(f"adding to {key!r}", "add", (key, amount), timeout,
                             again=False))

    def compare_set(self, key: str, expected: str, desired: str,
                    timeout: float | None = None) -> bytes:
        """Set ``key`` to ``desired`` if its value is ``expected`` (``""``: also if it
        does not exist); the value it has afterwards."""
        return bytes(self._run(f"compare-and-set of {key!r}", "compare_set",
                               (key, expected, desired), timeout))

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        """The values of ``keys`` (which must all exist), in one store operation."""
        values = self._run(f"reading {keys[0]!r} and {len(keys) - 1} more", "multi_get",
                           (keys,), timeout)
        return [bytes(value) for value in values]

    def check(self, keys: list[str], timeout: float | None = None) -> bool:
        """Whether every key of ``keys`` exists."""
        return bool(self._run(f"looking for {keys[0]!r}", "check", (keys,), timeout))

    def wait_for(
        self,
        keys: list[str],
        deadline: float | None,
        *,
        skip: Callable[[int], bool] = lambda index: False,
        on_poll: Callable[[list[int]], None] = lambda missing: None,
        report_every: float = 1.0,
    ) -> list[int]:
        """Wait until every key exists, or ``skip(index)``; the indices of those missing
        at ``deadline`` (a ``time.monotonic()`` value; ``None``: no deadline), in order.

        Each look is one store operation for all the keys still missing, bounded by what
        is left of the deadline (by :data:`OPERATION_BOUND` without one): a store that
        does not answer raises. Every ``report_every`` seconds, and at the deadline, a
        look key by key finds which are missing, and ``on_poll(missing)`` runs (progress
        reports): as rarely as the caller reports, since each such look costs one store
        operation per missing key.
        """
        missing = list(range(len(keys)))
        pause, longest = _POLL_FIRST, _POLL_MAX * max(1.0, len(keys) / _KEYS_PER_PAUSE)
        narrow_at = time.monotonic() + report_every
        answered = False  # whether the store answered a look of this wait yet

        def look(indices: list[int], bound: float | None) -> bool | None:
            """Whether every key of ``indices`` exists; ``None``: no answer at the deadline.
            A busy store (64 workers polling it) may miss the short bound of a look at the
            deadline: having answered before, it is slow, not gone, and the keys count
            as missing."""
            nonlocal answered
            try:
                found = self.check([keys[i] for i in indices], timeout=bound)
            except RpcTimeoutError:
                if answered and deadline is not None and time.monotonic() >= deadline:
                    return None
                raise
            answered = True
            return found

        while True:
            left = None if deadline is None else deadline - time.monotonic()
            # A look made just before the deadline still gets a moment to answer, so
            # that a slow answer is not taken for a store that does not answer at all.
            bound = None if left is None else max(left, _LOOK_MIN)
            missing = [i for i in missing if not skip(i)]
            if not missing or look(missing, bound):
                return []
            now = time.monotonic()
            expired = deadline is not None and now >= deadline
            if expired or now >= narrow_at:
                # One look per key, together at most _NARROW_MAX past the deadline on a
                # busy store; the keys not looked at once it is late count as missing.
                narrow_end, still = now + _NARROW_MAX, []
                for position, i in enumerate(missing):
                    answer = look([i], bound if not expired else
                                  max(narrow_end - time.monotonic(), _LOOK_MIN))
                    if answer is None:
                        still += missing[position:]
                        break
                    if not answer:
                        still.append(i)
                missing = still
                narrow_at = now + report_every
                on_poll(missing)
                if expired or not missing:
                    return missing
            left = None if deadline is None else deadline - time.monotonic()
            # Polling: the store's own wait prints c10d warnings each time it times out.
            time.sleep(pause if left is None else max(0.0, min(pause, left)))
            pause = min(pause * 2, longest)

    def _call(self, name: str, args: tuple[Any, ...], again: bool) -> Any:
        """Make the store call ``name`` (on the caller thread); connect again and make
        it once more where the connection broke and ``again`` allows."""
        generation = self._connection.generation
        try:
            return getattr(self.raw, name)(*args)
        except DistNetworkError as exc:
            replaced = self._connection.replace(generation, f"broke ({_first_line(exc)})",
                                                self.where)
            if not (replaced and again):  # (a call not to make twice fails; later ones go)
                raise
        return getattr(self.raw, name)(*args)

    def _run(self, what: str, name: str, args: tuple[Any, ...], timeout: float | None,
             again: bool = True) -> Any:
        bound = OPERATION_BOUND if timeout is None else max(0.0, timeout)
        connection = self._connection
        operation, caller, generation = self._submit(name, args, again)
        if connection.reopen is None:
            done = operation.done.wait(bound)
        else:  # (a stuck call is made again on a new connection: see the module's notes)
            deadline = time.monotonic() + bound
            made = time.monotonic()
            while not (done := operation.done.wait(
                    max(0.0, min(_LOOK_S, deadline - time.monotonic())))):
                now = time.monotonic()
                if now >= deadline:
                    break
                if connection.generation != generation:
                    if again and caller.give_up(operation):
                        operation, caller, generation = self._submit(name, args, again)
                        made = now
                elif now - made >= STUCK_S:
                    connection.replace_if_stuck(generation, self.where)
        if not done and caller.give_up(operation):
            raise RpcTimeoutError(
                f"the rendezvous store at {self.where} did not answer within {bound:.3g} s "
                f"({what}{self._in_prefix()}): a worker may be stopped while it holds the "
                "store's lock, or the store's host (rank 0) is stopped or gone"
            )
        if operation.error is not None:
            error = operation.error
            if isinstance(error, RpcError):
                raise error
            raise RpcError(
                f"the rendezvous store at {self.where} failed ({what}{self._in_prefix()}): "
                f"{error}"
            ) from error
        return operation.result

    def _submit(self, name: str, args: tuple[Any, ...], again: bool
                ) -> tuple[_Operation, _Caller, int]:
        """Hand the call to the caller thread of the connection in use now."""
        connection = self._connection
        operation = _Operation(self._call, (name, args, again))
        caller, generation = connection.caller, connection.generation
        caller.submit(operation)
        return operation, caller, generation

    def _in_prefix(self) -> str:
        return f" under {self._prefix!r}" if self._prefix else ""


def _first_line(error: BaseException) -> str:
    """c10d's errors carry a C++ stack after their first line."""
    return str(error).split("\n", 1)[0]
