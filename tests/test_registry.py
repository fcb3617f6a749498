"""Unit tests for rpcx.registry and ``python -m rpcx backends``.

Backend selection runs in-process against the installed built-ins (gloo, loopback).
Third-party plugin discovery runs in subprocesses, because plugins load once per
process: each test writes a plugin module and its ``*.dist-info`` (entry-point group
``rpcx``) under a temporary directory and puts that directory on ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed.rpc as torch_rpc

import rpcx
import rpcx.registry as registry_module
from rpcx.cli import main as cli_main
from rpcx.errors import BackendNotFoundError
from rpcx.registry import (
    DEFAULT_BACKEND,
    ENV_VAR,
    BackendRegistry,
    BackendType,
    available_backends,
    backend_names,
    plugin_errors,
    resolve_backend,
)
from rpcx.transport import Capabilities

SUBPROCESS_TIMEOUT = 120


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)


# ------------------------------------------------------------------------------ built-ins


def test_builtins_are_installed() -> None:
    names = backend_names()
    assert {"gloo", "loopback"} <= set(names)
    assert names == sorted(names)
    specs = available_backends()
    assert specs["gloo"].plugin == "rpcx.backends.gloo"
    assert specs["loopback"].plugin == "rpcx.backends.loopback"
    assert specs["loopback"].capabilities.in_process
    assert specs["gloo"].capabilities.multi_process and specs["gloo"].capabilities.multi_host
    assert specs["gloo"].description and specs["loopback"].description


def test_builtins_load_without_errors() -> None:
    errors = plugin_errors()
    assert not any("rpcx.backends" in plugin for plugin in errors), errors


def test_default_backend_is_installed() -> None:
    assert DEFAULT_BACKEND == "auto"
    assert DEFAULT_BACKEND in backend_names()


def test_public_reexports() -> None:
    assert rpcx.BackendType is BackendType
    assert rpcx.DEFAULT_BACKEND == DEFAULT_BACKEND
    assert rpcx.backend_names() == backend_names()


# ---------------------------------------------------------------------------- resolution


def test_default_when_nothing_is_set() -> None:
    assert resolve_backend().name == DEFAULT_BACKEND


def test_env_var_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "loopback")
    assert resolve_backend().name == "loopback"


def test_empty_env_var_means_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "")
    assert resolve_backend().name == DEFAULT_BACKEND


def test_spawned_beats_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "no-such-backend")
    assert resolve_backend(None, spawned="loopback").name == "loopback"
    monkeypatch.setenv(ENV_VAR, "loopback")
    assert resolve_backend(None, spawned="gloo").name == "gloo"


def test_explicit_beats_spawned_and_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "no-such-backend")
    assert resolve_backend("loopback", spawned="no-such-either").name == "loopback"
    assert resolve_backend("gloo", spawned="loopback").name == "gloo"


def test_bad_env_var_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "no-such-backend")
    with pytest.raises(BackendNotFoundError, match="no-such-backend"):
        resolve_backend()


def test_names_are_case_insensitive() -> None:
    assert resolve_backend("LoopBack").name == "loopback"
    assert resolve_backend("GLOO").name == "gloo"


@pytest.mark.parametrize("member", list(BackendType))
def test_rpcx_backend_type_members(member: BackendType) -> None:
    assert isinstance(member, str)
    if member.value in backend_names():
        assert resolve_backend(member).name == member.value
    else:
        with pytest.raises(BackendNotFoundError, match=member.value):
            resolve_backend(member)


def test_rpcx_backend_type_installed_members_resolve() -> None:
    assert resolve_backend(BackendType.LOOPBACK).name == "loopback"
    assert resolve_backend(BackendType.GLOO).name == "gloo"


def test_torch_backend_type_resolves_by_name() -> None:
    member = torch_rpc.BackendType.TENSORPIPE
    assert not isinstance(member, str)
    if "tensorpipe" not in backend_names():
        pytest.skip("this torch build has no TensorPipe agent, so no tensorpipe backend")
    assert resolve_backend(member).name == "tensorpipe"


def test_torch_backend_type_of_a_backend_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    # As where torch has no TensorPipe agent: the registry lacks "tensorpipe".
    without = {name: spec for name, spec in available_backends().items() if name != "tensorpipe"}
    monkeypatch.setattr(registry_module, "_loaded", without)
    monkeypatch.setattr(registry_module, "_builtins", {
        name: spec for name, spec in registry_module._load_builtins().items()
        if name != "tensorpipe"})
    assert "tensorpipe" not in backend_names()
    with pytest.raises(BackendNotFoundError) as info:
        resolve_backend(torch_rpc.BackendType.TENSORPIPE)
    message = str(info.value)
    installed = ", ".join(sorted(without))  # gloo, loopback and any plugins installed
    assert "'TENSORPIPE'" in message
    assert f"installed backends: {installed}" in message
    with pytest.raises(BackendNotFoundError, match=rf"installed backends: {installed}$"):
        resolve_backend(BackendType.TENSORPIPE)


def test_unknown_name_lists_installed_backends() -> None:
    with pytest.raises(BackendNotFoundError) as info:
        resolve_backend("carrier-pigeon")
    message = str(info.value)
    assert "'carrier-pigeon'" in message
    assert "gloo, loopback" in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("bad", [1, 2.5, object(), ["gloo"]])
def test_non_name_is_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match="backend must be a name"):
        resolve_backend(bad)


# ------------------------------------------------------------------------------ registry


class _Transport:
    capabilities = Capabilities(multi_process=False, multi_host=False, in_process=True)

    def start(self, ctx: object) -> None:
        pass

    def send(self, dst: int, frame: object) -> None:
        pass

    def close(self, timeout: float) -> None:
        pass


def test_registry_records_plugin_and_capabilities() -> None:
    registry = BackendRegistry()
    registry._plugin = "plugin-a"
    registry("Mine", _Transport, description="mine")
    spec = registry.specs()["mine"]
    assert spec.name == "mine"
    assert spec.factory is _Transport
    assert spec.capabilities == _Transport.capabilities
    assert spec.plugin == "plugin-a"
    assert spec.description == "mine"
    assert spec.options_type is rpcx.RpcBackendOptions


def test_registry_explicit_capabilities_win() -> None:
    caps = Capabilities(multi_process=True, multi_host=True)
    registry = BackendRegistry()
    registry("x", _Transport, capabilities=caps, options_type=rpcx.TensorPipeRpcBackendOptions)
    spec = registry.specs()["x"]
    assert spec.capabilities is caps
    assert spec.options_type is rpcx.TensorPipeRpcBackendOptions


def test_registering_a_name_twice_names_both_plugins() -> None:
    registry = BackendRegistry()
    registry._plugin = "plugin-a"
    registry("dup", _Transport)
    registry._plugin = "plugin-b"
    with pytest.raises(ValueError, match="registered twice") as info:
        registry("DUP", _Transport)
    assert "plugin-a" in str(info.value) and "plugin-b" in str(info.value)
    assert registry.specs()["dup"].plugin == "plugin-a"


def test_registering_without_capabilities_is_a_type_error() -> None:
    registry = BackendRegistry()
    registry._plugin = "plugin-c"
    with pytest.raises(TypeError, match="plugin-c"):
        registry("nocaps", lambda: object())
    assert registry.specs() == {}


def test_specs_is_a_copy() -> None:
    registry = BackendRegistry()
    registry("a", _Transport)
    registry.specs().clear()
    assert list(registry.specs()) == ["a"]


# ------------------------------------------------------------------------ command line


def run_cli(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop(ENV_VAR, None)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(pythonpath), env.get("PYTHONPATH")) if p
        )
    return subprocess.run(
        [sys.executable, "-m", "rpcx", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=pythonpath,
        timeout=SUBPROCESS_TIMEOUT,
        check=False,
    )


def _entry(out: str, name: str) -> str:
    """The lines of ``name``'s entry in ``rpcx backends``'s default listing, joined: its
    first line (name, plugin) and the indented ones below it (description, capabilities)."""
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(name))
    end = next((i for i in range(first + 1, len(lines)) if not lines[i].startswith(" ")),
               len(lines))
    return "\n".join(lines[first:end])


def test_main_backends_listing(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["backends"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert [line.split() for line in lines[:3]] == [["name", "plugin"], ["description"],
                                                    ["capabilities"]]
    assert max(map(len, lines)) <= 80, out  # an 80-column terminal, the docs' code column
    auto = _entry(out, "auto")
    assert auto.startswith("auto (default)")
    assert auto.splitlines()[0].split()[-1] == "rpcx.backends.sockets"
    assert "shared memory" in auto.splitlines()[1]
    assert "multi_process, multi_host" in auto.splitlines()[2]
    gloo = _entry(out, "gloo")
    assert "(default)" not in gloo
    assert gloo.splitlines()[0].split() == ["gloo", "rpcx.backends.gloo"]
    assert "multi_process, multi_host" in gloo
    loopback = _entry(out, "loopback")
    assert "in_process" in loopback and "rpcx.backends.loopback" in loopback
    assert "(default)" not in loopback
    assert f"${ENV_VAR}" in out and "--wide" in out


def test_main_backends_wide_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["backends", "--wide"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["name", "capabilities", "plugin", "description"]
    auto = next(line for line in lines if line.startswith("auto"))
    assert auto.startswith("auto (default)")
    assert "rpcx.backends.sockets" in auto and "multi_process, multi_host" in auto
    gloo = next(line for line in lines if line.startswith("gloo"))
    assert "(default)" not in gloo
    assert "rpcx.backends.gloo" in gloo
    assert "multi_process, multi_host" in gloo
    loopback = next(line for line in lines if line.startswith("loopback"))
    assert "in_process" in loopback and "rpcx.backends.loopback" in loopback
    assert "(default)" not in loopback
    assert f"${ENV_VAR}" in out


def test_main_backends_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["backends", "--names"]) == 0
    assert capsys.readouterr().out.split() == backend_names()


def test_main_requires_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main([])
    assert info.value.code == 2
    assert "usage" in capsys.readouterr().err.lower()


@pytest.mark.commands
def test_python_m_rpcx_backends_names(tmp_path: Path) -> None:
    result = run_cli("backends", "--names", pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    names = result.stdout.split()
    assert {"gloo", "loopback"} <= set(names)
    assert names == sorted(names)


# ---------------------------------------------------------------------- third-party plugins


FAKE_PLUGIN = """\
from rpcx.hookspecs import hookimpl
from rpcx.transport import Capabilities


class FakeTransport:
    capabilities = Capabilities(multi_process=False, multi_host=False, in_process=True)

    def start(self, ctx):
        pass

    def send(self, dst, frame):
        pass

    def close(self, timeout):
        pass


@hookimpl
def rpcx_register_backends(register):
    register("fake", FakeTransport, description="a fake backend for tests")
"""

BROKEN_PLUGIN = """\
raise ImportError("broken_rpcx_plugin needs a library that is not installed")
"""

DUPLICATE_PLUGIN = """\
from rpcx.hookspecs import hookimpl
from rpcx.transport import Capabilities


class Again:
    capabilities = Capabilities(multi_process=True, multi_host=False)


@hookimpl
def rpcx_register_backends(register):
    register("loopback", Again, description="steals the loopback name")
"""


def install_plugin(root: Path, module: str, entry_name: str, source: str) -> None:
    """Write ``module.py`` and a dist-info that exposes it in the ``rpcx`` group."""
    (root / f"{module}.py").write_text(source)
    dist = root / f"{module}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        textwrap.dedent(
            f"""\
            Metadata-Version: 2.1
            Name: {module.replace("_", "-")}
            Version: 0.1
            """
        )
    )
    (dist / "entry_points.txt").write_text(f"[rpcx]\n{entry_name} = {module}\n")


@pytest.fixture
def fake_plugin_dir(tmp_path: Path) -> Path:
    install_plugin(tmp_path, "fake_rpcx_plugin", "fake", FAKE_PLUGIN)
    return tmp_path


@pytest.mark.commands
def test_third_party_plugin_is_discovered(fake_plugin_dir: Path) -> None:
    result = run_cli("backends", "--names", pythonpath=fake_plugin_dir)
    assert result.returncode == 0, result.stderr
    names = result.stdout.split()
    assert "fake" in names
    assert {"gloo", "loopback"} <= set(names)
    assert names == sorted(names)


@pytest.mark.commands
def test_third_party_plugin_in_table(fake_plugin_dir: Path) -> None:
    result = run_cli("backends", pythonpath=fake_plugin_dir)
    assert result.returncode == 0, result.stderr
    fake = _entry(result.stdout, "fake").splitlines()
    assert fake[0].split(maxsplit=1) == ["fake", "fake (fake_rpcx_plugin)"]
    assert fake[1:] == ["    a fake backend for tests", "    in_process, refuses_strangers"]
    assert "failed" not in result.stderr
    wide = run_cli("backends", "--wide", pythonpath=fake_plugin_dir)
    assert wide.returncode == 0, wide.stderr
    fake_row = next(line for line in wide.stdout.splitlines() if line.startswith("fake"))
    assert "fake (fake_rpcx_plugin)" in fake_row
    assert "in_process" in fake_row and "multi_process" not in fake_row
    assert "a fake backend for tests" in fake_row


@pytest.mark.commands
def test_third_party_plugin_resolves_in_process_code(fake_plugin_dir: Path) -> None:
    code = textwrap.dedent(
        """\
        from rpcx.registry import resolve_backend
        spec = resolve_backend("FAKE")
        transport = spec.factory()
        print(spec.name, spec.plugin, type(transport).__name__, spec.capabilities.in_process)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(fake_plugin_dir))
    env.pop(ENV_VAR, None)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=fake_plugin_dir,
        timeout=SUBPROCESS_TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["fake", "fake", "(fake_rpcx_plugin)", "FakeTransport", "True"]


@pytest.mark.commands
def test_broken_plugin_is_reported_and_others_still_listed(fake_plugin_dir: Path) -> None:
    install_plugin(fake_plugin_dir, "broken_rpcx_plugin", "broken", BROKEN_PLUGIN)
    result = run_cli("backends", pythonpath=fake_plugin_dir)
    assert result.returncode == 0, result.stderr
    assert "plugin 'broken' failed to load: ImportError" in result.stderr
    assert "needs a library that is not installed" in result.stderr
    listed = {line.split()[0] for line in result.stdout.splitlines() if line.strip()}
    assert {"fake", "gloo", "loopback"} <= listed

    names = run_cli("backends", "--names", pythonpath=fake_plugin_dir)
    assert names.returncode == 0, names.stderr
    assert {"fake", "gloo", "loopback"} <= set(names.stdout.split())
    assert "broken" not in names.stdout


@pytest.mark.commands
def test_plugin_stealing_a_builtin_name_is_reported(tmp_path: Path) -> None:
    install_plugin(tmp_path, "dupe_rpcx_plugin", "dupe", DUPLICATE_PLUGIN)
    result = run_cli("backends", pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "registered twice" in result.stderr
    assert "rpcx.backends.loopback" in result.stderr
    assert "dupe (dupe_rpcx_plugin)" in result.stderr
    loopback = next(line for line in result.stdout.splitlines() if line.startswith("loopback"))
    assert "rpcx.backends.loopback" in loopback  # the built-in keeps its name


MISSPELLED_PLUGIN = """\
from rpcx.hookspecs import hookimpl


@hookimpl
def rpcx_register_backends(registr):  # the hook's argument is "register"
    registr("misspelled", object)
"""

ORDERED_PLUGIN = """\
from rpcx.hookspecs import hookimpl
from rpcx.transport import Capabilities


class Impostor:
    capabilities = Capabilities(multi_process=True, multi_host=True)


@hookimpl({order}=True)
def rpcx_register_backends(register):
    register("gloo", Impostor, description="an impostor")
"""

HALF_PLUGIN = """\
from rpcx.hookspecs import hookimpl
from rpcx.transport import Capabilities


class Half:
    capabilities = Capabilities(multi_process=True, multi_host=False)


@hookimpl
def rpcx_register_backends(register):
    register("first-half", Half, description="registered before the failure")
    raise RuntimeError("the second half of this plugin is broken")
"""


@pytest.mark.commands
def test_plugin_pluggy_refuses_is_skipped_and_rpcx_still_works(fake_plugin_dir: Path) -> None:
    # pluggy refuses the hook implementation at registration (PluginValidationError):
    # that plugin is skipped with the reason shown, nothing else is affected.
    install_plugin(fake_plugin_dir, "misspelled_rpcx_plugin", "misspelled", MISSPELLED_PLUGIN)
    result = run_cli("backends", pythonpath=fake_plugin_dir)
    assert result.returncode == 0, result.stderr
    assert "plugin 'misspelled' failed to load: PluginValidationError" in result.stderr
    assert "registr" in result.stderr  # pluggy's message names the unknown argument
    listed = {line.split()[0] for line in result.stdout.splitlines()[1:] if line.strip()}
    assert {"fake", "gloo", "loopback"} <= listed and "misspelled" not in listed
    code = ("import rpcx; from rpcx.registry import resolve_backend; "
            "print(resolve_backend('gloo').plugin, sorted(rpcx.backend_names()))")
    env = dict(os.environ, PYTHONPATH=str(fake_plugin_dir))
    env.pop(ENV_VAR, None)
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=fake_plugin_dir, timeout=SUBPROCESS_TIMEOUT, check=False)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("rpcx.backends.gloo ") and "'fake'" in ran.stdout


@pytest.mark.commands
@pytest.mark.parametrize("order", ["trylast", "tryfirst"])
def test_plugin_cannot_take_a_builtin_name_whatever_its_order(tmp_path: Path, order: str) -> None:
    # pluggy calls trylast implementations first; rpcx registers built-ins before any
    # plugin, so the plugin is the one refused, and gloo stays rpcx's.
    install_plugin(tmp_path, "impostor_rpcx_plugin", "impostor", ORDERED_PLUGIN.format(order=order))
    result = run_cli("backends", pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ("plugin 'impostor' failed to register: ValueError: backend 'gloo' registered "
            "twice: by rpcx.backends.gloo and by impostor (impostor_rpcx_plugin)") in result.stderr
    gloo = next(line for line in result.stdout.splitlines() if line.startswith("gloo"))
    assert "rpcx.backends.gloo" in gloo and "impostor" not in gloo


@pytest.mark.commands
def test_plugin_that_fails_halfway_registers_nothing(fake_plugin_dir: Path) -> None:
    install_plugin(fake_plugin_dir, "half_rpcx_plugin", "half", HALF_PLUGIN)
    result = run_cli("backends", "--names", pythonpath=fake_plugin_dir)
    assert result.returncode == 0, result.stderr
    assert "first-half" not in result.stdout.split()
    assert "fake" in result.stdout.split()
    assert "the second half of this plugin is broken" in result.stderr


@pytest.mark.commands
def test_uninstalling_a_plugin_removes_its_backend(fake_plugin_dir: Path) -> None:
    assert "fake" in run_cli("backends", "--names", pythonpath=fake_plugin_dir).stdout.split()
    for path in fake_plugin_dir.iterdir():  # what `pip uninstall` removes
        if path.name.startswith("fake_rpcx_plugin"):
            if path.is_dir():
                for inner in path.iterdir():
                    inner.unlink()
                path.rmdir()
            else:
                path.unlink()
    result = run_cli("backends", "--names", pythonpath=fake_plugin_dir)
    # No trace of it: not listed, no load error (stderr may hold torch's own warnings,
    # such as numpy's absence in the tensorpipe session).
    assert result.returncode == 0 and "plugin" not in result.stderr, result.stderr
    assert "fake" not in result.stdout.split()
    assert result.stdout.split() == backend_names()


@pytest.mark.commands
def test_two_packages_declaring_one_entry_point_name_are_reported(tmp_path: Path) -> None:
    install_plugin(tmp_path, "fake_rpcx_plugin", "fake", FAKE_PLUGIN)
    install_plugin(tmp_path, "other_rpcx_plugin", "fake", FAKE_PLUGIN)
    result = run_cli("backends", pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "plugin 'fake (duplicate)' declared by 2 installed packages" in result.stderr
    assert "fake_rpcx_plugin" in result.stderr and "other_rpcx_plugin" in result.stderr
    assert any(line.startswith("fake") for line in result.stdout.splitlines())


@pytest.mark.commands
def test_a_builtin_backend_resolves_without_importing_plugins() -> None:
    # A fresh interpreter: init_rpc on a built-in backend imports no plugin module.
    code = ("import sys, rpcx.registry as r\n"
            "assert r.resolve_backend('gloo').name == 'gloo'\n"
            "print(sorted(m for m in sys.modules if m.startswith('rpcx_') or m == 'zmq'))\n"
            "print('zmq' in r.backend_names())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split("\n")
    assert out[0] == "[]", out
    plugins = [ep.name for ep in importlib.metadata.entry_points(group="rpcx")]
    assert out[1] == str("zmq" in plugins)  # the whole table still has every plugin
