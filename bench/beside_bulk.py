"""A small call beside a bulk transfer, between two "hosts" on a shaped link.

Two network namespaces joined by a veth pair (the conformance kit's helper), each end
shaped by ``tc tbf`` (default ``rate 1gbit burst 256kb latency 5ms``). Rank 0 measures
a small ``rpc_sync`` round trip idle (median of 100), then sends rank 1 a large tensor
(default 64 MiB) from another thread and, while that is in flight (from 50 ms after it
began), makes small calls back to back. Beside them, a plain TCP connection of its own
pings rank 1's host (one byte each way): the round trip the network itself gives a
small message through the same queue.

Systems alternate within each round, round after round (torch.distributed.rpc with
TCP-only channels, as between real hosts, and rpcx backends). Reported per system
(medians over rounds): the idle round trip, the round trip during the transfer (median
and 90th percentile), how many small calls were answered during it, the transfer's
time, and the ping during it; and torch's round trip during the transfer over rpcx's
(above 1: rpcx's small calls wait less).

Needs root, ``ip`` and ``tc``.

    python bench/beside_bulk.py                                # torch,auto,tcp,gloo,zmq
    python bench/beside_bulk.py --systems torch,auto --rounds 5 --mib 256 --rate 10gbit
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
WORLD_LIMIT_S = 300.0
SETTLE_S = 0.05  # after the transfer began, before the first small call beside it


# ----------------------------------------------------------------- one worker


def _worker(rank: int, system: str, url: str, mib: int, echo_port: int, peer: str) -> None:
    import torch

    if system == "torch":
        import torch.distributed.rpc as rpc
        options: Any = rpc.TensorPipeRpcBackendOptions(
            init_method=url, rpc_timeout=120, _transports=["uv"], _channels=["basic"])
        rpc.init_rpc(f"h{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    else:
        import rpcx as rpc  # type: ignore[no-redef]
        options = rpc.TensorPipeRpcBackendOptions(init_method=url, rpc_timeout=120)
        rpc.init_rpc(f"h{rank}", rank=rank, world_size=2, backend=system,
                     rpc_backend_options=options)
    if rank == 1:
        _serve_echo(echo_port)
    else:
        print("RESULT " + json.dumps(_measure(rpc, torch, mib, peer, echo_port)), flush=True)
    rpc.shutdown()


def _serve_echo(port: int) -> None:
    server = socket.create_server(("0.0.0.0", port))

    def echo() -> None:
        while True:
            conn, _ = server.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(1):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()


def _measure(rpc: Any, torch: Any, mib: int, peer: str, echo_port: int) -> dict[str, Any]:
    def small() -> float:
        started = time.perf_counter()
        rpc.rpc_sync("h1", len, args=("x",))
        return time.perf_counter() - started

    for _ in range(20):
        small()
    idle = statistics.median(small() for _ in range(100))
    big = torch.ones(mib << 18)
    done = threading.Event()
    took: list[float] = []
    pings: list[float] = []

    def bulk() -> None:
        started = time.perf_counter()
        rpc.rpc_sync("h1", torch.sum, args=(big,))
        took.append(time.perf_counter() - started)
        done.set()

    def ping() -> None:
        with socket.create_connection((peer, echo_port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not done.is_set():
                started = time.perf_counter()
                conn.sendall(b"x")
                conn.recv(1)
                pings.append(time.perf_counter() - started)
                done.wait(0.005)

    sender = threading.Thread(target=bulk)
    pinger = threading.Thread(target=ping)
    sender.start()
    pinger.start()
    # (the transfer under way first: calls made before its first bytes leave would
    # count as answered beside it)
    done.wait(SETTLE_S)
    during = []
    while not done.is_set():
        seconds = small()
        if not done.is_set():
            during.append(seconds)
    sender.join(WORLD_LIMIT_S)
    pinger.join(WORLD_LIMIT_S)
    ordered = sorted(during)
    return {"idle_ms": idle * 1e3, "answered": len(during),
            "during_ms": statistics.median(during) * 1e3 if during else None,
            "p90_ms": ordered[int(len(ordered) * 0.9)] * 1e3 if during else None,
            "transfer_s": took[0],
            "ping_ms": statistics.median(pings) * 1e3 if pings else None}


# ----------------------------------------------------------------- one world


def _world(system: str, mib: int, shaping: list[str]) -> dict[str, Any]:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from rpcx.testing.conformance_hosts import INTERFACE_VARIABLES, two_namespaces
    from rpcx.testing.conformance_links import shape
    from rpcx.testing.world import free_port

    with two_namespaces() as hosts:
        shape(hosts, *shaping)
        port = free_port()
        url = f"tcp://{hosts.addresses[0]}:{port}"
        env = {k: v for k, v in os.environ.items() if k not in INTERFACE_VARIABLES}
        runs = []
        for rank, namespace in enumerate(hosts.namespaces):
            mine = dict(env)
            if system == "torch":  # (torch picks its interface by these, not by route)
                mine.update(TP_SOCKET_IFNAME=hosts.interfaces[rank],
                            GLOO_SOCKET_IFNAME=hosts.interfaces[rank])
            runs.append(subprocess.Popen(
                ["ip", "netns", "exec", namespace, sys.executable, __file__, "--worker",
                 str(rank), system, url, str(mib), str(port + 1), hosts.addresses[1]],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mine))
        try:
            outputs = [run.communicate(timeout=WORLD_LIMIT_S) for run in runs]
        except subprocess.TimeoutExpired:
            for run in runs:
                run.kill()
            outputs = [run.communicate() for run in runs]
    found = re.search(r"^RESULT (.*)$", outputs[0][0], re.M)
    if found is None:
        errors = [line for out in outputs for line in out[1].splitlines() if line.strip()]
        return {"error": errors[-1] if errors else "no result"}
    return dict(json.loads(found.group(1)))


# ----------------------------------------------------------------- the table


def _median(rounds: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(values) if values else None


def _cell(rounds: list[dict[str, Any]], key: str, width: int, digits: int = 2) -> str:
    value = _median(rounds, key)
    return f"{value:{width}.{digits}f}" if value is not None else f"{'-':>{width}s}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="torch,auto,tcp,gloo,zmq")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--burst", default="256kb")
    parser.add_argument("--latency", default="5ms")
    parser.add_argument("--out-dir", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    systems = args.systems.split(",")
    shaping = [args.rate, args.burst, args.latency]
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for index in range(args.rounds):
        for system in systems:
            print(f"round {index + 1}/{args.rounds}: {system} ...", file=sys.stderr, flush=True)
            results[system].append(_world(system, args.mib, shaping))
    torch_during = _median(results.get("torch", []), "during_ms")
    print(f"{args.mib} MiB beside small calls, tc tbf rate {args.rate} burst {args.burst} "
          f"latency {args.latency}; medians of {args.rounds} rounds")
    print(f"{'system':12s} {'idle ms':>8s} {'during ms':>10s} {'p90 ms':>8s} "
          f"{'answered':>9s} {'transfer s':>11s} {'ping ms':>8s} {'torch/this':>11s}")
    for system, rounds in results.items():
        good = [r for r in rounds if "error" not in r]
        failed = [r["error"] for r in rounds if "error" in r]
        if not good:
            print(f"{system:12s} failed: {failed[0]}")
            continue
        during = _median(good, "during_ms")
        ratio = (f"{torch_during / during:.1f}" if torch_during and during else "-")

        print(f"{system:12s} {_cell(good, 'idle_ms', 8)} {_cell(good, 'during_ms', 10)} "
              f"{_cell(good, 'p90_ms', 8)} {_cell(good, 'answered', 9, 0)} "
              f"{_cell(good, 'transfer_s', 11)} {_cell(good, 'ping_ms', 8)} "
              f"{ratio:>11s}" + (f"  ({len(failed)} failed: {failed[0]})" if failed else ""))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"beside_bulk-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"argv": sys.argv, "shaping": shaping, "mib": args.mib,
                               "results": results}, indent=1))
    print(f"written: {out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, system, url, mib, echo_port, peer = sys.argv[2:8]
        _worker(int(rank), system, url, int(mib), int(echo_port), peer)
    else:
        main()
