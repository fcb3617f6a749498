"""Synchronous SGD through a batch-updating parameter server: ``@async_execution``.

The pattern of torch's tutorial "Implementing Batch RPC Processing Using Asynchronous
Executions". Rank 0 hosts the parameter server; the other ranks are trainers, each
with a local copy of the model. Each round, every trainer:

- computes gradients on its own batch;
- calls ``update_and_fetch_model`` on the server.

That function is decorated with ``@rpcx.functions.async_execution``. It adds the
gradients and returns a future, so no server thread waits while the other trainers are
still computing. When the last trainer of the round has reported, the server takes one
optimizer step on the summed gradients and completes the future: every trainer gets
the same new model, and the next round starts.

The task is a linear regression with noise, on data every trainer draws from its own
generator.

    python examples/batch_rpc/main.py                         # default backend, 3 trainers
    python examples/batch_rpc/main.py --backend loopback --world-size 6
    torchrun --nproc-per-node 4 examples/batch_rpc/main.py --backend gloo

Exit status 0 when the server took exactly one step per round and the model fits the
data (mean squared error within 50% above the noise's variance).
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
from rpcx.functions import async_execution

INPUTS, OUTPUTS = 10, 3
NOISE = 0.1  # standard deviation of the targets' noise: the best fit's MSE is NOISE**2


def true_weights() -> torch.Tensor:
    """The map the data comes from (the same everywhere)."""
    return torch.randn(OUTPUTS, INPUTS, generator=torch.Generator().manual_seed(7))


def regression_batch(generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` inputs and their noisy targets."""
    inputs = torch.randn(size, INPUTS, generator=generator)
    noise = NOISE * torch.randn(size, OUTPUTS, generator=generator)
    return inputs, inputs @ true_weights().T + noise


class BatchUpdateParameterServer:
    """Steps the model once every trainer has reported its gradients for the round."""

    def __init__(self, trainers: int, lr: float) -> None:
        self.model = nn.Linear(INPUTS, OUTPUTS)
        with torch.no_grad():
            self.model.weight.zero_()
            self.model.bias.zero_()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.trainers = trainers
        self.lock = threading.Lock()
        self.reported = 0
        self.steps = 0
        self.next_model: torch.futures.Future[nn.Module] = torch.futures.Future()

    def get_model(self) -> nn.Module:
        """The current model (sent as a copy)."""
        return self.model

    @staticmethod
    @async_execution
    def update_and_fetch_model(
        server: rpcx.RRef[BatchUpdateParameterServer], grads: list[torch.Tensor]
    ) -> torch.futures.Future[nn.Module]:
        """Add a trainer's gradients; the future completes with the round's new model."""
        self = server.local_value()
        with self.lock:
            for param, grad in zip(self.model.parameters(), grads, strict=True):
                param.grad = grad if param.grad is None else param.grad + grad
            self.reported += 1
            round_done = self.next_model
            if self.reported == self.trainers:
                for param in self.model.parameters():
                    param.grad /= self.trainers  # the mean over the round's trainers
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.reported, self.steps = 0, self.steps + 1
                self.next_model = torch.futures.Future()
                round_done.set_result(self.model)
        return round_done


def run_trainer(server: rpcx.RRef[BatchUpdateParameterServer], index: int, rounds: int,
                batch_size: int) -> list[float]:
    """Train in step with the other trainers; returns this trainer's loss per round."""
    model: nn.Module = server.rpc_sync().get_model()
    generator = torch.Generator().manual_seed(index)
    name = rpcx.get_worker_info().name
    losses, started = [], time.perf_counter()
    for step in range(1, rounds + 1):
        inputs, targets = regression_batch(generator, batch_size)
        loss = nn.functional.mse_loss(model(inputs), targets)
        model.zero_grad()
        loss.backward()
        model = rpcx.rpc_sync(server.owner(), BatchUpdateParameterServer.update_and_fetch_model,
                              args=(server, [p.grad for p in model.parameters()]))
        losses.append(loss.item())
        if step % 10 == 0 or step == rounds:
            elapsed = time.perf_counter() - started
            print(f"{name}: round {step}/{rounds}  loss {loss.item():.4f}  "
                  f"{elapsed * 1e3 / step:.2f} ms/round", flush=True)
    return losses


def run_server(args: argparse.Namespace, world_size: int) -> bool:
    """Rank 0: host the server, run the trainers, check the rounds and the fit."""
    trainers = world_size - 1
    server = rpcx.RRef(BatchUpdateParameterServer(trainers, lr=args.lr))
    futures = [rpcx.rpc_async(f"trainer{i}", run_trainer,
                              args=(server, i, args.rounds, args.batch_size))
               for i in range(1, world_size)]
    curves = [future.wait() for future in futures]
    steps = server.local_value().steps
    inputs, targets = regression_batch(torch.Generator().manual_seed(12345), 2000)
    with torch.no_grad():
        mse = float(nn.functional.mse_loss(server.local_value().model(inputs), targets))
    fits = mse <= 1.5 * NOISE**2
    print(f"{steps} server steps for {args.rounds} rounds of {trainers} trainers "
          f"(first losses {[round(c[0], 3) for c in curves]}); held-out MSE {mse:.5f}, "
          f"noise variance {NOISE**2:.5f}: fits: {fits}")
    return steps == args.rounds and fits


def run_worker(worker: rpcx.LaunchedWorker, args: argparse.Namespace) -> bool:
    """Rank 0 is the server and judge; the others are trainers."""
    options = rpcx.TensorPipeRpcBackendOptions(init_method=worker.init_method(), rpc_timeout=120)
    name = "ps" if worker.rank == 0 else f"trainer{worker.rank}"
    rpcx.init_rpc(name, rank=worker.rank, world_size=worker.world_size, backend=args.backend,
                  rpc_backend_options=options)
    passed = True
    if worker.rank == 0:
        backend = rpcx.debug_info()["backend"]  # the one init_rpc chose
        print(f"a batch-updating parameter server and {worker.world_size - 1} trainers on the "
              f"{backend!r} backend: {args.rounds} rounds", flush=True)
        passed = run_server(args, worker.world_size)
    rpcx.shutdown()
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None,
                        help="rpcx backend (default: $RPCX_BACKEND, else rpcx's default)")
    parser.add_argument("--world-size", type=int, default=4,
                        help="the server + trainers (under torchrun: its world size)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
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
