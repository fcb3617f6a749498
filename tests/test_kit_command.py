"""The conformance kit runs as documented, from the installed package, whole.

A plugin author runs ``pytest -p rpcx.testing.fixtures --pyargs rpcx.testing
--rpcx-backend=NAME`` (docs/plugins.md). These tests run that command in a directory of
its own and check it collects every group of the kit, exactly what this repository's own
``tests/test_conformance.py`` runs, and that capability skips say why.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

# Pytest in fresh interpreters: nox -s commands runs these (CI runs it), not nox -s tests.
pytestmark = pytest.mark.commands

KIT = ("-p", "rpcx.testing.fixtures", "--pyargs", "rpcx.testing")
TIMEOUT = 180
GROUPS = ("TestCalls", "TestRRef", "TestDistAutograd", "TestDDPHybrid", "TestAutogradParity",
          "TestPeerDeath", "TestCudaDeviceMaps", "TestHostilePeers", "TestAuthentication",
          "TestHungPeer")


def _pytest(cwd: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RPCX_"))}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd, env=env,
    )


def _collected(out: str) -> list[str]:
    """Test ids of ``--collect-only -q`` output, without the parametrization."""
    return sorted(re.sub(r"\[.*\]$", "", line.split("::", 1)[1])
                  for line in out.splitlines() if "::" in line)


def test_kit_collects_every_group_and_only_the_kit(tmp_path: pathlib.Path) -> None:
    kit = _pytest(tmp_path, *KIT, "--rpcx-backend=loopback", "--collect-only", "-q")
    assert kit.returncode == 0, kit.stdout + kit.stderr
    ids = _collected(kit.stdout)
    classes = {test_id.split("::")[0] for test_id in ids}
    assert set(GROUPS) <= classes, classes
    assert all("test_kit.py" in line for line in kit.stdout.splitlines() if "::" in line)
    # This repository's own run is the same set of tests.
    here = pathlib.Path(__file__).resolve().parent
    ours = _pytest(here.parent, str(here / "test_conformance.py"), "--rpcx-backend=loopback",
                   "--collect-only", "-q")
    assert ours.returncode == 0, ours.stdout + ours.stderr
    assert _collected(ours.stdout) == ids


def test_kit_runs_and_capability_skips_say_why(tmp_path: pathlib.Path) -> None:
    run = _pytest(tmp_path, *KIT, "--rpcx-backend=loopback", "-q", "-rs",
                  "-k", "TestPeerDeath or (TestCalls and (echo or kwargs))")
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"\b[1-9]\d* passed", run.stdout), run.stdout
    assert ("backend 'loopback' does not declare multi_process: a worker that is a thread "
            "of this process cannot crash alone") in run.stdout, run.stdout


def test_unknown_backend_is_an_error_not_an_empty_run(tmp_path: pathlib.Path) -> None:
    run = _pytest(tmp_path, *KIT, "--rpcx-backend=no-such-backend", "-q", "-x",
                  "-k", "TestCalls")
    assert run.returncode != 0
    assert "no-such-backend" in run.stdout + run.stderr


def test_capability_marker_is_declared(tmp_path: pathlib.Path) -> None:
    # --strict-markers rejects a marker that the fixtures plugin did not declare.
    run = _pytest(tmp_path, *KIT, "--rpcx-backend=loopback", "--strict-markers",
                  "--collect-only", "-q", "-k", "TestPeerDeath")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "TestPeerDeath" in run.stdout
