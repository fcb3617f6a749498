"""DDP + RPC hybrid training, timed per epoch: torch's tutorial program as a benchmark.

torch's "Combining DDP with the Distributed RPC Framework" program on the CPU, with the
example's structure: four workers, ``trainer0`` and ``trainer1`` (ranks 0 and 1), the
``master`` (rank 2) and the parameter server ``ps`` (rank 3) holding an
``EmbeddingBag``. The master creates the embedding on ``ps`` and starts both trainers;
each trainer wraps its dense layer in ``DistributedDataParallel`` over a gloo process
group of the two trainers, looks embeddings up through the RRef, runs a distributed
backward pass and steps a ``DistributedOptimizer`` over the remote embedding and its
dense parameters.

Differences from the example, for timing: a fixed number of batches per epoch
(``BATCHES``), one warm-up epoch and then ``epochs`` timed ones, no printing, and the
trainers return their epoch times. The code is the same for torch and rpcx; only the
modules in ``API`` differ. The trainers' process group rendezvous on its own TCP port,
which the parent got from the OS (``params["ddp_port"]``); the RPC rendezvous is a file.
Across hosts (placement.py: trainer0 and the master on host a, trainer1 and ps on b) the
trainers' group connects to trainer0's host (``params["ddp_host"]``) and is told the
host's interface while it connects, in every system: it is torch's gloo, which binds to
127.0.0.1 in a namespace otherwise; rpcx's ``init_rpc``, after it, sees no interface
variable.
On loopback, where all workers are threads of one process and there is one default
process group per process, the trainers build their gloo group directly on a TCPStore
at that port (as the example does on a FileStore).

The figure is the median over timed epochs of the slower trainer's epoch.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import time
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import placement
import systems
import torch
import torch.distributed as dist
from torch import optim
from torch.nn.parallel import DistributedDataParallel as DDP
from workloads import note_routes
from world import Recorder, WorldSpec

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
BATCHES = 10  # per epoch, the same for every system and mode
WARMUP_EPOCHS = 1
DDP_TIMEOUT = timedelta(seconds=60)

API: SimpleNamespace  # set in each worker


class HybridModel(torch.nn.Module):
    """A remote embedding bag (the sparse part) and a DDP-replicated linear layer."""

    def __init__(self, emb_rref: Any, group: Any) -> None:
        super().__init__()
        self.emb_rref = emb_rref
        self.fc = DDP(torch.nn.Linear(16, 8), process_group=group)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        emb_lookup = self.emb_rref.rpc_sync().forward(indices, offsets)
        out: torch.Tensor = self.fc(emb_lookup)
        return out


def _retrieve_embedding_parameters(emb_rref: Any) -> list[Any]:
    return [API.rpc.RRef(param) for param in emb_rref.local_value().parameters()]


def get_next_batch(rank: int) -> Any:
    """``BATCHES`` random bags of indices, offsets and targets (the example's generator)."""
    for _ in range(BATCHES):
        num_indices = random.randint(20, 50)
        indices = torch.LongTensor(num_indices).random_(0, NUM_EMBEDDINGS)
        offsets = []
        start = 0
        batch_size = 0
        while start < num_indices:
            offsets.append(start)
            start += random.randint(1, 10)
            batch_size += 1
        offsets_tensor = torch.LongTensor(offsets)
        target = torch.LongTensor(batch_size).random_(8)
        yield indices, offsets_tensor, target


def _trainer_group(rank: int, port: int) -> Any:
    """The trainers' gloo group: the default group where each trainer is a process."""
    if not systems.in_process(API.system):
        return None  # init_process_group ran: DDP uses the default group
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=DDP_TIMEOUT)
    group = dist.ProcessGroup(store, rank, 2)
    backend = dist.ProcessGroupGloo(store, rank, 2)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


class Trainer:
    """One trainer's model, optimizer and loss, as the example builds them."""

    def __init__(self, emb_rref: Any, rank: int, port: int) -> None:
        random.seed(rank)
        torch.manual_seed(rank)  # different initial weights: DDP broadcasts rank 0's
        self.model = HybridModel(emb_rref, _trainer_group(rank, port))
        model_parameter_rrefs = API.rpc.rpc_sync(
            "ps", _retrieve_embedding_parameters, args=(emb_rref,)
        )
        for param in self.model.parameters():
            model_parameter_rrefs.append(API.rpc.RRef(param))
        self.opt = API.DistributedOptimizer(optim.SGD, model_parameter_rrefs, lr=0.05)
        self.criterion = torch.nn.CrossEntropyLoss()

    def step(self, indices: torch.Tensor, offsets: torch.Tensor, target: torch.Tensor
             ) -> None:
        """One batch: forward, distributed backward, optimizer step (the example's)."""
        with API.dist_autograd.context() as context_id:
            output = self.model(indices, offsets)
            loss = self.criterion(output, target)
            API.dist_autograd.backward(context_id, [loss])
            self.opt.step(context_id)


def _run_trainer(emb_rref: Any, rank: int, port: int, epochs: int) -> dict[str, Any]:
    """The example's training loop; seconds per epoch and the final dense weight."""
    trainer = Trainer(emb_rref, rank, port)
    model = trainer.model
    seconds = []
    for _ in range(WARMUP_EPOCHS + epochs):
        start = time.perf_counter()
        for indices, offsets, target in get_next_batch(rank):
            trainer.step(indices, offsets, target)
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds[WARMUP_EPOCHS:],
            "weight": model.fc.module.weight.detach().clone()}


def measure_hybrid(ns: SimpleNamespace, port: int, epochs: int) -> dict[str, Any]:
    """On the master: run both trainers, report ms per epoch (the slower trainer's)."""
    emb_rref = ns.rpc.remote("ps", torch.nn.EmbeddingBag,
                             args=(NUM_EMBEDDINGS, EMBEDDING_DIM), kwargs={"mode": "sum"})
    futs = [ns.rpc.rpc_async(f"trainer{r}", _run_trainer, args=(emb_rref, r, port, epochs))
            for r in (0, 1)]
    out = [fut.wait() for fut in futs]
    per_epoch = [max(a, b) * 1e3 for a, b in zip(out[0]["seconds"], out[1]["seconds"],
                                                 strict=True)]
    equal = bool(torch.equal(out[0]["weight"], out[1]["weight"]))
    if not equal:
        raise AssertionError("DDP weights differ between the trainers")
    return {"value": statistics.median(per_epoch), "samples": per_epoch, "batches": BATCHES,
            "ddp_weights_identical": equal}


@contextlib.contextmanager
def _gloo_interface() -> Iterator[None]:
    """``GLOO_SOCKET_IFNAME`` set to this host's interface for the block, on a host of a
    world across hosts (where the bench names it); left as it was afterwards."""
    interface = os.environ.get(placement.HOST_IFNAME_VAR)
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = before


def hybrid_world(rank: int, spec: WorldSpec, init_method: str, recorder: Recorder) -> None:
    """Entry point of the four-worker world (ranks: trainer0, trainer1, master, ps)."""
    global API
    ns = API = systems.api(spec.system)
    port = spec.params["ddp_port"]
    world_size = 4
    if rank == 2:
        systems.init_worker(ns, "master", rank, world_size, init_method)
        recorder.run("hybrid", measure_hybrid, ns, port, spec.params["epochs"])
        note_routes(recorder, ns, ["trainer0", "trainer1", "master", "ps"])
        recorder.done()
    elif rank <= 1:
        if not systems.in_process(spec.system):
            host = spec.params.get("ddp_host", "127.0.0.1")
            with _gloo_interface():
                dist.init_process_group(backend="gloo", rank=rank, world_size=2,
                                        init_method=f"tcp://{host}:{port}",
                                        timeout=DDP_TIMEOUT)
        systems.init_worker(ns, f"trainer{rank}", rank, world_size, init_method)
    else:
        systems.init_worker(ns, "ps", rank, world_size, init_method)
    ns.rpc.shutdown()
    if rank <= 1 and dist.is_initialized():
        dist.destroy_process_group()
