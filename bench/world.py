"""Starting one world of workers, running workloads in it, and never waiting forever.

A *world* is one ``init_rpc`` group of one system: processes started with the ``spawn``
method (torch, gloo, tensorpipe), or, for loopback, one host process whose workers are
the threads of ``rpcx.spawn``. The rendezvous is a ``file://`` path in a fresh temporary
directory, so the transports listen on ports the OS picks and concurrent or leftover
worlds cannot collide. Across hosts (placement.py) each host is one process
(:mod:`host`, in the host's namespaces) that starts the host's ranks, and the
rendezvous is ``tcp://`` on host a's address; the rank files stay in the temporary
directory (the namespaces share the filesystem).

Every rank writes what it did to ``<tmp>/rank<r>.json`` (atomically, after every step):
the workloads it measured, errors with their tracebacks, the workload now running and
since when. The parent polls those files and the processes, and kills the world (by the
ids of the processes it started) when

* the world does not start within ``startup_s``,
* a workload runs past its budget,
* a rank failed and the others did not finish within a grace period,
* the measuring rank is done but shutdown does not finish within ``SHUTDOWN_GRACE_S``,
* or the whole world exceeds its total budget.

Whatever was measured before that is kept; what was not is reported as an error with
the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import multiprocessing as mp
import os
import pathlib
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import systems
from placement import Layout

STARTUP_S = 120.0  # spawn + import torch + init_rpc, up to 8 processes on 2 cores
SHUTDOWN_GRACE_S = 45.0
FAILURE_GRACE_S = 15.0
POLL_S = 0.2


@dataclasses.dataclass(frozen=True)
class WorldSpec:
    """What one world runs: its topology's entry point and the workloads to measure.

    ``entry`` names ``module:function`` (a bench module), called in every worker as
    ``function(rank, spec, init_method, recorder)``; it calls ``init_rpc`` and
    ``shutdown`` itself and measures ``workloads`` in order through ``recorder``.
    """

    entry: str
    system: str
    world_size: int
    workloads: tuple[str, ...]
    quick: bool
    label: str  # progress prefix, e.g. "round 2/3: gloo"
    budgets: dict[str, float]  # seconds each workload may take before the world is killed
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def total_budget(self) -> float:
        """The backstop: startup, every workload's budget, and shutdown."""
        return STARTUP_S + sum(self.budgets.get(w, 60.0) for w in self.workloads) + (
            SHUTDOWN_GRACE_S
        )


@dataclasses.dataclass
class WorldOutcome:
    """What came back from a world: results and errors per workload, and notes."""

    results: dict[str, Any]
    errors: dict[str, str]  # workload -> one-line reason
    tracebacks: dict[str, str]
    notes: list[str]
    wall_s: float
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)  # rank -> Recorder.fact


class Recorder:
    """A rank's record of its progress and measurements, rewritten after every step."""

    def __init__(self, path: pathlib.Path, label: str, rank: int) -> None:
        self.path = path
        self.label = label
        self.rank = rank
        self.state: dict[str, Any] = {
            "rank": rank, "results": {}, "errors": {}, "tracebacks": {}, "current": None,
            "done": False, "fatal": None, "exited": False, "facts": {},
        }
        self._flush()

    def _flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)

    def progress(self, what: str) -> None:
        """One progress line on stderr, prefixed with the world's label."""
        print(f"{self.label} {what} ...", file=sys.stderr, flush=True)

    def run(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Measure workload ``name`` as ``fn(*args, **kwargs)``; exceptions are recorded."""
        self.progress(name)
        self.state["current"] = {"name": name, "since": time.time()}
        self._flush()
        result: Any = None
        try:
            result = fn(*args, **kwargs)
            self.state["results"][name] = result
        except Exception as exc:
            self.state["errors"][name] = one_line(exc)
            self.state["tracebacks"][name] = traceback.format_exc()
            print(f"{self.label} {name}: error: {one_line(exc)}", file=sys.stderr, flush=True)
        self.state["current"] = None
        self._flush()
        return result

    def fact(self, key: str, value: Any) -> None:
        """Something about the world worth keeping (e.g. rpcx's routes), for the JSON."""
        self.state["facts"][key] = value
        self._flush()

    def done(self) -> None:
        """The measuring rank has measured everything; only shutdown is left."""
        self.state["done"] = True
        self._flush()

    def fatal(self, exc: BaseException) -> None:
        """The rank failed outside a workload (``init_rpc``, ``shutdown``, ...)."""
        self.state["fatal"] = one_line(exc)
        self.state["tracebacks"]["<fatal>"] = "".join(
            traceback.format_exception(type(exc), exc, exc.__traceback__)
        )
        self._flush()

    def exited(self) -> None:
        """The rank's entry point returned."""
        self.state["exited"] = True
        self._flush()


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, short enough for a table footnote."""
    text = str(exc).strip().splitlines()
    message = text[0] if text else ""
    if len(message) > 160:
        message = message[:157] + "..."
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _entry(spec: WorldSpec) -> Callable[..., None]:
    module, _, function = spec.entry.partition(":")
    fn: Callable[..., None] = getattr(importlib.import_module(module), function)
    return fn


_NOISE = (
    "You are using a Backend",  # torch's RPC init, on its own gloo group
    "support for functional optimizers is deprecated",  # DistributedOptimizer, forced "always"
)


def _quiet() -> None:
    """Drop two deprecation warnings torch prints in every world, whatever the system."""
    show = warnings.showwarning

    def showwarning(message: Any, category: Any, filename: str, lineno: int,
                    file: Any = None, line: str | None = None) -> None:
        if not any(noise in str(message) for noise in _NOISE):
            show(message, category, filename, lineno, file, line)

    if not getattr(show, "_bench_quiet", False):  # once per process (loopback: N threads)
        showwarning._bench_quiet = True  # type: ignore[attr-defined]
        warnings.showwarning = showwarning


def rank_main(rank: int, spec: WorldSpec, tmp: str, init_method: str | None = None
              ) -> None:
    """Run ``spec``'s entry point as ``rank`` (a process, or a loopback thread);
    ``init_method`` defaults to a file in ``tmp``."""
    _quiet()
    recorder = Recorder(pathlib.Path(tmp) / f"rank{rank}.json", spec.label, rank)
    init_method = init_method or "file://" + os.path.join(tmp, "rendezvous")
    try:
        _entry(spec)(rank, spec, init_method, recorder)
    except BaseException as exc:
        recorder.fatal(exc)
        raise
    recorder.exited()


def _process_main(rank: int, spec: WorldSpec, tmp: str, init_method: str | None = None
                  ) -> None:
    try:
        rank_main(rank, spec, tmp, init_method)
    except BaseException:
        os._exit(1)  # the traceback is in the rank file; skip torch's exit handlers


def _loopback_host(spec: WorldSpec, tmp: str) -> None:
    """The one process of a loopback world: its ranks are ``rpcx.spawn``'s threads."""
    import rpcx

    try:
        rpcx.spawn(rank_main, args=(spec, tmp), nprocs=spec.world_size, backend="loopback")
    except BaseException:
        os._exit(1)


class HostProcess:
    """One host's process (:mod:`host`) of a world across hosts, with the interface of a
    ``multiprocessing.Process`` that :func:`run_world` uses. It leads a session of its
    own: ``kill`` ends it with every rank it started (and Ctrl-C reaches only this
    process, which then kills them)."""

    def __init__(self, argv: list[str], env: dict[str, str], who: str) -> None:
        self.who = who
        self._popen = subprocess.Popen(argv, env=env, start_new_session=True)
        self.pid: int | None = self._popen.pid

    def start(self) -> None:
        """Started already (in ``__init__``)."""

    def is_alive(self) -> bool:
        """Whether the host process still runs."""
        return self._popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        """Its exit status (negative: the signal), ``None`` while it runs."""
        return self._popen.poll()

    def kill(self) -> None:
        """SIGKILL to its whole process group: the host process and its ranks."""
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.killpg(self._popen.pid, signal.SIGKILL)

    def join(self, timeout: float) -> None:
        """Wait for it, at most ``timeout`` seconds."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)


def _start_hosts(spec: WorldSpec, layout: Layout, tmp: str, procs: list[Any]) -> None:
    """One :class:`HostProcess` per host, each starting the ranks placed on it; appended
    to ``procs`` as they start (so that a failure leaves none unkilled)."""
    with open(os.path.join(tmp, "spec.pickle"), "wb") as file:
        pickle.dump(spec, file)
    init_method = layout.init_method()
    script = str(pathlib.Path(__file__).resolve().parent / "host.py")
    for host in (0, 1):
        ranks = [r for r in range(spec.world_size) if layout.host_of(r) == host]
        variables = systems.interface_variables(spec.system, layout.hosts.interfaces[host])
        argv = layout.host_command(host, [sys.executable, script, tmp,
                                          ",".join(map(str, ranks)), str(init_method)])
        procs.append(HostProcess(argv, layout.host_environment(host, variables),
                                 f"host {'ab'[host]} (ranks {', '.join(map(str, ranks))})"))


def host_main(argv: list[str]) -> int:
    """The body of host.py: start this host's ranks (``argv``: the world's tmp dir, the
    ranks, the init method) and wait for them, at most the world's total budget."""
    tmp, ranks_text, init_method = argv
    with open(os.path.join(tmp, "spec.pickle"), "rb") as file:
        spec: WorldSpec = pickle.load(file)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_process_main, args=(int(rank), spec, tmp, init_method),
                         daemon=True)
             for rank in ranks_text.split(",")]
    for proc in procs:
        proc.start()
    # The parent kills this host sooner when a world hangs; this bound is for a parent
    # that is gone.
    deadline = time.monotonic() + spec.total_budget() + SHUTDOWN_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    return 1 if any(proc.exitcode for proc in procs) else 0


def run_world(spec: WorldSpec, layout: Layout | None = None) -> WorldOutcome:
    """Start ``spec``'s world (placed as ``layout`` says: one host by default), wait for
    it within its budgets, and collect its records."""
    tmp = tempfile.mkdtemp(prefix="rpcx-bench-")
    ctx = mp.get_context("spawn")
    started = time.monotonic()
    procs: list[Any] = []
    reason: str | None = None
    notes: list[str] = []
    killed: set[int] = set()
    try:
        if layout is not None and layout.across:
            try:
                _start_hosts(spec, layout, tmp, procs)
            except (OSError, subprocess.SubprocessError, ValueError) as exc:
                reason = f"the hosts did not start: {one_line(exc)}"
        elif systems.backend_of(spec.system) == "loopback":
            procs.append(ctx.Process(target=_loopback_host, args=(spec, tmp), daemon=True))
        else:
            procs.extend(
                ctx.Process(target=_process_main, args=(rank, spec, tmp), daemon=True)
                for rank in range(spec.world_size)
            )
        for proc in procs:
            proc.start()
        if reason is None:
            reason = _wait(spec, procs, tmp, started)
    finally:
        stragglers = [p for p in procs if p.pid is not None and p.is_alive()]
        for proc in stragglers:
            proc.kill()
            killed.add(proc.pid)
        for proc in procs:
            if proc.pid is not None:
                proc.join(timeout=10)
        if stragglers and reason is None:
            reason = "interrupted"
        records = _read_records(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    wall_s = time.monotonic() - started

    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    tracebacks: dict[str, str] = {}
    fatal: str | None = None
    facts: dict[str, Any] = {}
    for record in records:
        if record.get("facts"):
            facts[str(record["rank"])] = record["facts"]
        results.update(record["results"])
        errors.update(record["errors"])
        for key, text in record["tracebacks"].items():
            tracebacks[key if key != "<fatal>" else f"<fatal rank {record['rank']}>"] = text
        if record["fatal"] and fatal is None:
            fatal = f"rank {record['rank']}: {record['fatal']}"
    measured = any(r["done"] for r in records)
    if reason and measured:
        notes.append(f"{spec.label}: {reason} (after all workloads were measured)")
    elif fatal and measured:
        notes.append(f"{spec.label}: after measuring, {fatal}")
    codes = [p.exitcode for p in procs]
    for index, proc in enumerate(procs):
        if proc.exitcode and proc.pid not in killed:
            who = getattr(proc, "who", None) or (
                "the loopback host process"
                if systems.backend_of(spec.system) == "loopback" else f"rank {index}")
            notes.append(f"{spec.label}: {who} exited with {_exit_text(proc.exitcode)}"
                         + (" after all workloads were measured" if measured else ""))
    for workload in spec.workloads:
        if workload in results or workload in errors:
            continue
        if reason:
            errors[workload] = f"not run: {reason}"
        elif fatal:
            errors[workload] = f"not run: {fatal}"
        else:
            errors[workload] = f"no result (exit codes {codes})"
    return WorldOutcome(results, errors, tracebacks, notes, wall_s, facts)


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _wait(spec: WorldSpec, procs: list[Any], tmp: str, started: float) -> str | None:
    """Poll until the world ends; the reason it had to be killed, or ``None``."""
    total = spec.total_budget()
    failed_at: float | None = None
    done_at: float | None = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        elapsed = now - started
        if elapsed > total:
            return f"world exceeded its total budget of {total:.0f} s"
        records = _read_records(tmp)
        running = [r["current"] for r in records if r["current"]]
        for current in running:
            budget = spec.budgets.get(current["name"], 60.0)
            if time.time() - current["since"] > budget:
                return f"{current['name']} exceeded its budget of {budget:.0f} s (hung?)"
        begun = running or any(r["done"] or r["results"] or r["errors"] for r in records)
        if not begun and elapsed > STARTUP_S:
            return f"world did not start within {STARTUP_S:.0f} s"
        if any(r["done"] for r in records):
            done_at = done_at or now
            if now - done_at > SHUTDOWN_GRACE_S:
                return f"shutdown did not finish within {SHUTDOWN_GRACE_S:.0f} s"
        if any(p.exitcode not in (None, 0) for p in procs) or any(r["fatal"] for r in records):
            failed_at = failed_at or now
            if now - failed_at > FAILURE_GRACE_S:
                fatal = next((r for r in records if r["fatal"]), None)
                what = f"rank {fatal['rank']}: {fatal['fatal']}" if fatal else (
                    f"a worker died (exit codes {[p.exitcode for p in procs]})"
                )
                return f"{what}; the others did not finish within {FAILURE_GRACE_S:.0f} s"
        time.sleep(POLL_S)
    return None


def _read_records(tmp: str) -> list[dict[str, Any]]:
    records = []
    for path in sorted(pathlib.Path(tmp).glob("rank*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # being replaced right now; read again next poll
    return records
