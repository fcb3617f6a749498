"""The table's workloads and the two-worker world that measures most of them.

Every workload of the table is described by a :class:`Workload` (its unit, whether
higher is better, which world measures it, its time budget). The *pair* world (workers
``w0`` and ``w1``) runs, in one ``init_rpc``, every selected pair workload with ``w0``
measuring calls to ``w1``: the small-call benchmarks, the echoes, the RRef benchmarks,
the tutorial's RNN (``w1`` as its parameter server) and the message-size sweep (see
:mod:`sweeps`). The hybrid DDP + RPC workload has its own four-worker world
(:mod:`hybrid`), the idle cost its own two-worker world (:mod:`idle`) and the clients
sweep its own eight-worker one (:mod:`sweeps`).

Each measurement returns ``{"value": <in the workload's unit>, "samples": [...]}``
(samples in the same unit, one per batch or iteration) plus workload-specific fields.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from types import SimpleNamespace
from typing import Any

import calls
import rnn_model
import sweeps
import systems
import torch
from world import Recorder, WorldSpec

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Workload:
    """One row of the table (or one sweep)."""

    name: str
    label: str
    unit: str
    higher_is_better: bool
    topology: str  # "pair", "hybrid", "idle" or "clients"
    budget_s: float  # time the world gives it before it counts as hung
    kind: str = "scalar"  # "scalar": a table row; "sweep": a plot


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("start", "init_rpc of a two-worker world (w0's)", "ms", False, "pair", 30),
        Workload("rpc_sync", "small rpc_sync round trip", "us", False, "pair", 90),
        Workload("rpc_async", "small rpc_async throughput", "calls/s", True, "pair", 90),
        Workload("echo_1m", "1 MiB tensor echo", "GB/s", True, "pair", 90),
        Workload("echo_64m", "64 MiB tensor echo", "GB/s", True, "pair", 150),
        Workload("remote", "remote(...).to_here()", "us", False, "pair", 90),
        Workload("rref_proxy", "rref.rpc_sync().m(), remote owner", "us", False, "pair", 90),
        Workload("rnn", "distributed RNN (tutorial), per iteration", "ms", False, "pair", 180),
        Workload("hybrid", "DDP + RPC hybrid (4 procs), per epoch", "ms", False, "hybrid", 300),
        Workload("idle", "idle worker in shutdown(): CPU over 5 s", "% core", False, "idle",
                 60),
        Workload("idle_sleep", "idle worker in its own code: CPU over 5 s", "% core", False,
                 "idle", 60),
        Workload("size_sweep", "echo latency and GB/s per message size", "", True, "pair", 300,
                 kind="sweep"),
        Workload("clients_sweep", "aggregate rpc_sync calls/s, 1-7 clients", "calls/s", True,
                 "clients", 300, kind="sweep"),
    ]
}
PAIR_ORDER = [name for name, w in WORKLOADS.items() if w.topology == "pair"]
# One world measures both idle rows; selecting either selects both.
IDLE_ROWS = [name for name, w in WORKLOADS.items() if w.topology == "idle"]


# ------------------------------------------------------------------------ measurements


def _result(value: float, samples: list[float], **extra: Any) -> dict[str, Any]:
    return {"value": value, "samples": samples, **extra}


def measure_rpc_sync(ns: SimpleNamespace, peer: str, quick: bool) -> dict[str, Any]:
    """Microseconds per small ``rpc_sync``: median of batches of 200 calls."""
    rpc = ns.rpc
    for _ in range(100 if quick else 300):
        rpc.rpc_sync(peer, calls.small_add, args=(1, 2))
    batches = []
    for _ in range(8 if quick else 15):
        n = 200
        start = time.perf_counter()
        for _ in range(n):
            rpc.rpc_sync(peer, calls.small_add, args=(1, 2))
        batches.append((time.perf_counter() - start) / n * 1e6)
    return _result(statistics.median(batches), batches)


def measure_rpc_async(ns: SimpleNamespace, peer: str, quick: bool) -> dict[str, Any]:
    """Small ``rpc_async`` calls per second, all issued at once and then waited for."""
    rpc = ns.rpc
    n = 1000 if quick else 5000
    warmup = [rpc.rpc_async(peer, calls.small_add, args=(i, 1)) for i in range(200)]
    torch.futures.wait_all(warmup)
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        futures = [rpc.rpc_async(peer, calls.small_add, args=(i, 1)) for i in range(n)]
        torch.futures.wait_all(futures)
        rates.append(n / (time.perf_counter() - start))
    return _result(statistics.median(rates), rates, calls_per_batch=n)


def _echo(ns: SimpleNamespace, peer: str, nbytes: int, warmup: int, iterations: int
          ) -> dict[str, Any]:
    tensor = torch.ones(nbytes // 4, dtype=torch.float32)
    times = calls.echo_seconds(ns, peer, tensor, warmup, iterations)
    rates = [2 * nbytes / t / 1e9 for t in times]
    return _result(2 * nbytes / statistics.median(times) / 1e9, rates, bytes=nbytes)


def measure_echo_1m(ns: SimpleNamespace, peer: str, quick: bool) -> dict[str, Any]:
    """GB/s of a 1 MiB float32 tensor sent and returned (both directions counted)."""
    return _echo(ns, peer, MIB, warmup=20, iterations=50 if quick else 200)


def measure_echo_64m(ns: SimpleNamespace, peer: str, quick: bool) -> dict[str, Any]:
    """GB/s of a 64 MiB float32 tensor sent and returned (both directions counted).

    Fresh connections need a few large transfers to reach full speed: 5 warm-up echoes.
    """
    return _echo(ns, peer, 64 * MIB, warmup=5, iterations=4 if quick else 10)


def measure_remote(ns: SimpleNamespace, peer: str, quick: bool) -> dict[str, Any]:
    """Microseconds per ``remote(peer, small_add).to_here()``."""
    rpc = ns.rpc
    for _ in range(20):
        rpc.remote(peer, calls.small_add, args=(1, 2)).to_here()
    times = []
    for _ in range(60 if quick else 300):
        start = time.perf_counter()
        rpc.remote(peer, calls.small_add, args=(1, 2)).to_here()
        times.append((time.perf_counter() - start) * 1e6)
    return _result(statistics.median(times), times)


def measure_rref_proxy(ns: SimpleNamespace, peer: str, quick: bool) -> dict[str, Any]:
    """Microseconds per ``rref.rpc_sync().m()`` on an RRef to a ``Counter`` owned by peer."""
    rref = ns.rpc.remote(peer, calls.Counter)
    for _ in range(20):
        rref.rpc_sync().m()
    times = []
    for _ in range(60 if quick else 300):
        start = time.perf_counter()
        rref.rpc_sync().m()
        times.append((time.perf_counter() - start) * 1e6)
    seen = rref.rpc_sync().m()
    if seen != 20 + len(times) + 1:
        raise AssertionError(f"the owner's Counter saw {seen} calls, not {20 + len(times) + 1}")
    return _result(statistics.median(times), times)


def measure_rnn(ns: SimpleNamespace, peer: str, quick: bool, iterations: int | None = None
                ) -> dict[str, Any]:
    """Milliseconds per iteration of the tutorial's RNN, ``peer`` the parameter server."""
    iterations = iterations or (40 if quick else 200)
    times = rnn_model.run_trainer(peer, iterations, warmup=10 if quick else 20)
    ms = [t * 1e3 for t in times]
    return _result(statistics.median(ms), ms, iterations=iterations)


def measure_start(ns: SimpleNamespace, peer: str, quick: bool, took: float) -> dict[str, Any]:
    """``w0``'s ``init_rpc``, timed by :func:`pair_world` around it (``took``, seconds):
    the rendezvous, the world key's exchange (a key server's TLS handshakes with
    certificates) and the transport's connections, and waiting for ``w1``'s process,
    which starts at the same moment."""
    return _result(took * 1e3, [took * 1e3])


MEASURE = {
    "start": measure_start,
    "rpc_sync": measure_rpc_sync,
    "rpc_async": measure_rpc_async,
    "echo_1m": measure_echo_1m,
    "echo_64m": measure_echo_64m,
    "remote": measure_remote,
    "rref_proxy": measure_rref_proxy,
    "rnn": measure_rnn,
    "size_sweep": sweeps.measure_size_sweep,
}


def note_routes(recorder: Recorder, ns: SimpleNamespace, names: list[str]) -> None:
    """Keep how rpcx's workers reach each other (``debug_info()["routes"]``) in the
    world's facts, after the measurements (so they do not count in them)."""
    try:
        found = systems.routes(ns, names)
    except Exception as exc:  # a fact, not a measurement: never fail the world for it
        recorder.fact("routes_error", repr(exc))
        return
    if found is not None:
        recorder.fact("routes", found)


def pair_world(rank: int, spec: WorldSpec, init_method: str, recorder: Recorder) -> None:
    """Entry point of the two-worker world: ``w0`` measures ``spec.workloads`` on ``w1``."""
    ns = systems.api(spec.system)
    rnn_model.set_api(ns)  # both workers run the tutorial's functions
    started = time.perf_counter()
    systems.init_worker(ns, f"w{rank}", rank, 2, init_method)
    took = time.perf_counter() - started
    if rank == 0:
        for name in spec.workloads:
            kwargs: dict[str, Any] = (
                {"iterations": spec.params.get("rnn_iterations")} if name == "rnn" else
                {"took": took} if name == "start" else {})
            recorder.run(name, MEASURE[name], ns, "w1", spec.quick, **kwargs)
        note_routes(recorder, ns, ["w0", "w1"])
        recorder.done()
    ns.rpc.shutdown()
