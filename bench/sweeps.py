"""The two sweeps: echo latency/bandwidth per message size, and calls/s per client count.

*Size sweep* (measured in the pair world of :mod:`workloads`): a ``uint8`` tensor of
64 B to 256 MiB sent to the peer and returned; per size the median round trip
(microseconds) and GB/s counting both directions.

*Clients sweep* (its own world): one ``server`` and up to seven clients ``c1``..``c7``.
For each client count k, the server orders clients ``c1``..``ck`` to start a timed loop
at a common instant; each client's main thread calls ``rpc_sync("server", small_add)``
as fast as it can for a fixed time; the result is the sum of the clients' calls per
second. On loopback
the clients are threads of one process (the GIL is theirs to share).
"""

from __future__ import annotations

import queue
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import calls
import systems
from world import Recorder, WorldSpec

KIB, MIB = 1 << 10, 1 << 20
SIZES = [64, KIB, 16 * KIB, 256 * KIB, MIB, 16 * MIB, 64 * MIB, 256 * MIB]
QUICK_MAX_SIZE = 64 * MIB
MAX_CLIENTS = 7

API: SimpleNamespace  # set in each worker of the clients world


def sweep_sizes(quick: bool) -> list[int]:
    """The message sizes of the size sweep (no 256 MiB point in quick mode)."""
    return [s for s in SIZES if not quick or s <= QUICK_MAX_SIZE]


def measure_size_sweep(ns: SimpleNamespace, peer: str, quick: bool) -> dict[str, Any]:
    """Echo each size of :func:`sweep_sizes`; median latency and GB/s per size."""
    import torch

    budget = (64 if quick else 256) * MIB  # bytes sent per size, within [3, cap] echoes
    cap = 50 if quick else 200
    points = []
    for size in sweep_sizes(quick):
        iterations = max(3, min(cap, budget // size))
        tensor = torch.ones(size, dtype=torch.uint8)
        times = calls.echo_seconds(ns, peer, tensor, max(2, iterations // 10), iterations)
        median = statistics.median(times)
        points.append({
            "bytes": size,
            "latency_us": median * 1e6,
            "GBps": 2 * size / median / 1e9,
            "samples_us": [t * 1e6 for t in times],
        })
        del tensor
    return {"points": points}


# -------------------------------------------------------------------------- clients
#
# Each client measures from its own main thread (as a program would, and as the pair
# world does): an RPC from the server only queues the phase's orders for it, and the
# client reports its count back with one more call. Nothing is measured inside an RPC
# handler, where a call is a nested one.

_orders: dict[str, queue.Queue[tuple[float, float] | None]] = {}  # client -> its orders
_reports: queue.Queue[tuple[str, int, float]] = queue.Queue()  # on the server
REPORT_TIMEOUT_S = 60.0


def order(client: str, start_at: float | None, duration: float = 0.0) -> None:
    """On a client: queue a timed loop from wall-clock ``start_at`` (``None``: stop)."""
    _orders[client].put(None if start_at is None else (start_at, duration))


def report(client: str, calls: int, seconds: float) -> None:
    """On the server: a client's count for the current phase."""
    _reports.put((client, calls, seconds))


def _client_main(name: str) -> None:
    """A client's main thread: run each ordered loop and report it, until told to stop."""
    rpc = API.rpc
    while True:
        item = _orders[name].get(timeout=600)
        if item is None:
            return
        start_at, duration = item
        delay = start_at - time.time()
        if delay > 0:
            time.sleep(delay)
        start = time.perf_counter()
        end = start + duration
        n = 0
        while time.perf_counter() < end:
            rpc.rpc_sync("server", calls.small_add, args=(1, 2))
            n += 1
        rpc.rpc_sync("server", report, args=(name, n, time.perf_counter() - start))


def _phase(rpc: Any, clients: int, duration: float) -> list[float]:
    """Clients ``c1``..``c<clients>`` loop together; each one's calls per second."""
    start_at = time.time() + 0.25  # time for the orders to reach every client
    for i in range(1, clients + 1):
        rpc.rpc_sync(f"c{i}", order, args=(f"c{i}", start_at, duration))
    rates = []
    for _ in range(clients):
        _, n, seconds = _reports.get(timeout=duration + REPORT_TIMEOUT_S)
        rates.append(n / seconds)
    return rates


def measure_clients_sweep(
    ns: SimpleNamespace, counts: list[int], duration: float
) -> dict[str, Any]:
    """Aggregate calls/s of 1..7 concurrent clients of one server (``counts``)."""
    _phase(ns.rpc, max(counts), min(0.5, duration))  # every client connected and warm
    points = []
    for k in counts:
        rates = _phase(ns.rpc, k, duration)
        points.append({"clients": k, "calls_per_s": sum(rates), "per_client": rates})
    return {"points": points, "duration_s": duration}


def _stop_clients(rpc: Any, clients: int) -> None:
    for i in range(1, clients + 1):
        try:
            rpc.rpc_sync(f"c{i}", order, args=(f"c{i}", None))
        except Exception as exc:  # the client is gone; its own record says why
            print(f"clients sweep: could not stop c{i}: {exc}", file=sys.stderr, flush=True)


def clients_world(rank: int, spec: WorldSpec, init_method: str, recorder: Recorder) -> None:
    """Entry point of the clients world: rank 0 is the server and runs the sweep."""
    global API
    ns = API = systems.api(spec.system)
    name = "server" if rank == 0 else f"c{rank}"
    if rank:
        _orders[name] = queue.Queue()  # before init_rpc: orders may come at once
    systems.init_worker(ns, name, rank, spec.world_size, init_method)
    if rank == 0:
        counts = list(range(1, spec.world_size))
        try:
            recorder.run("clients_sweep", measure_clients_sweep, ns, counts,
                         spec.params["duration_s"])
        finally:
            _stop_clients(ns.rpc, spec.world_size - 1)
        recorder.done()
    else:
        _client_main(name)
    ns.rpc.shutdown()
