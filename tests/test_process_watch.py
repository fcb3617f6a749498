"""rpcx._util.process_watch: what the kernel says of a peer's process, from its published mark.

Real processes: a child that sleeps, is stopped (``SIGSTOP``, waited for with
``waitpid(WUNTRACED)``), and exits. No sleeping to wait for state.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from rpcx._util.process_watch import PeerProcesses, local_mark, process_state

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")

CHILD = ("import os, sys\n"
         "from rpcx._util.process_watch import local_mark\n"
         "sys.stdout.buffer.write(local_mark() + b'\\n'); sys.stdout.flush()\n"
         "sys.stdin.read()\n")  # until the test closes stdin


@pytest.fixture
def child() -> Iterator[tuple[subprocess.Popen[bytes], bytes]]:
    """A process that published its mark (on stdout) and waits on its stdin."""
    process = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE)
    assert process.stdout is not None
    mark = process.stdout.readline().strip()
    try:
        yield process, mark
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def test_this_process_is_running() -> None:
    assert process_state(local_mark()) == ("R", os.getpid())


def test_a_child_is_sleeping_then_stopped_then_gone(
        child: tuple[subprocess.Popen[bytes], bytes]) -> None:
    process, mark = child
    # Blocked reading its stdin (S), or still on its way there (R) on a busy host.
    assert process_state(mark) in {("S", process.pid), ("R", process.pid)}
    os.kill(process.pid, signal.SIGSTOP)
    os.waitpid(process.pid, os.WUNTRACED)  # returns once it is stopped
    assert process_state(mark) == ("T", process.pid)
    os.kill(process.pid, signal.SIGCONT)
    process.kill()
    process.wait(10)
    assert process_state(mark) == ("gone", process.pid)


def test_marks_of_another_kernel_or_namespace_or_malformed_say_nothing() -> None:
    boot, pid_ns, net_ns, pid, start = local_mark().decode().split("|")
    for other in ([("0" * len(boot)), pid_ns, net_ns, pid, start],
                  [boot, pid_ns, "net:[1]", pid, start],  # another network namespace
                  [boot, "pid:[1]", net_ns, pid, start]):
        assert process_state("|".join(other).encode()) is None
    assert process_state(b"") is None
    assert process_state(b"a|b") is None
    # The same pid with another start time: that process is gone (the pid was reused).
    assert process_state("|".join([boot, pid_ns, net_ns, pid, "1"]).encode()) == (
        "gone", os.getpid())


def test_peer_processes_vouch_for_a_live_process_only(
        child: tuple[subprocess.Popen[bytes], bytes]) -> None:
    process, mark = child
    fetched: list[int] = []

    def fetch(rank: int) -> bytes | None:
        fetched.append(rank)
        return {1: mark}.get(rank)

    processes = PeerProcesses(fetch)
    evidence = processes.vouch(1) or ""
    assert re.fullmatch(rf"its process {process.pid} on this host is (sleeping|running) "
                        r"\(kernel state [SR]\)", evidence), evidence
    os.kill(process.pid, signal.SIGSTOP)
    os.waitpid(process.pid, os.WUNTRACED)
    assert processes.vouch(1) is None  # stopped: no word for it
    os.kill(process.pid, signal.SIGCONT)
    assert processes.vouch(2) is None  # no mark published
    assert processes.vouch(2) is None
    assert fetched == [1, 2]  # each mark asked for once, found or not
    processes.forget(1)  # another process took rank 1: its mark is fetched again
    processes.vouch(1)
    assert fetched == [1, 2, 1]


def test_a_store_that_does_not_answer_is_no_evidence() -> None:
    calls: list[int] = []

    def fetch(rank: int) -> bytes | None:
        calls.append(rank)
        raise TimeoutError("the store did not answer")

    now = [0.0]
    processes = PeerProcesses(fetch, retry_after=10.0, clock=lambda: now[0])
    assert processes.vouch(3) is None and processes.vouch(3) is None
    assert calls == [3]  # one wait on the store, not one per look
    now[0] = 10.5
    assert processes.vouch(3) is None
    assert calls == [3, 3]  # asked again, later


def test_marks_learnt_at_start_need_no_store(
        child: tuple[subprocess.Popen[bytes], bytes]) -> None:
    process, mark = child

    def fetch(rank: int) -> bytes | None:
        raise AssertionError("the store was asked")

    processes = PeerProcesses(fetch)
    processes.learn({5: mark})
    assert f"its process {process.pid} on this host" in (processes.vouch(5) or "")


def test_the_kernel_knows_peers_of_this_host_whose_marks_are_known() -> None:
    # knows() never asks the store: the heartbeat calls it for every quiet peer.
    boot, pid_ns, net_ns, pid, start = local_mark().decode().split("|")
    fetched: list[int] = []

    def fetch(rank: int) -> bytes:
        fetched.append(rank)
        return local_mark()

    processes = PeerProcesses(fetch)
    processes.learn({1: local_mark(),
                     2: "|".join(["0" * len(boot), pid_ns, net_ns, pid, start]).encode(),
                     3: "|".join([boot, pid_ns, "net:[1]", pid, start]).encode()})
    assert processes.knows(1)
    assert not processes.knows(2)  # another host's process
    assert not processes.knows(3)  # another network namespace: a partition can cut it off
    assert not processes.knows(4)  # no mark yet
    assert fetched == []
    processes.vouch(4)  # the mark fetched once the peer went silent ...
    assert processes.knows(4)  # ... is known from then on
    assert fetched == [4]
