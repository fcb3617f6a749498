"""torch's C++ warnings (c10d's) are held back while a world runs, and only then.

c10d writes its warnings, C++ stacks included, straight to the terminal: a store call
that waits past its timeout, a connection that broke in a partition, a host without
reverse DNS. rpcx raises torch's C++ log level to errors from ``init_rpc`` until the
last worker of the process has shut down, unless ``TORCH_CPP_LOG_LEVEL`` is set.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rpcx._util import cpp_log as _cpp_log

# A c10d warning on demand: a TCPStore wait that times out prints two lines
# ("[W... socket.cpp:...] [c10d] waitForInput: ...").
_PROGRAM = """
import datetime, sys
import rpcx
from torch.distributed import TCPStore
from rpcx.testing.world import free_port

def c10d_warns():
    store = TCPStore("127.0.0.1", free_port(), 1, True, datetime.timedelta(seconds=30),
                     wait_for_workers=False)
    try:
        store.wait(["missing"], datetime.timedelta(milliseconds=50))
    except Exception:
        pass
    print("-- mark", file=sys.stderr, flush=True)

c10d_warns()
rpcx.init_rpc("solo", rank=0, world_size=1, backend="loopback")
c10d_warns()
rpcx.shutdown()
c10d_warns()
"""


def _stderr_between_marks(env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    parts = done.stderr.split("-- mark\n")
    assert len(parts) == 4, done.stderr[-3000:]
    return parts[:3]


def test_c10d_warnings_are_held_back_while_a_world_runs_and_only_then() -> None:
    env = {k: v for k, v in os.environ.items() if k != _cpp_log.LEVEL_ENV}
    before, during, after = _stderr_between_marks(env)
    assert "[c10d]" in before and "[c10d]" in after, (before, after)  # (torch's own)
    assert "[c10d]" not in during, during


def test_torch_cpp_log_level_set_by_the_user_wins() -> None:
    env = dict(os.environ, **{_cpp_log.LEVEL_ENV: "WARNING"})
    _, during, _ = _stderr_between_marks(env)
    assert "[c10d]" in during, during


def test_nested_worlds_restore_the_level_after_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_cpp_log.LEVEL_ENV, raising=False)
    flag = _cpp_log._level()
    if flag is None:
        pytest.skip("this torch build's C++ log level cannot be reached")
    before = flag.value
    _cpp_log.hold_back()
    _cpp_log.hold_back()  # (two workers of one process: loopback, threads)
    try:
        assert flag.value == max(before, 2)
        _cpp_log.let_through()
        assert flag.value == max(before, 2)  # one worker still runs
    finally:
        _cpp_log.let_through()
    assert flag.value == before
