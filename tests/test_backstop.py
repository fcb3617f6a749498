"""rpcx.testing.backstop: a test hung inside a C++ call, where pytest-timeout's signal
never arrives, still ends its process, with every thread's stack, and the run goes on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Pytest in fresh interpreters: nox -s commands runs these (CI runs it), not nox -s tests.
pytestmark = pytest.mark.commands

RUN_BOUND = 120.0

_HUNG = textwrap.dedent('''
    import fcntl
    import pytest
    from torch.distributed import FileStore

    @pytest.mark.timeout(1)
    def test_hung_in_a_store_lock(tmp_path):
        path = str(tmp_path / "rendezvous")
        store = FileStore(path, 1)
        store.set("ready", b"1")
        held = open(path, "rb")
        fcntl.flock(held, fcntl.LOCK_EX)  # another holder of the store's lock
        store.set("key", b"value")  # blocks in flock, in C++: no signal gets through

    def test_after_the_hung_one():
        pass
''')


@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "xdist"])
def test_a_test_hung_in_cpp_ends_its_process_with_the_stacks(
    tmp_path: Path, xdist: bool
) -> None:
    (tmp_path / "test_hung.py").write_text(_HUNG)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["rpcx.testing.fixtures"]\n')
    args = ["-n", "1"] if xdist else ["-p", "no:xdist"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args, "test_hung.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=RUN_BOUND,
        env={**os.environ, "RPCX_BACKSTOP_GRACE": "2"},
    )
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert "Timeout (0:00:03)!" in output, output  # faulthandler's report: 1 s + 2 s
    assert "in test_hung_in_a_store_lock" in output, output  # the hung test's own frame
    if xdist:  # the worker is replaced and the run goes on
        assert "crashed while running 'test_hung.py::test_hung_in_a_store_lock'" in output
        assert "1 failed, 1 passed" in output, output
