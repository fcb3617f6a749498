"""DDP + RPC: a sparse embedding on a parameter server, a dense layer replicated by DDP.

Four workers, each with one job:

- ``master`` (rank 0) creates the embedding on the parameter server as a
  ``RemoteModule``, starts both trainers and checks their results;
- ``ps`` (rank 1) holds the ``EmbeddingBag`` and only serves calls;
- ``trainer0`` and ``trainer1`` (ranks 2 and 3) each hold a copy of a dense
  ``Linear`` layer wrapped in ``DistributedDataParallel`` over a gloo group of the two
  trainers, look embeddings up on the parameter server, and train with
  ``rpcx.autograd`` and a ``DistributedOptimizer`` that steps the remote embedding and
  the local layer together;

The data is synthetic and learnable: each bag holds indices of one class (index modulo
the number of classes) and is labelled with it, so the loss falls epoch by epoch. Each
trainer draws its batches from its own ``torch.Generator``, never from torch's global
one, so the numbers are the same on every backend, also on loopback, where all workers
are threads of one process and share the global generator.

Run it::

    python examples/ddp_rpc/main.py                     # default backend, rpcx.spawn
    python examples/ddp_rpc/main.py --backend loopback --epochs 3
    torchrun --nproc-per-node 4 examples/ddp_rpc/main.py --backend gloo
    python examples/ddp_rpc/main.py --cuda              # on GPUs, through device maps
    python examples/ddp_rpc/main.py --trace step/       # trace trainer0's last step

With ``--cuda`` the embedding lives on the parameter server's ``cuda:0`` and trainer
``i``'s dense layer on ``cuda:i`` (modulo the GPUs there are; both share ``cuda:0`` on a
one-GPU machine). Each trainer's device map to ``ps`` sends its lookups to ``cuda:0`` and
brings the embeddings, and in the backward pass their gradients, back along the inverse
map, so no tensor passes through host memory on a backend that moves device memory itself.

With ``--trace DIR`` every worker records trainer0's last training step with
``rpcx.tracing`` (each writes ``DIR/<worker>.rpcx-trace.json``); ``rpcx trace merge DIR -o
step.json`` and ``rpcx trace plot DIR -o step.png`` show it as one timeline.

It prints each trainer's loss and time per epoch and exits with status 0 only if the
loss fell and both trainers ended with identical dense weights (DDP kept them in step).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import rpcx
import rpcx.autograd as dist_autograd
import rpcx.tracing
from rpcx.nn import RemoteModule
from rpcx.optim import DistributedOptimizer
from rpcx.registry import resolve_backend

WORLD_SIZE = 4
MASTER, PS = 0, 1  # rank 0's result is what rpcx.launch returns: the master's verdict
TRAINERS = (2, 3)  # trainer0, trainer1
NUM_EMBEDDINGS, EMBEDDING_DIM, CLASSES = 96, 16, 8
LEARNING_RATE = 0.05
PS_CUDA_DEVICE = "cuda:0"  # the embedding's device on the parameter server with --cuda


class SeededEmbeddingBag(nn.EmbeddingBag):
    """An ``EmbeddingBag`` whose initial weights come from its own generator."""

    def __init__(self, num_embeddings: int, dim: int, seed: int) -> None:
        super().__init__(num_embeddings, dim, mode="sum")
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.weight.copy_(torch.randn(num_embeddings, dim, generator=generator))


class HybridModel(nn.Module):
    """The sparse part on the parameter server, the dense part here under DDP."""

    def __init__(self, embedding: RemoteModule, group: Any, seed: int,
                 device: torch.device) -> None:
        super().__init__()
        self.embedding = embedding
        dense = nn.Linear(EMBEDDING_DIM, CLASSES)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            dense.weight.copy_(torch.randn(CLASSES, EMBEDDING_DIM, generator=generator) * 0.1)
            dense.bias.zero_()
        # DDP broadcasts trainer0's weights at construction: both start equal.
        device_ids = [device] if device.type == "cuda" else None
        self.fc = DDP(dense.to(device), device_ids=device_ids, process_group=group)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(self.embedding.forward(indices, offsets))
        return out


def batches(
    generator: torch.Generator, count: int, bags: int = 16
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``count`` batches of ``bags`` bags; a bag holds 2-9 indices of one class."""
    out = []
    for _ in range(count):
        labels = torch.randint(0, CLASSES, (bags,), generator=generator)
        sizes = torch.randint(2, 10, (bags,), generator=generator)
        indices = [
            label + CLASSES * torch.randint(0, NUM_EMBEDDINGS // CLASSES, (int(size),),
                                            generator=generator)
            for label, size in zip(labels, sizes, strict=True)
        ]
        offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), sizes[:-1]]), 0)
        out.append((torch.cat(indices), offsets, labels))
    return out


def trainer_device(index: int, cuda: bool) -> torch.device:
    """Where trainer ``index`` keeps its dense layer and its batches."""
    if not cuda:
        return torch.device("cpu")
    return torch.device("cuda", index % torch.cuda.device_count())


def run_trainer(
    index: int, embedding: RemoteModule, epochs: int, per_epoch: int, store_path: str | None,
    cuda: bool = False, trace_dir: str | None = None,
) -> dict[str, Any]:
    """Train for ``epochs``; returns the loss and seconds of each epoch and the weights.
    With ``trace_dir``, trainer0 records its last step on every worker (rpcx.tracing)."""
    device = trainer_device(index, cuda)
    model = HybridModel(embedding, _trainer_group(index, store_path), seed=1234, device=device)
    # The remote part's parameters as RRefs from its owner, the local ones wrapped here
    # (a RemoteModule holds no parameters itself: model.parameters() would refuse).
    params = embedding.remote_parameters() + [rpcx.RRef(p) for p in model.fc.parameters()]
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=LEARNING_RATE)
    criterion = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(index)  # this trainer's data, on any backend
    losses, seconds = [], []
    for epoch in range(epochs):
        started, total = time.perf_counter(), 0.0
        for number, (indices, offsets, labels) in enumerate(batches(generator, per_epoch)):
            # (drawn on the CPU from the trainer's generator: the same batches everywhere)
            indices, offsets, labels = (t.to(device) for t in (indices, offsets, labels))
            last = epoch == epochs - 1 and number == per_epoch - 1
            traced = (rpcx.tracing.trace(trace_dir) if trace_dir and index == 0 and last
                      else contextlib.nullcontext())
            with traced, dist_autograd.context() as context_id:
                loss = criterion(model(indices, offsets), labels)
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            total += loss.item()
        losses.append(total / per_epoch)
        seconds.append(time.perf_counter() - started)
        print(f"trainer{index}: epoch {epoch + 1}/{epochs}  loss {losses[-1]:.4f}  "
              f"{seconds[-1] * 1e3:.1f} ms", flush=True)
    # The master has no device map back to the trainers: it gets the weights on the CPU.
    return {"losses": losses, "seconds": seconds,
            "weight": model.fc.module.weight.detach().cpu()}


def run_master(epochs: int, per_epoch: int, store_path: str | None, cuda: bool = False,
               trace_dir: str | None = None) -> bool:
    """Create the embedding, run both trainers, check what they did."""
    embedding = RemoteModule(f"ps/{PS_CUDA_DEVICE if cuda else 'cpu'}", SeededEmbeddingBag,
                             args=(NUM_EMBEDDINGS, EMBEDDING_DIM, 42))
    futures = [rpcx.rpc_async(f"trainer{i}", run_trainer,
                              args=(i, embedding, epochs, per_epoch, store_path, cuda,
                                    trace_dir))
               for i in range(len(TRAINERS))]
    results = [future.wait() for future in futures]
    identical = torch.equal(results[0]["weight"], results[1]["weight"])
    fell = all(r["losses"][-1] < r["losses"][0] for r in results)
    falls = ", ".join(f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}" for r in results)
    print(f"DDP weights identical on both trainers: {identical}")
    print(f"loss fell on both trainers: {fell} ({falls})")
    return identical and fell


def _trainer_group(index: int, store_path: str | None) -> Any:
    """The trainers' gloo group for DDP."""
    if store_path is None:
        return _DDP_GROUP  # made by every process right after init_process_group
    # Loopback: the workers are threads of one process, which has one default group, so
    # the two trainers build theirs directly.
    store = dist.FileStore(store_path, len(TRAINERS))
    group = dist.ProcessGroup(store, index, len(TRAINERS))
    backend = dist.ProcessGroupGloo(store, index, len(TRAINERS))
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    for device_type in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        group._register_backend(torch.device(device_type), dist.ProcessGroup.BackendType.GLOO,
                                backend)  # gloo all-reduces CUDA tensors too (--cuda)
    return group


_DDP_GROUP: Any = None


def run_worker(worker: rpcx.LaunchedWorker, args: argparse.Namespace) -> bool:
    """One worker: join the world, do this rank's job, leave; False if a check failed."""
    global _DDP_GROUP
    rank = worker.rank
    in_process = resolve_backend(args.backend).capabilities.in_process
    store_path = None
    if in_process:  # (loopback never runs under torchrun: rendezvous is a directory)
        assert worker.rendezvous is not None
        store_path = os.path.join(worker.rendezvous, "trainers")
    else:
        # One gloo group of all four processes (a collective: everyone makes the
        # trainers' subgroup); DDP uses the subgroup.
        dist.init_process_group("gloo", init_method=worker.init_method("ddp"), rank=rank,
                                world_size=WORLD_SIZE)
        _DDP_GROUP = dist.new_group(list(TRAINERS))
    if rank in TRAINERS:
        name = f"trainer{TRAINERS.index(rank)}"
    else:
        name = "master" if rank == MASTER else "ps"
    options = rpcx.TensorPipeRpcBackendOptions(init_method=worker.init_method(), rpc_timeout=120)
    if args.cuda and rank in TRAINERS:
        # Lookups go to the embedding's GPU; results and gradients come back the inverse way.
        options.set_device_map("ps", {trainer_device(TRAINERS.index(rank), True): PS_CUDA_DEVICE})
    rpcx.init_rpc(name, rank=rank, world_size=WORLD_SIZE, backend=args.backend,
                  rpc_backend_options=options)
    passed = True
    if rank == MASTER:
        backend = rpcx.debug_info()["backend"]  # the one init_rpc chose
        where = ", on GPUs" if args.cuda else ""
        print(f"DDP + RPC on the {backend!r} backend: {args.epochs} epochs of "
              f"{args.batches} batches{where}", flush=True)
        passed = run_master(args.epochs, args.batches, store_path, args.cuda, args.trace)
    rpcx.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None,
                        help="rpcx backend (default: $RPCX_BACKEND, else rpcx's default)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batches", type=int, default=10, help="batches per epoch")
    parser.add_argument("--cuda", action="store_true",
                        help="embedding and dense layers on GPUs, tensors along device maps")
    parser.add_argument("--trace", metavar="DIR", default=None,
                        help="record trainer0's last step on every worker into DIR "
                             "(rpcx.tracing; then: rpcx trace plot DIR -o step.png)")
    args = parser.parse_args()
    if args.cuda and not torch.cuda.is_available():
        parser.error("--cuda: torch sees no CUDA device on this machine")
    # rpcx.spawn starts the four workers, or torchrun did: see rpcx.launch. Every
    # process's verdict decides its exit status (only the master's can be False).
    passed = rpcx.launch(run_worker, args=(args,), nprocs=WORLD_SIZE, backend=args.backend)
    if not rpcx.under_torchrun():
        print("done" if passed else "FAILED")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
