"""The test matrix: ``nox -s tests`` runs the suite once per backend, built-in or plugin.

Sessions: tests (loopback, auto, gloo, tensorpipe and zmq; or ``-- --backends=...``,
which also knows tcp and ``faulty:gloo``, the RRef and autograd kit under injected
faults), long (the long runs ``tests`` leaves out),
programs (examples, seed and docs programs), commands (rpcx's commands and start-up in
fresh interpreters), seeds (the seed programs on tensorpipe and torch), clients (TorchRL,
PyG and fairscale unchanged on every multi-process backend), no_torch_rpc (rpcx on a
torch without distributed RPC), beyond_tests (what CI runs after tests: the tcp and
faulty:gloo passes, programs, commands, long, no_torch_rpc, clients, typecheck and docs
in one environment),
examples(backend), demo, soak, lint, typecheck, docs (the site, built strictly and
tested in a browser), bench, and torch_suite(backend) (torch's own RPC tests run against
rpcx; long, so not a default).
Every session installs through constraints.txt, which pins torch==2.13.0.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import nox
import nox.command

nox.options.sessions = ["tests", "lint", "typecheck", "docs"]
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"  # torch==2.13.0's CPU wheel on this project's machines is for 3.11
BUILTIN_BACKENDS = ["loopback", "auto", "tcp", "gloo", "tensorpipe"]
# Backends shipped as separate packages under plugins/: backend name -> package directory.
PLUGINS = {"zmq": "plugins/rpcx-zmq"}
# The faulty:gloo pass: the kit's RRef and distributed autograd classes on gloo, with
# rpcx's bookkeeping dropped and every kind of frame duplicated now and then (rpcx.faulty).
FAULTY = "faulty:gloo"
_BOOKKEEPING = ("RREF_FETCH", "RREF_FORKS", "RREF_DELETE", "RREF_CONFIRM", "AUTOGRAD_BACKWARD",
                "AUTOGRAD_RELEASE", "AUTOGRAD_RUN", "AUTOGRAD_CHAIN", "AUTOGRAD_CHAIN_END")
FAULTS = json.dumps({
    "drop": dict.fromkeys(_BOOKKEEPING, 0.05),
    "duplicate": dict.fromkeys(("CALL", "REMOTE_CALL", "RESULT", "ERROR", "HEARTBEAT",
                                *_BOOKKEEPING), 0.1),
    "seed": 11,
})
FAULTY_TESTS = "TestRRef or TestDistAutograd"  # (every RRef and autograd class of the kit)
TRANSPORTS = BUILTIN_BACKENDS + list(PLUGINS)
BACKENDS = [*TRANSPORTS, FAULTY]  # the passes ``nox -s tests -- --backends=...`` knows
# The passes ``nox -s beyond_tests`` runs instead of ``nox -s tests`` (CI runs both), so
# the README's command stays well under 10 minutes here: tcp is auto's transport with
# TCP for every pair, whose route auto's own pass checks across two network namespaces,
# and faulty:gloo is fault injection, like the long runs (together ~95 s of ~540).
PASSES_BEYOND = ["tcp", FAULTY]
DEFAULT_PASSES = [b for b in BACKENDS if b not in PASSES_BEYOND]  # ``nox -s tests``
CONSTRAINTS = ("-c", "constraints.txt")


def _install(session: nox.Session, extras: str = "") -> None:
    # Keep Python's bytecode cache, and with it pytest's cache of rewritten test modules,
    # even where the shell sets PYTHONDONTWRITEBYTECODE (this machine's does): without it
    # every pytest process compiles the test modules again, 4-5 s of CPU each, and every
    # pass starts two (measured: collection 10.7 s -> 6.1 s). An empty value is unset.
    session.env["PYTHONDONTWRITEBYTECODE"] = ""
    session.install(*CONSTRAINTS, "torch==2.13.0")
    session.install(*CONSTRAINTS, "-e", f".[{extras}]" if extras else ".")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Unit tests plus the conformance kit and lifecycle tests on loopback, auto, gloo,
    tensorpipe and the zmq plugin, one after another, in one environment (installing
    torch is most of an environment's set-up, ~30 s each); the tcp and faulty:gloo
    passes run in ``beyond_tests``.

    ``nox -s tests -- --backends=auto,zmq`` runs some backends (any of ``BACKENDS``,
    tcp and faulty:gloo included); other arguments after
    ``--`` go to pytest (``nox -s tests -- --backends=loopback -k rref``). A plugin's
    backend runs the plugin's own tests (the kit and its own checks), with the plugin
    installed as a user would install it, and uninstalled after. Every backend runs even
    when one fails; the session fails naming them.
    """
    backends, pytest_args = DEFAULT_PASSES, list(session.posargs)
    for arg in list(pytest_args):
        if arg.startswith("--backends="):
            backends = [b for b in arg.split("=", 1)[1].split(",") if b]
            pytest_args.remove(arg)
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        session.error(f"unknown backends {unknown}; known: {', '.join(BACKENDS)}")
    _install(session, "test")
    failed = _test_backends(session, backends, pytest_args)
    if failed:
        session.error(f"tests failed on: {', '.join(failed)}")


def _test_backends(session: nox.Session, backends: list[str], pytest_args: list[str]
                   ) -> list[str]:
    """Run each backend's pass, every one even when one fails; the ones that failed."""
    failed = []
    for backend in backends:
        session.log(f"===== tests on backend {backend!r}")
        try:
            _test_backend(session, backend, pytest_args)
        except nox.command.CommandFailed as exc:
            failed.append(backend)
            if str(exc.reason) in ("Returned code 124", "Returned code 137"):  # timeout's
                session.warn(f"the {backend!r} pass was stopped at its limit of {PASS_LIMIT} s "
                             "(a hang? the stacks of a hung test come before this line)")
    return failed


# A hard limit on each backend's pass (the slowest takes ~4 min): a hang that even the
# per-test backstop (rpcx.testing.backstop) cannot end fails the pass, not all of CI.
# $RPCX_PASS_LIMIT overrides it (seconds).
PASS_LIMIT = int(os.environ.get("RPCX_PASS_LIMIT", "900"))


def _bounded(*command: str) -> tuple[str, ...]:
    """``command`` under coreutils' ``timeout``: SIGTERM at PASS_LIMIT, SIGKILL 30 s on."""
    return ("timeout", "--kill-after=30", str(PASS_LIMIT), *command)


# What ``tests`` leaves to sessions of their own, which CI runs: the long runs (``long``),
# the whole programs users run (``programs``: examples, seed programs, the docs'), rpcx's
# commands and start-up in fresh interpreters (``commands``), and rpcx on a torch without
# RPC (``no_torch_rpc``, which runs those tests on every backend).
DEFAULT_MARKS = "not long and not program and not commands and not no_torch_rpc"
# The backends whose passes of ``tests`` ran the ``commands`` tests that take a backend.
COMMANDS_BACKENDS = ["auto", "gloo", "tensorpipe"]


def _test_backend(session: nox.Session, backend: str, pytest_args: list[str]) -> None:
    # loadscope: one group per test class (each has its own world) or module.
    pytest = _bounded("pytest", "-n", "2", "--dist", "loadscope", "-m", DEFAULT_MARKS,
                      f"--rpcx-backend={backend}")
    if backend in PLUGINS:
        session.install(*CONSTRAINTS, "-e", PLUGINS[backend])
        try:
            with session.chdir(PLUGINS[backend]):
                session.run(*pytest, "tests", *pytest_args, external=True)
        finally:
            session.run("python", "-m", "pip", "uninstall", "-q", "-y", f"rpcx-{backend}")
        return
    if backend != "loopback":
        # Tests that do not depend on the backend ran in the loopback session already.
        pytest += ("--only-backend-tests",)
    if backend == FAULTY:
        # ``RPCX_FAULTS=...`` overrides the faults (JSON of rpcx.faulty.Faults).
        # (every tensor as a buffer, as in the tcp pass: gloo's path for small buffers)
        env = {"RPCX_FAULTS": os.environ.get("RPCX_FAULTS") or FAULTS,
               "RPCX_INLINE_MAX_BYTES": "0"}
        session.run(*pytest, "tests/test_conformance.py", "-k", FAULTY_TESTS, *pytest_args,
                    env=env, external=True)
        return
    if backend == "tcp":
        # auto's transport with TCP for every pair: the conformance kit checks it as a
        # transport; the programs and tools above it (examples, CLI, lifecycle) ran on
        # auto, which shares all of its code but the socket (~2 min saved). Its pairs
        # connect on demand (SocketRpcBackendOptions.connect_on_demand), so the kit
        # checks that way of connecting too; auto's pass connects every pair up front.
        # Small tensors travel as buffers here (RPCX_INLINE_MAX_BYTES=0), where auto's
        # pass sends them in the header: the kit checks both paths of the socket code.
        session.run(*pytest, "tests/test_conformance.py", *pytest_args,
                    env={"RPCX_CONNECT_ON_DEMAND": os.environ.get("RPCX_CONNECT_ON_DEMAND",
                                                                  "1"),
                         "RPCX_INLINE_MAX_BYTES": "0"}, external=True)
        return
    if backend == "tensorpipe":
        # torch's own TensorPipe init_rpc needs numpy; rpcx's tensorpipe backend must not.
        session.run("python", "-m", "pip", "uninstall", "-q", "-y", "numpy")
        try:
            session.run(*pytest, *pytest_args, external=True)
        finally:
            session.install(*CONSTRAINTS, "numpy")
        # (nox -s seeds runs the seed programs on tensorpipe, with numpy: they import it.)
        return
    session.run(*pytest, *pytest_args, external=True)


# loopback cannot run torch's suite: its tests are processes (see torch_suite/README.md).
# "torch" runs the same tests on torch.distributed.rpc's own agent, for comparison.
TORCH_SUITE_BACKENDS = ["auto", "gloo", "tensorpipe", "torch"]


@nox.session(python=PYTHON)
@nox.parametrize("backend", TORCH_SUITE_BACKENDS)
def torch_suite(session: nox.Session, backend: str) -> None:
    """torch's RPC test suite on ``backend``; known failures are xfail (strict).

    Prints the counts and writes torch_suite/results/<backend>.txt (one line per test)
    and <backend>.xml (junit). Pass pytest arguments after ``--``, e.g.
    ``-- --torch-suite-raw`` (no xfail marks) or ``-- -k DistAutograd``.
    """
    _install(session, "torch-suite")
    session.run(
        "pytest", "torch_suite", f"--torch-suite-backend={backend}",
        "-n", "2", "--timeout=240", "-p", "no:cacheprovider",
        "-W", "ignore::DeprecationWarning",
        f"--junitxml=torch_suite/results/{backend}.xml",
        *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )


@nox.session(python=PYTHON)
@nox.parametrize("backend", TRANSPORTS)
def examples(session: nox.Session, backend: str) -> None:
    """Run the example programs on ``backend``."""
    _install(session)
    if backend in PLUGINS:
        session.install(*CONSTRAINTS, "-e", PLUGINS[backend])
    for script in ("examples/demo.py", "examples/torch_style.py"):
        session.run("python", script, env={"RPCX_BACKEND": backend})
    session.run("python", "examples/ddp_rpc/main.py", "--backend", backend, "--epochs", "2")
    session.run("python", "examples/rl/main.py", "--backend", backend, "--target", "60")
    session.run("python", "examples/rnn/main.py", "--backend", backend, "--epochs", "3")
    session.run("python", "examples/parameter_server/main.py", "--backend", backend)
    session.run("python", "examples/batch_rpc/main.py", "--backend", backend)


# Libraries built on torch.distributed.rpc, run unchanged with RPCX_FOR_TORCH=1
# (tests/clients/): the version pinned is one that resolves with torch 2.13.0.
CLIENTS = ["torchrl==0.14.1", "torch-geometric==2.8.1", "fairscale==0.4.13"]


@nox.session(python=PYTHON)
def clients(session: nox.Session) -> None:
    """Libraries that import torch.distributed.rpc themselves (TorchRL, PyG, fairscale's
    DistributedPipeline), on torch and on every multi-process rpcx backend with the switch
    on: the same results on each."""
    _install(session, "test")
    _run_clients(session)


def _run_clients(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, *CLIENTS)
    session.install(*CONSTRAINTS, "-e", PLUGINS["zmq"])  # a plugin's backend too
    # Three at a time on two cores: a program waits on its workers' start and shutdown,
    # which leaves a core idle at times with two (measured while the programs still
    # started a forkserver: 366 s with -n 2, 322 s with -n 3; 155 s since they fork).
    session.run(*_bounded("pytest", "-n", "3", "tests/clients", *session.posargs),
                env={"RPCX_REQUIRE_CLIENTS": "1"}, external=True)


@nox.session(python=PYTHON)
def programs(session: nox.Session) -> None:
    """The whole programs users run, each in fresh interpreters (tests marked
    ``program``): the examples on loopback and the default backend (auto), ddp_rpc on
    GPUs on tensorpipe (it skips without two), the seed programs on auto, ddp_rpc traced
    and a program profiled beside torch's on auto, and every program in the README and
    docs/ that states its output."""
    _install(session, "test")
    _run_programs(session)


def _run_programs(session: nox.Session) -> None:
    pytest = _bounded("pytest", "-n", "2", "-m", "program", "tests")
    session.run(*pytest, "--rpcx-backend=loopback", "--rpcx-backend=auto", *session.posargs,
                external=True)
    session.run(*pytest, "--rpcx-backend=tensorpipe", "-k", "gpus", *session.posargs,
                external=True)


@nox.session(python=PYTHON)
def commands(session: nox.Session) -> None:
    """rpcx's commands and start-up, each in fresh interpreters (tests marked
    ``commands``): ``rpcx launch``/``bench``, ``python -m rpcx backends`` with plugins
    installed and broken, the torch switch's start-up hook, the kit command, the
    backstop, numpy's absence, a 16-worker ``rpcx launch`` that prints nothing; on
    loopback, then the ones that take a backend on auto, gloo and tensorpipe."""
    _install(session, "test")
    _run_commands(session)


def _run_commands(session: nox.Session) -> None:
    session.run(*_bounded("pytest", "-n", "2", "--dist", "loadscope", "-m", "commands",
                          "--rpcx-backend=loopback", "tests", *session.posargs),
                external=True)
    for backend in COMMANDS_BACKENDS:  # (a few tests each: one process is quicker)
        session.run(*_bounded("pytest", "-m", "commands", f"--rpcx-backend={backend}",
                              "--only-backend-tests", "tests", *session.posargs),
                    external=True)


@nox.session(python=PYTHON)
def long(session: nox.Session) -> None:
    """The long runs (tests marked ``long``, minutes each), left out of ``nox -s tests``
    to keep it within ten minutes: the churn's 100 departures and joins in a row, and
    the kit's partitions across two namespaces on every multi-host backend."""
    _install(session, "test")
    _run_long(session)


def _run_long(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "-e", PLUGINS["zmq"])  # (the kit's long tests run on it)
    session.run(*_bounded("pytest", "-m", "long", "tests", *session.posargs),
                external=True)


@nox.session(python=PYTHON)
def no_torch_rpc(session: nox.Session) -> None:
    """rpcx on a torch whose distributed RPC is missing (tests/no_torch_rpc makes every
    process of the session see one): the conformance kit on loopback, auto, gloo and
    the zmq plugin; tensorpipe, which needs torch's RPC, must refuse and say why."""
    _install(session, "test")
    _run_no_torch_rpc(session)


def _run_no_torch_rpc(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "-e", PLUGINS["zmq"])
    env = {"PYTHONPATH": os.path.join(os.getcwd(), "tests", "no_torch_rpc"),
           "RPCX_TEST_WITHOUT_TORCH_RPC": "1"}
    for backend in ["loopback", "auto", "gloo", "zmq"]:
        session.run(*_bounded("pytest", "-n", "2", "--dist", "loadscope",
                              f"--rpcx-backend={backend}", "tests/test_conformance.py",
                              "tests/test_without_torch_rpc.py", *session.posargs),
                    env=env, external=True)
    session.run(*_bounded("pytest", "--rpcx-backend=tensorpipe",
                          "tests/test_without_torch_rpc.py", *session.posargs),
                env=env, external=True)


def _run_passes_beyond(session: nox.Session) -> None:
    failed = _test_backends(session, PASSES_BEYOND, list(session.posargs))
    if failed:
        raise nox.command.CommandFailed(f"tests failed on: {', '.join(failed)}")


@nox.session(python=PYTHON)
def beyond_tests(session: nox.Session) -> None:
    """What CI runs after ``nox -s tests``, in one environment (each session's own costs
    about a minute to make): the ``tcp`` and ``faulty:gloo`` passes of ``tests``
    (``PASSES_BEYOND``), ``programs``, ``commands``, ``long``, ``no_torch_rpc``, then
    ``clients`` (after those: it installs the client libraries and the zmq plugin), then
    ``typecheck`` and ``docs``. Every one runs even when one fails; the session fails
    naming them. Arguments after ``--`` go to each pytest (not to ``typecheck``)."""
    _install(session, "test,typecheck,docs")
    steps = [("passes " + " ".join(PASSES_BEYOND), _run_passes_beyond),
             ("programs", _run_programs), ("commands", _run_commands), ("long", _run_long),
             ("no_torch_rpc", _run_no_torch_rpc), ("clients", _run_clients),
             ("typecheck", _run_typecheck), ("docs", _run_docs)]
    failed = []
    for name, step in steps:
        session.log(f"===== {name}")
        started = time.monotonic()
        try:
            step(session)
        except nox.command.CommandFailed:
            failed.append(name)
        session.log(f"===== {name}: {time.monotonic() - started:.0f} s")
    if failed:
        session.error(f"failed: {', '.join(failed)}")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The README's main job: DDP + RPC training (examples/ddp_rpc) on the default backend."""
    _install(session)
    session.install(*CONSTRAINTS, "numpy")  # rpcx does not need it; torch warns without it
    session.run("python", "examples/ddp_rpc/main.py", *session.posargs)


@nox.session(python=PYTHON)
def seeds(session: nox.Session) -> None:
    """The seed programs (tests/test_seed_programs.py) beyond ``nox -s programs``, which
    runs them on the default backend (auto): on rpcx's tensorpipe backend, and on
    torch.distributed.rpc itself (their output checks hold there too). Run it when a
    program, a check or the tensorpipe backend changes (~3 min)."""
    _install(session, "test")
    seeds = ("pytest", "-n", "2", "tests/test_seed_programs.py", *session.posargs)
    session.run(*seeds, "--rpcx-backend=tensorpipe")
    session.run(*seeds, "--rpcx-backend=auto", "--seeds-on-torch", "-k", "on_torch")


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """The soak (rpcx.testing.soak): four workers, mixed calls, RRef cycles and backward
    passes with faults injected, for 400 rounds (~170,000 calls); fails if a reply is
    wrong or lost, anything is left at the end, or memory grows past 10% after warm-up.

    Arguments after ``--`` go to it: ``nox -s soak -- --rounds 2000 --backend faulty:auto``
    (plugin backends are installed). Writes soak/results/soak-<time>.json.

    ``nox -s soak -- --churn`` runs the churn instead (rpcx.testing.churn): a dynamic
    world of 8 whose last 4 ranks leave (every 4th by ``kill -9``) and are joined again,
    300 times in a row by default, while the others call, pass RRefs and run backward
    passes; fails if a join fails, a call hangs or fails without naming the departed
    worker, or anything is left. ``-- --churn --cycles 1000 --backend gloo``.
    """
    _install(session, "test")
    for directory in PLUGINS.values():
        session.install(*CONSTRAINTS, "-e", directory)
    args = list(session.posargs)
    churn = "--churn" in args
    if churn:
        args.remove("--churn")
    kind = "churn" if churn else "soak"
    if not any(a.startswith("--json") for a in args):
        args += ["--json", f"soak/results/{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"]
    if not churn and not any(a.startswith("--rounds") for a in args):
        args += ["--rounds", "400"]
    if churn and not any(a.startswith("--cycles") for a in args):
        args += ["--cycles", "300"]
    os.makedirs("soak/results", exist_ok=True)
    session.run("python", "-m", f"rpcx.testing.{kind}", *args)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The documentation site: ``mkdocs build --strict`` into build/site (a warning, a
    broken link or anchor, a page missing from the navigation fails it), then
    tests/test_docs_site.py opens every page in headless Chromium (Debian's ``chromium``;
    the test skips, saying so, where it is absent): console errors, links, navigation,
    search, the API reference. Arguments after ``--`` go to pytest."""
    _install(session, "docs")
    _run_docs(session)


def _run_docs(session: nox.Session) -> None:
    site = os.path.join("build", "site")
    session.run("mkdocs", "build", "--strict", "--site-dir", site,
                env={"NO_MKDOCS_2_WARNING": "1"})
    session.run("pytest", "tests/test_docs_site.py", "-p", "no:cacheprovider", *session.posargs,
                env={"RPCX_DOCS_SITE": os.path.abspath(site)})


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff, and lint-imports: the layers declared in pyproject.toml hold (no import from
    a lower layer to a higher one, type-only imports included)."""
    session.install("ruff>=0.6", "import-linter>=2.1")
    session.run("ruff", "check", ".")
    # (import-linter reads the source; it finds rpcx on the path without installing it)
    session.run("lint-imports", env={"PYTHONPATH": os.getcwd()})


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict over rpcx/ and every plugin's package."""
    _install(session, "typecheck")
    _run_typecheck(session)


def _run_typecheck(session: nox.Session) -> None:
    session.run("mypy")
    for directory in PLUGINS.values():
        session.install(*CONSTRAINTS, "-e", directory)  # its dependencies' types too
        session.run("mypy", f"{directory}/src")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """rpcx backends against torch.distributed.rpc, side by side (not a test).

    Every plugin under plugins/ is installed, so its backend runs beside the built-ins.
    Runs bench/run.py: every workload, both sweeps and the raw floors; the table on
    stdout, JSON and plots in bench/results/. Arguments after ``--`` go to it, e.g.
    ``nox -s bench -- --quick --rounds 1`` or ``-- --only rpc_sync,size_sweep``. Then
    bench/guard.py judges that run: a line far under its usual ratio to torch
    (bench/guard.json) is run again, and fails the session if it stays there.

    Then bench/examples.py: the example programs on every system, torch included, with
    its own defaults (all examples, 3 rounds); of the arguments after ``--`` it gets
    only ``--quick``. Run it alone as ``python bench/examples.py ...`` for the rest.
    Then bench/world_sizes.py: 8 to 64 worker processes start, call each other and shut
    down, torch beside the default backend and gloo (``--quick``: one round). Last
    bench/start_methods.py: workers forked from a warm server against spawned ones, and
    bench/beside_bulk.py and bench/faults.py where this runs as root (small calls beside
    a bulk transfer between two namespaces on a shaped link; a slow link, a partition and
    a lone worker, torch beside rpcx).
    """
    _install(session, "bench")
    for directory in PLUGINS.values():  # their backends are measured too
        session.install(*CONSTRAINTS, "-e", directory)
    session.run("python", "bench/run.py", *session.posargs)
    # A line far under its usual ratio to torch is run again; still under: a regression
    # (exit 1 fails the session). 2: the run measured no line the guard has a floor for.
    session.run("python", "bench/guard.py", success_codes=[0, 2])
    quick = ["--quick"] if "--quick" in session.posargs else []
    session.run("python", "bench/examples.py", *quick)
    session.run("python", "bench/world_sizes.py", *quick)
    session.run("python", "bench/start_methods.py", *(["--rounds", "1"] if quick else []))
    if os.geteuid() == 0 and shutil.which("tc"):
        session.run("python", "bench/beside_bulk.py", *(["--rounds", "1"] if quick else []))
        session.run("python", "bench/faults.py",
                    *(["--systems", "torch,auto", "--lone-limit", "20"] if quick else []))
    else:
        session.log("bench/beside_bulk.py and bench/faults.py skipped: they need root and "
                    "tc (two namespaces)")
