"""DDP + RPC hybrid training: torch's "Combining DDP with the Distributed RPC Framework"
program (the seeds' hybrid example) on rpcx, on the CPU.

Four workers: a master, a parameter server ``ps`` holding an ``EmbeddingBag``, and two
trainers. Each trainer wraps its dense layer in ``DistributedDataParallel`` over a gloo
process group of the two trainers, looks embeddings up on the parameter server through
an RRef, runs ``rpcx.autograd.backward`` and steps a ``DistributedOptimizer`` over both
the remote embedding and its local dense parameters. DDP averages the dense gradients
inside the distributed backward pass, so the two trainers' dense weights stay equal.

    python examples/ddp_rpc_hybrid.py            # the default backend
    RPCX_BACKEND=loopback python examples/ddp_rpc_hybrid.py

Differences from the torch program: imports; ``.cuda()`` calls dropped (so it runs on
CPU-only machines; CUDA tensors work with device maps, see docs/user-guide.md); fewer
epochs; and, on the loopback backend, where all workers are threads of one process,
the trainers build their gloo group directly instead of with ``init_process_group``
(the default process group is one per process).
"""

import os
import random
import tempfile

import torch
import torch.distributed as dist
from torch import optim
from torch.nn.parallel import DistributedDataParallel as DDP

# --- the imports that differ from the torch program ----------------------------------
import rpcx as mp  # was: import torch.multiprocessing as mp
import rpcx as rpc  # was: import torch.distributed.rpc as rpc
import rpcx.autograd as dist_autograd  # was: import torch.distributed.autograd as ...
from rpcx import RRef, TensorPipeRpcBackendOptions
from rpcx.optim import DistributedOptimizer  # was: from torch.distributed.optim import ...
from rpcx.registry import resolve_backend

# --------------------------------------------------------------------------------------

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
EPOCHS = 3


class HybridModel(torch.nn.Module):
    """A remote embedding bag (the sparse part) and a DDP-replicated linear layer."""

    def __init__(self, emb_rref, group):
        super().__init__()
        self.emb_rref = emb_rref
        self.fc = DDP(torch.nn.Linear(16, 8), process_group=group)

    def forward(self, indices, offsets):
        emb_lookup = self.emb_rref.rpc_sync().forward(indices, offsets)
        return self.fc(emb_lookup)


def _retrieve_embedding_parameters(emb_rref):
    return [RRef(param) for param in emb_rref.local_value().parameters()]


def get_next_batch(rank):
    for _ in range(10):
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


def _trainer_group(rank, store_path):
    """The two trainers' gloo group: the default group where there is one per trainer."""
    if not resolve_backend(None).capabilities.in_process:
        return None  # init_process_group ran: DDP uses the default group
    store = dist.FileStore(store_path, 2)
    group = dist.ProcessGroup(store, rank, 2)
    backend = dist.ProcessGroupGloo(store, rank, 2)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def _run_trainer(emb_rref, rank, store_path):
    random.seed(rank)
    torch.manual_seed(rank)  # different initial weights: DDP broadcasts rank 0's
    model = HybridModel(emb_rref, _trainer_group(rank, store_path))
    model_parameter_rrefs = rpc.rpc_sync("ps", _retrieve_embedding_parameters, args=(emb_rref,))
    for param in model.parameters():
        model_parameter_rrefs.append(RRef(param))
    opt = DistributedOptimizer(optim.SGD, model_parameter_rrefs, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    for epoch in range(EPOCHS):
        for indices, offsets, target in get_next_batch(rank):
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
        print(f"trainer{rank}: epoch {epoch} done, last loss {loss.item():.4f}", flush=True)
    return model.fc.module.weight.detach().clone()


def run_worker(rank, world_size, rendezvous_dir):
    store_path = os.path.join(rendezvous_dir, "trainers")
    rpc_backend_options = TensorPipeRpcBackendOptions()
    rpc_backend_options.init_method = "file://" + os.path.join(rendezvous_dir, "rpc")
    if rank == 2:
        rpc.init_rpc("master", rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_backend_options)
        emb_rref = rpc.remote("ps", torch.nn.EmbeddingBag,
                              args=(NUM_EMBEDDINGS, EMBEDDING_DIM), kwargs={"mode": "sum"})
        futs = [rpc.rpc_async(f"trainer{r}", _run_trainer, args=(emb_rref, r, store_path))
                for r in (0, 1)]
        weights = [fut.wait() for fut in futs]
        print(f"DDP weights identical on both trainers: {torch.equal(*weights)}", flush=True)
    elif rank <= 1:
        if not resolve_backend(None).capabilities.in_process:
            dist.init_process_group(backend="gloo", rank=rank, world_size=2,
                                    init_method="file://" + store_path)
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_backend_options)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size,
                     rpc_backend_options=rpc_backend_options)
    rpc.shutdown()
    if rank <= 1 and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as rendezvous_dir:
        mp.spawn(run_worker, args=(4, rendezvous_dir), nprocs=4, join=True)
    print("done")
