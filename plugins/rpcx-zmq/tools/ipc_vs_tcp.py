"""Compare ZeroMQ over ipc:// and over TCP loopback between two processes of this host.

Measures what the zmq backend's choice rests on: the round trip of a small message, and
the throughput of large ones (sent from and received into memory without copies, as
the backend does). Run: ``python plugins/rpcx-zmq/tools/ipc_vs_tcp.py [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from typing import Any

import zmq

SIZES = (8, 1 << 20, 64 << 20)


def _echo(endpoint_in: str, endpoint_out: str, count: int) -> None:
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.connect(endpoint_in)
    push = context.socket(zmq.PUSH)
    push.connect(endpoint_out)
    for _ in range(count):
        push.send(pull.recv(copy=False), copy=False)
    push.close(linger=5000)
    pull.close(linger=0)
    context.term()


def _measure(kind: str, size: int, count: int) -> float:
    """Seconds per round trip of a ``size``-byte message."""
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    pull = context.socket(zmq.PULL)
    if kind == "ipc":
        folder = tempfile.mkdtemp(prefix="zmq-bench-")
        out_ep, in_ep = f"ipc://{folder}/out", f"ipc://{folder}/in"
        push.bind(out_ep)
        pull.bind(in_ep)
    else:
        push.bind("tcp://127.0.0.1:*")
        pull.bind("tcp://127.0.0.1:*")
        out_ep = push.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
        in_ep = pull.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
    warmup = 3
    process = multiprocessing.get_context("spawn").Process(
        target=_echo, args=(out_ep, in_ep, count + warmup))
    process.start()
    payload = bytearray(os.urandom(min(size, 1 << 16)) * max(1, size >> 16))[:size]
    for _ in range(warmup):
        push.send(payload, copy=False)
        pull.recv(copy=False)
    started = time.perf_counter()
    for _ in range(count):
        push.send(payload, copy=False)
        pull.recv(copy=False)
    elapsed = (time.perf_counter() - started) / count
    process.join(30)
    push.close(linger=0)
    pull.close(linger=0)
    context.term()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{'size':>10} {'ipc':>14} {'tcp':>14}")
    for size in SIZES:
        count = 2000 if size <= 1024 else (200 if size <= (1 << 20) else 10)
        results: dict[str, Any] = {}
        for kind in ("ipc", "tcp"):
            results[kind] = statistics.median(
                _measure(kind, size, count) for _ in range(args.rounds))
        if size <= 1024:
            row = [f"{results[k] * 1e6:11.1f} us" for k in ("ipc", "tcp")]
        else:
            row = [f"{2 * size / results[k] / 1e9:9.2f} GB/s" for k in ("ipc", "tcp")]
        print(f"{size:>10} {row[0]:>14} {row[1]:>14}")


if __name__ == "__main__":
    main()
