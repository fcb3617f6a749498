"""Several trainers share one model on a parameter server, through RRefs.

The pattern of torch's tutorial "Implementing a Parameter Server Using Distributed RPC
Framework". Rank 0 hosts the parameter server, an object that owns the model. The
other ranks are trainers. Each trainer:

- runs the model's forward pass on the parameter server through an RRef;
- computes its loss locally;
- runs ``rpcx.autograd.backward``, whose gradients land in the server's context for
  that trainer;
- steps a ``DistributedOptimizer`` over the server's parameters.

The trainers work at the same time, without waiting for each other (asynchronous SGD,
serialized per step on the server).

The data is synthetic and learnable: points from four Gaussian blobs in eight
dimensions, labelled by blob. Each trainer draws its own points from its own generator.
Once training is over, rank 0 measures the shared model on held-out points.

    python examples/parameter_server/main.py                  # default backend, 2 trainers
    python examples/parameter_server/main.py --backend loopback --world-size 5
    torchrun --nproc-per-node 3 examples/parameter_server/main.py --backend gloo

Exit status 0 when the held-out accuracy reaches ``--target``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import torch
from torch import nn

import rpcx
import rpcx.autograd as dist_autograd
from rpcx.optim import DistributedOptimizer

FEATURES, CLASSES = 8, 4


class ParameterServer:
    """Owns the shared model; trainers run its forward pass through an RRef."""

    def __init__(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
        with torch.no_grad():
            for param in self.model.parameters():
                param.copy_((torch.rand(param.shape, generator=generator) - 0.5) * 0.5)
        self.lock = threading.Lock()  # trainers call concurrently
        self.forwards = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model on ``inputs``; the caller's context records it for its backward.

        Runs on copies of the weights made inside the graph (``clone`` passes gradients
        through to the parameters). Backward needs the weights the forward pass used,
        and other trainers' optimizer steps change the parameters in place meanwhile:
        on the parameters themselves, autograd would refuse ("modified by an inplace
        operation"). (``torch.func.functional_call`` would not do: it swaps the
        module's attributes while it runs, and trainers call concurrently.)
        """
        with self.lock:
            self.forwards += 1
            first, second = (
                (layer.weight.clone(), layer.bias.clone())
                for layer in (self.model[0], self.model[2])
            )
        hidden = torch.relu(nn.functional.linear(inputs, *first))
        return nn.functional.linear(hidden, *second)

    def parameter_rrefs(self) -> list[rpcx.RRef[torch.Tensor]]:
        """The model's parameters as RRefs, for a ``DistributedOptimizer`` anywhere."""
        return [rpcx.RRef(param) for param in self.model.parameters()]

    def accuracy(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        """Share of ``inputs`` the model classifies right."""
        with torch.no_grad():
            return float((self.model(inputs).argmax(dim=1) == labels).float().mean())


def blobs(generator: torch.Generator, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` points around four fixed centers, and which center each is from."""
    centers = torch.eye(CLASSES, FEATURES) * 3.0
    labels = torch.randint(0, CLASSES, (count,), generator=generator)
    points = centers[labels] + torch.randn(count, FEATURES, generator=generator)
    return points, labels


def run_trainer(server: rpcx.RRef[ParameterServer], index: int, epochs: int,
                batches: int) -> list[float]:
    """Train the shared model; returns this trainer's mean loss per epoch."""
    optimizer = DistributedOptimizer(torch.optim.SGD, server.rpc_sync().parameter_rrefs(),
                                     lr=0.05)
    criterion = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(100 + index)
    name = rpcx.get_worker_info().name
    losses = []
    for epoch in range(1, epochs + 1):
        started, total = time.perf_counter(), 0.0
        for _ in range(batches):
            inputs, labels = blobs(generator, 32)
            with dist_autograd.context() as context_id:
                loss = criterion(server.rpc_sync().forward(inputs), labels)
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            total += loss.item()
        losses.append(total / batches)
        print(f"{name}: epoch {epoch}/{epochs}  loss {losses[-1]:.4f}  "
              f"{(time.perf_counter() - started) * 1e3 / batches:.2f} ms/batch", flush=True)
    return losses


def run_server(args: argparse.Namespace, world_size: int) -> bool:
    """Rank 0: host the server, run the trainers, judge the shared model."""
    server = rpcx.RRef(ParameterServer(seed=args.seed))
    trainers = [rpcx.get_worker_info(f"trainer{i}") for i in range(1, world_size)]
    futures = [rpcx.rpc_async(t, run_trainer, args=(server, i + 1, args.epochs, args.batches))
               for i, t in enumerate(trainers)]
    curves = [future.wait() for future in futures]
    test_inputs, test_labels = blobs(torch.Generator().manual_seed(args.seed + 1), 1000)
    accuracy = server.local_value().accuracy(test_inputs, test_labels)
    forwards = server.local_value().forwards
    fell = all(curve[-1] < curve[0] for curve in curves)
    print(f"{forwards} forward passes from {len(trainers)} trainers; loss fell on every "
          f"trainer: {fell}; held-out accuracy {accuracy:.3f} (target {args.target})")
    return fell and accuracy >= args.target


def run_worker(worker: rpcx.LaunchedWorker, args: argparse.Namespace) -> bool:
    """Rank 0 is the parameter server and judge; the others are trainers."""
    options = rpcx.TensorPipeRpcBackendOptions(init_method=worker.init_method(), rpc_timeout=120)
    name = "ps" if worker.rank == 0 else f"trainer{worker.rank}"
    rpcx.init_rpc(name, rank=worker.rank, world_size=worker.world_size, backend=args.backend,
                  rpc_backend_options=options)
    passed = True
    if worker.rank == 0:
        backend = rpcx.debug_info()["backend"]  # the one init_rpc chose
        print(f"a parameter server and {worker.world_size - 1} trainers on the {backend!r} "
              f"backend: {args.epochs} epochs of {args.batches} batches each", flush=True)
        passed = run_server(args, worker.world_size)
    rpcx.shutdown()
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None,
                        help="rpcx backend (default: $RPCX_BACKEND, else rpcx's default)")
    parser.add_argument("--world-size", type=int, default=3,
                        help="the parameter server + trainers (under torchrun: its world size)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batches", type=int, default=20, help="batches per epoch")
    parser.add_argument("--target", type=float, default=0.9, help="held-out accuracy to reach")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torchrun = rpcx.under_torchrun()
    if not torchrun and args.world_size < 2:
        parser.error("--world-size must be at least 2 (the server and a trainer)")
    passed: Any = rpcx.launch(run_worker, args=(args,),
                              nprocs=None if torchrun else args.world_size, backend=args.backend)
    if not torchrun:
        print("done" if passed else "FAILED")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
