"""rpcx._world.store.BoundedStore: no store operation outlives its deadline, and waits are quiet.

The situations behind it, each reproduced here: a worker stopped while it holds a
``file://`` store's lock (the ``flock`` FileStore takes, which has no timeout), a
``tcp://`` store whose host process is stopped, and the c10d warnings a ``TCPStore``
prints each time its own ``wait`` times out.
"""

from __future__ import annotations

import contextlib
import fcntl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import DistNetworkError, FileStore, Store, TCPStore

from rpcx._world import rendezvous
from rpcx._world import store as _store
from rpcx._world.store import BoundedStore
from rpcx.errors import RpcError, RpcTimeoutError
from rpcx.testing.stopping import stopped

TIMEOUT = 30.0  # bounds every wait of the tests themselves
BOUND = 0.5  # the deadline the operations under test are given
SLACK = 1.5  # how late a bounded operation may return on a loaded machine


@contextlib.contextmanager
def _lock_held(path: Path) -> Iterator[None]:
    """Hold ``path``'s exclusive ``flock``, as a worker stopped inside a FileStore
    operation does (flock locks belong to the open file, so this process's own store
    calls wait for it too)."""
    with open(path, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


@pytest.fixture
def file_store(tmp_path: Path) -> tuple[BoundedStore, Path]:
    path = tmp_path / "rendezvous"
    raw = FileStore(str(path), 1)
    raw.set_timeout(timedelta(seconds=TIMEOUT))
    raw.set("ready", b"1")  # the file exists from here on
    return BoundedStore(raw, f"file://{path}"), path


def _while_locked(path: Path, operation: Callable[[], object]) -> tuple[float, Exception | None]:
    """Run ``operation`` while ``path``'s lock is held: how long it took, what it raised."""
    with _lock_held(path):
        started = time.monotonic()
        try:
            operation()
        except Exception as exc:
            return time.monotonic() - started, exc
        return time.monotonic() - started, None


def test_an_operation_on_a_locked_store_fails_by_its_deadline_naming_the_store(
    file_store: tuple[BoundedStore, Path],
) -> None:
    store, path = file_store
    took, error = _while_locked(path, lambda: store.set("key", b"value", timeout=BOUND))
    assert BOUND <= took < BOUND + SLACK, took
    assert isinstance(error, RpcTimeoutError), error
    text = str(error)
    assert f"file://{path}" in text and "setting 'key'" in text
    assert "did not answer within 0.5 s" in text and "stopped" in text
    # Lock released: the store answers again, the abandoned set included.
    assert store.get("key", timeout=TIMEOUT) == b"value"


def test_a_wait_on_a_locked_store_fails_by_its_deadline(
    file_store: tuple[BoundedStore, Path],
) -> None:
    store, path = file_store
    took, error = _while_locked(
        path, lambda: store.wait_for(["never"], time.monotonic() + BOUND))
    assert took < BOUND + SLACK, took
    assert isinstance(error, RpcTimeoutError) and "did not answer" in str(error), error


def test_a_barrier_on_a_locked_store_fails_by_its_timeout_naming_what_it_waited_for(
    file_store: tuple[BoundedStore, Path],
) -> None:
    store, path = file_store
    took, error = _while_locked(path, lambda: rendezvous.barrier(
        store, "shutdown", 0, 2, timeout=BOUND, is_gone=lambda r: False, describe=str,
        waiter="worker0"))
    assert took < BOUND + SLACK, took
    assert isinstance(error, RpcTimeoutError), error
    assert "worker 'worker0' waiting at 'shutdown'" in str(error)
    assert "rendezvous store at file://" in str(error)


def test_leaving_a_locked_store_is_bounded_and_quiet(
    file_store: tuple[BoundedStore, Path],
) -> None:
    store, path = file_store
    took, error = _while_locked(
        path, lambda: rendezvous.leave(store, 0, 2, is_gone=lambda r: False, timeout=BOUND))
    assert took < BOUND + SLACK, took
    assert error is None  # leaving never raises


class _GatedStore:
    """A stand-in for a torch store whose first ``set`` blocks until ``gate`` opens; it
    records every call it makes."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.made: list[str] = []
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        if not self.made:
            self.entered.set()
            assert self.gate.wait(TIMEOUT)
        self.made.append(f"set {key}")
        self.values[key] = value

    def check(self, keys: list[str]) -> bool:
        self.made.append(f"check {keys[0]}")
        return all(k in self.values for k in keys)


def test_operations_given_up_behind_a_stuck_one_are_never_made() -> None:
    raw = _GatedStore()
    store = BoundedStore(raw, "a gated store")
    with pytest.raises(RpcTimeoutError):
        store.set("first", b"1", timeout=0.05)  # stuck inside the store
    assert raw.entered.wait(TIMEOUT)
    for attempt in range(3):  # queued behind it, each given up
        with pytest.raises(RpcTimeoutError):
            store.check([f"late{attempt}"], timeout=0.05)
    raw.gate.set()
    assert store.check(["first"], timeout=TIMEOUT) is True  # in order, after the stuck one
    assert raw.made == ["set first", "check first"]


def test_an_error_of_the_store_names_the_store_and_the_operation() -> None:
    class Broken:
        def get(self, key: str) -> bytes:
            raise RuntimeError("connection reset by peer")

    store = BoundedStore(Broken(), "tcp://192.0.2.1:1", _prefixes=("rpcx", "s0"))
    with pytest.raises(RpcError) as err:
        store.get("name/1", timeout=TIMEOUT)
    assert not isinstance(err.value, RpcTimeoutError)
    assert str(err.value) == (
        "the rendezvous store at tcp://192.0.2.1:1 failed (reading 'name/1' under 'rpcx/s0/'): "
        "connection reset by peer"
    )


def test_wait_for_skips_gone_ranks_and_reports_the_missing_at_the_deadline(
    file_store: tuple[BoundedStore, Path],
) -> None:
    store, _ = file_store
    store.set("k/0", b"1", timeout=TIMEOUT)
    polled: list[list[int]] = []
    missing = store.wait_for(["k/0", "k/1", "k/2"], time.monotonic() + 0.2,
                             skip=lambda rank: rank == 2, on_poll=polled.append)
    assert missing == [1]
    assert polled and all(seen == [1] for seen in polled)
    assert store.wait_for(["k/0"], time.monotonic() + TIMEOUT) == []


class _BusyStore:
    """A store that answers at once until ``busy_from`` (a ``time.monotonic()`` value),
    then each look after ``delay`` seconds: a store that 64 polling workers keep busy."""

    def __init__(self, keys: set[str], busy_from: float, delay: float) -> None:
        self.keys, self.busy_from, self.delay = keys, busy_from, delay

    def check(self, keys: list[str]) -> bool:
        if time.monotonic() >= self.busy_from:
            time.sleep(self.delay)  # (the store's own slowness, not a wait for state)
        return all(key in self.keys for key in keys)


def test_a_store_slow_at_the_deadline_makes_a_wait_report_the_missing_not_fail() -> None:
    # The deadline's look gets a short bound; a store that answered earlier looks and is
    # only slow now is busy, not gone: the wait names what is missing (as a barrier's
    # error then does: "missing: w2"), instead of "the store did not answer within 0.0 s".
    deadline = time.monotonic() + 0.3
    raw = _BusyStore({"k/0", "k/2"}, busy_from=deadline - 0.05, delay=0.1)
    store = BoundedStore(raw, "a busy store")
    started = time.monotonic()
    missing = store.wait_for(["k/0", "k/1", "k/2"], deadline)
    assert missing == [1]  # (found one by one after the deadline, within _NARROW_MAX)
    assert time.monotonic() - started < 0.3 + _store._NARROW_MAX + SLACK


def test_a_barrier_on_a_store_slow_at_its_deadline_names_the_missing_worker() -> None:
    deadline_s = 0.3
    raw = _BusyStore({"ready/0", "ready/2"}, busy_from=time.monotonic() + deadline_s - 0.05,
                     delay=0.1)

    class Writable(_BusyStore):
        def set(self, key: str, value: bytes) -> None:
            self.keys.add(key)

    writable = Writable(raw.keys, raw.busy_from, raw.delay)
    store = BoundedStore(writable, "a busy store")
    with pytest.raises(RpcTimeoutError) as err:
        rendezvous.barrier(store, "ready", 0, 3, timeout=deadline_s, is_gone=lambda r: False,
                           describe=lambda ranks: ", ".join(f"w{r}" for r in ranks),
                           waiter="w0")
    assert "gave up after" in str(err.value) and "w1" in str(err.value), err.value
    assert "did not answer" not in str(err.value)


def test_the_caller_thread_ends_when_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_store, "_IDLE_EXIT", 0.05)
    name = f"rpcx-store-test-{time.monotonic_ns()}"
    raw = _GatedStore()
    store = BoundedStore(raw, "a gated store",
                         _connection=_store._Connection(raw, None, _store._Caller(name)))
    with pytest.raises(RpcTimeoutError):
        store.set("key", b"1", timeout=0.05)
    assert raw.entered.wait(TIMEOUT)
    (thread,) = [t for t in threading.enumerate() if t.name == name]  # stuck in the store
    raw.gate.set()
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    store.set("again", b"2", timeout=TIMEOUT)  # a new thread starts on demand
    assert raw.values == {"key": b"1", "again": b"2"}


def test_waiting_on_a_tcp_store_prints_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    # torch's own TCPStore.wait prints two c10d warning lines each time it times out;
    # rpcx's waits (here several seconds' worth of looks for keys) print none.
    host = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=TIMEOUT))
    store = BoundedStore(host, "tcp://127.0.0.1")
    assert store.wait_for(["never"], time.monotonic() + 1.0) == [0]
    with pytest.raises(RpcTimeoutError, match="gave up after"):
        rendezvous.barrier(store, "b", 0, 2, timeout=0.5, is_gone=lambda r: False,
                           describe=str, waiter="worker0")
    captured = capfd.readouterr()
    assert "c10d" not in captured.err and captured.err == "", captured.err


_HOST = """
import sys
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60))
print(store.port, flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


def test_an_operation_on_a_stopped_store_host_fails_by_its_deadline() -> None:
    # Rank 0 hosts a tcp:// world's store: stopped, it accepts bytes and answers none.
    host = subprocess.Popen([sys.executable, "-c", _HOST], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        client = TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=TIMEOUT))
        store = BoundedStore(client, f"tcp://127.0.0.1:{port}")
        store.set("key", b"1", timeout=TIMEOUT)
        with stopped(host.pid):
            started = time.monotonic()
            with pytest.raises(RpcTimeoutError, match=f"tcp://127.0.0.1:{port} did not answer"):
                store.get("key", timeout=BOUND)
            took = time.monotonic() - started
            assert took < BOUND + SLACK, took
        assert store.get("key", timeout=TIMEOUT) == b"1"  # answers again once it runs
    finally:
        host.kill()
        host.wait(TIMEOUT)


# ------------------------------------------------------- a connection made again


class _Breaking(Store):
    """A store connection whose calls fail as a broken TCPStore's do, from the
    ``breaks_at``-th on; ``stuck`` makes them wait (a call lost in a cut) instead. (A
    torch ``Store``, so that views of it can be made.)"""

    def __init__(self, name: str, values: dict[str, bytes], breaks_at: int = 10**9,
                 stuck: threading.Event | None = None) -> None:
        super().__init__()
        self.name, self.values, self.breaks_at, self.stuck = name, values, breaks_at, stuck
        self.calls = 0

    def _call(self) -> None:
        self.calls += 1
        if self.calls >= self.breaks_at:
            if self.stuck is not None:
                assert self.stuck.wait(TIMEOUT)  # (released at the test's end)
            raise DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")

    def set(self, key: str, value: bytes) -> None:
        self._call()
        self.values[key] = value

    def check(self, keys: list[str]) -> bool:
        self._call()
        return all(k in self.values for k in keys)

    def add(self, key: str, amount: int) -> int:
        self._call()
        value = int(self.values.get(key, b"0")) + amount
        self.values[key] = str(value).encode()
        return value


def test_a_call_merely_slow_keeps_its_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    # A store host starved of CPU answers late on a healthy connection: no new one (TCP
    # is not retransmitting), the call is answered where it was made.
    monkeypatch.setattr(_store, "STUCK_S", 0.05)
    released = threading.Event()
    slow = _Breaking("slow", {"key": b"1"})
    original_check = slow.check

    def late_check(keys: list[str]) -> bool:
        released.wait(0.5)  # (the host's slowness, not a wait for state)
        return original_check(keys)

    slow.check = late_check  # type: ignore[method-assign]
    made: list[object] = []
    store = BoundedStore(slow, "a slow store", reopen=lambda: made.append(1),
                         stalled=lambda: False)
    assert store.check(["key"], timeout=TIMEOUT)
    assert made == [] and store.raw is slow


def test_a_broken_connection_is_made_again_and_the_call_too() -> None:
    values: dict[str, bytes] = {}
    first = _Breaking("first", values, breaks_at=2)
    made: list[_Breaking] = []

    def reopen() -> _Breaking:
        made.append(_Breaking(f"new {len(made)}", values))
        return made[-1]

    store = BoundedStore(first, "a breaking store", reopen=reopen)
    view = store.prefixed("session")
    view.set("a", b"1", timeout=TIMEOUT)  # the first connection still works
    assert view.check(["a"], timeout=TIMEOUT)  # broke: made again, then the call
    assert len(made) == 1 and made[0].calls == 1
    assert store.raw is made[0] and view.check(["a"], timeout=TIMEOUT)  # views follow
    assert set(values) == {"session//a"}  # (the view's keys, as on the first connection)
    # An add is not made twice (the first may have counted): it fails, the next works.
    made[0].breaks_at = made[0].calls + 1
    with pytest.raises(RpcError, match="Failed to recv"):
        store.add("n", 1, timeout=TIMEOUT)
    assert len(made) == 2 and store.add("n", 1, timeout=TIMEOUT) == 1


def test_a_store_without_reopen_fails_as_before() -> None:
    store = BoundedStore(_Breaking("only", {}, breaks_at=1), "a breaking store")
    with pytest.raises(RpcError, match="Failed to recv"):
        store.check(["a"], timeout=TIMEOUT)


def test_a_call_stuck_on_its_connection_is_made_again_on_a_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A call sent as a partition began waits for TCP's backed-off retransmission, long
    # after the link is back: it gets a new connection, where it is answered.
    monkeypatch.setattr(_store, "STUCK_S", 0.2)
    released = threading.Event()
    values = {"key": b"1"}
    stuck = _Breaking("stuck", values, breaks_at=1, stuck=released)
    fresh = _Breaking("fresh", values)
    store = BoundedStore(stuck, "a store cut off", reopen=lambda: fresh, stalled=lambda: True)
    try:
        started = time.monotonic()
        assert store.check(["key"], timeout=TIMEOUT)
        assert time.monotonic() - started < 0.2 + SLACK
        assert fresh.calls == 1 and store.raw is fresh
        store.set("more", b"2", timeout=TIMEOUT)  # later calls: on the new connection
        assert fresh.calls == 2
    finally:
        released.set()  # (the old connection's thread ends: its call fails, unheard)
