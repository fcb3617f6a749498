"""rpcx in one minute: three workers on the default backend (or $RPCX_BACKEND).

    python examples/demo.py [--backend gloo|loopback] [--workers 3]

The coordinator (rank 0) computes on the other workers with rpc_sync / rpc_async,
keeps a counter alive on one of them behind an RRef, and shows how a remote error
comes back. Every worker runs the same function; rpcx.spawn starts them as processes
(or as threads on the loopback backend).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

import torch

import rpcx


class Accumulator:
    """Lives on one worker; others update it through an RRef."""

    def __init__(self) -> None:
        self.total = torch.zeros(4)

    def add(self, tensor: torch.Tensor) -> torch.Tensor:
        self.total += tensor
        return self.total.clone()


def square_sum(chunk: torch.Tensor) -> float:
    return float((chunk * chunk).sum())


def checked_sqrt(x: float) -> float:
    if x < 0:
        raise ValueError(f"cannot take the square root of {x}")
    return x**0.5


def coordinator(world_size: int) -> None:
    others = [f"worker{r}" for r in range(1, world_size)]
    print(f"{rpcx.get_worker_info().name} sees: "
          f"{[w.name for w in rpcx.get_worker_infos()]}")

    data = torch.arange(1_000_000, dtype=torch.float64)
    chunks = data.chunk(len(others))
    pairs = zip(others, chunks, strict=True)
    futures = [rpcx.rpc_async(w, square_sum, args=(c,)) for w, c in pairs]
    total = sum(f.wait() for f in futures)
    print(f"sum of squares over {len(others)} workers: {total:.6e} "
          f"(local check: {float((data * data).sum()):.6e})")

    acc = rpcx.remote(others[0], Accumulator)
    for step in range(3):
        acc.rpc_sync().add(torch.ones(4) * step)
    print(f"accumulator on {acc.owner_name()}: {acc.to_here().total.tolist()}")

    try:
        rpcx.rpc_sync(others[-1], checked_sqrt, args=(-4.0,))
    except ValueError as exc:
        print(f"remote error kept its type: ValueError({exc})")

    n = 500
    start = time.perf_counter()
    for _ in range(n):
        rpcx.rpc_sync(others[0], max, args=(1, 2))
    print(f"rpc_sync round trip: {(time.perf_counter() - start) / n * 1e6:.0f} us")


def run(rank: int, world_size: int, init_method: str) -> None:
    rpcx.init_rpc(
        f"worker{rank}", rank=rank, world_size=world_size,
        rpc_backend_options=rpcx.TensorPipeRpcBackendOptions(init_method=init_method),
    )
    if rank == 0:
        coordinator(world_size)
    rpcx.shutdown()  # waits until every worker is done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=None, help="default: $RPCX_BACKEND or auto")
    parser.add_argument("--workers", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    backend = args.backend or os.environ.get("RPCX_BACKEND") or rpcx.DEFAULT_BACKEND
    print(f"starting {args.workers} workers on the {backend!r} backend")
    with tempfile.TemporaryDirectory() as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        rpcx.spawn(run, args=(args.workers, init_method), nprocs=args.workers, backend=backend)
    print("done")


if __name__ == "__main__":
    main()
