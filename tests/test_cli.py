"""The command line: ``rpcx doctor``, ``rpcx launch`` (Ctrl-C included) and ``rpcx bench``.
(``rpcx backends`` is tested with the registry, tests/test_registry.py.)"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest

import rpcx.registry
from rpcx._wire.cipher import aead_available
from rpcx.cli import main as cli_main
from rpcx.cli.doctor import Check, diagnose
from rpcx.testing.world import free_port

BOUND = 120.0
ROOT = pathlib.Path(__file__).resolve().parent.parent

# A worker that joins rpcx's world through env:// (the launcher's store), calls the
# next worker, prints, and leaves; with FAIL_RANK it exits with status 3 instead, and
# with HOLD it says so and waits (for the launcher to stop it).
WORKER = textwrap.dedent("""
    import os, sys, threading
    import rpcx
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("HOLD"):
        print(f"holding pid {os.getpid()}", flush=True)
        threading.Event().wait(120)
        sys.exit(0)
    if os.environ.get("FAIL_RANK") == str(rank):
        print("failing", flush=True)
        sys.exit(3)
    rpcx.init_rpc(f"w{rank}", rank=rank, world_size=size,
                  backend=os.environ.get("RPCX_BACKEND", "gloo"))
    peer = rpcx.rpc_sync(f"w{(rank + 1) % size}", rpcx.get_worker_info).name
    print(f"rank {rank} of {size} called {peer} on {os.environ['RPCX_BACKEND']}, "
          f"{os.environ.get('OMP_NUM_THREADS')} thread", flush=True)
    rpcx.shutdown()
""")


def _launch(tmp_path: pathlib.Path, *args: str, **env: str) -> subprocess.Popen[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return subprocess.Popen(
        [sys.executable, "-m", "rpcx", "launch", *args, str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, **env},
        cwd=tmp_path,
    )


def test_help_reads_as_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    # (the module docstring it shows is reST for the API pages)
    with pytest.raises(SystemExit) as exited:
        cli_main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "- doctor [--init-method URL]: what this machine has for rpcx" in out, out
    assert "``" not in out, out


def test_doctor_reports_this_machine_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["doctor"]) == 0
    out = capsys.readouterr().out
    for name in ("python", "torch", "gloo", "tensorpipe", "numpy", "cuda", "backends"):
        assert f" {name}: " in out, out
    assert out.rstrip().endswith("no problems found")


def test_doctor_says_how_the_default_backend_reaches_peers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RPCX_BACKEND", raising=False)
    checks = {c.name: c for c in diagnose("tcp://127.0.0.1:1")}
    assert checks["default backend"].detail == "auto"
    assert "shared memory" in checks["auto, same host"].detail
    other = checks["auto, other hosts"]
    assert "listening on 127.0.0.1 (the address that routes to the rendezvous host)" in (
        other.detail)
    monkeypatch.setenv("RPCX_BACKEND", "gloo")
    checks = {c.name: c for c in diagnose("tcp://127.0.0.1:1")}
    assert checks["default backend"].detail == "gloo (from $RPCX_BACKEND; without it: auto)"
    assert "auto, other hosts" not in checks


def test_doctor_says_whether_a_world_would_run_encrypted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def security() -> Check:
        return {c.name: c for c in diagnose()}["security"]

    monkeypatch.delenv("RPCX_AUTH_KEY", raising=False)
    monkeypatch.delenv("RPCX_ENCRYPT", raising=False)
    assert security().status == "note" and "no world key" in security().detail
    monkeypatch.setenv("RPCX_AUTH_KEY", "a-key-nobody-may-see-0123456789")
    assert "authenticated, not encrypted" in security().detail
    monkeypatch.setenv("RPCX_ENCRYPT", "1")
    if aead_available():
        assert security().status == "ok" and "between hosts encrypted" in security().detail
        monkeypatch.setenv("RPCX_ENCRYPT", "always")
        assert "between every pair" in security().detail
    else:
        assert security().status == "PROBLEM" and "torch-rpcx[encrypt]" in security().detail
    assert "nobody-may-see" not in str(security())
    monkeypatch.delenv("RPCX_AUTH_KEY")
    assert security().status == "PROBLEM" and "RPCX_AUTH_KEY is not" in security().detail
    monkeypatch.setenv("RPCX_ENCRYPT", "perhaps")
    assert security().status == "PROBLEM" and "'perhaps'" in security().detail


@pytest.mark.skipif(not aead_available(), reason="making certificates needs 'cryptography'")
def test_doctor_says_whether_certificates_key_the_world(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path,
) -> None:
    from rpcx.testing.certificates import make_site

    def security() -> Check:
        return {c.name: c for c in diagnose()}["security"]

    for variable in ("RPCX_AUTH_KEY", "RPCX_ENCRYPT", "RPCX_TLS_CA", "RPCX_TLS_CERT",
                     "RPCX_TLS_KEY"):
        monkeypatch.delenv(variable, raising=False)
    site = make_site(tmp_path, ["w0"])
    monkeypatch.setenv("RPCX_TLS_CERT", str(tmp_path / "w0.crt"))
    assert security().status == "PROBLEM" and "RPCX_TLS_CA and RPCX_TLS_KEY" in security().detail
    for variable, value in site.worker("w0").items():
        monkeypatch.setenv(variable, value)
    assert security().status == "ok" and "mutual TLS" in security().detail
    assert "between hosts encrypted" in security().detail
    monkeypatch.setenv("RPCX_ENCRYPT", "0")
    assert "not encrypted (RPCX_ENCRYPT=0)" in security().detail
    monkeypatch.setenv("RPCX_AUTH_KEY", "a-key-nobody-may-see-0123456789")
    assert security().status == "PROBLEM" and "both RPCX_AUTH_KEY and" in security().detail


def test_doctor_checks_the_path_to_a_rendezvous() -> None:
    port = free_port()  # nothing listens there: a note, not a problem
    checks = {c.name: c for c in diagnose(f"tcp://127.0.0.1:{port}")}
    assert checks["address"].status == "ok" and "127.0.0.1" in checks["address"].detail
    assert checks["rendezvous"].status == "note"
    assert "nothing listens there yet" in checks["rendezvous"].detail


def test_doctor_names_each_problem_with_what_to_do(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(rpcx.registry, "plugin_errors",
                        lambda: {"rpcx-broken": "failed to load: ImportError: no module x"})
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert cli_main(["doctor", "--init-method", "env://"]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM  plugin rpcx-broken: failed to load: ImportError" in out
    assert "reinstall it" in out
    assert "env:// needs MASTER_ADDR and MASTER_PORT" in out
    assert "2 problem(s)" in out


@pytest.mark.commands
@pytest.mark.timeout(240)
def test_launch_starts_the_workers_with_prefixed_output(tmp_path: pathlib.Path) -> None:
    launcher = _launch(tmp_path, "-n", "3", "--backend", "gloo")
    out, err = launcher.communicate(timeout=BOUND)
    assert launcher.returncode == 0, err
    for rank in range(3):
        assert (f"[worker{rank}] rank {rank} of 3 called w{(rank + 1) % 3} on gloo, 1 thread"
                in out), out


@pytest.mark.commands
@pytest.mark.timeout(240)
def test_launch_stops_every_worker_when_one_fails(tmp_path: pathlib.Path) -> None:
    launcher = _launch(tmp_path, "-n", "3", FAIL_RANK="1")
    out, err = launcher.communicate(timeout=BOUND)
    assert launcher.returncode == 3, (out, err)  # the failed worker's status
    assert "[worker1] failing" in out
    assert "worker1 exited with status 3; stopping" in err


@pytest.mark.commands
@pytest.mark.timeout(240)
def test_ctrl_c_stops_every_worker(tmp_path: pathlib.Path) -> None:
    launcher = _launch(tmp_path, "-n", "3", HOLD="1")
    assert launcher.stdout is not None
    pids = []
    while len(pids) < 3:  # each worker says when it holds (a bounded read: timeout mark)
        line = launcher.stdout.readline()
        assert line, "the launcher ended before its workers held"
        if "holding pid" in line:
            pids.append(int(line.rsplit(" ", 1)[1]))
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=BOUND)
    assert launcher.returncode == 130, err
    assert "interrupted; stopping 3 workers" in err
    for pid in pids:  # reaped by the launcher: gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.commands
def test_bench_runs_the_checkout_s_suite(capsys: pytest.CaptureFixture[str]) -> None:
    if not (ROOT / "bench" / "run.py").is_file():
        pytest.skip("not a source checkout")
    out = subprocess.run([sys.executable, "-m", "rpcx", "bench", "--help"],
                         capture_output=True, text=True, timeout=BOUND)
    assert out.returncode == 0, out.stderr
    assert "against torch.distributed.rpc" in out.stdout.replace("\n", " ")
