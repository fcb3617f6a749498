"""PyG's distributed RPC layer (``torch_geometric.distributed.rpc``), unchanged.

PyG's distributed neighbour sampler and feature store sit on this layer: its own
``init_rpc`` (TensorPipe options, then a global barrier through torch's private
``rpc.api._all_gather``), ``rpc_partition_to_workers``, registered call objects run with
``rpc_async``/``rpc_sync`` through an ``RPCRouter``, ``rpc_is_initialized`` (torch's
private ``_is_current_rpc_agent_set``) and ``shutdown_rpc``. Two workers, each owning
rows of a feature table; no graph data needed. Prints ``RESULT <json>``: which RPC ran
it, the partition map, rows fetched from the other worker, a sum computed there.
"""

from __future__ import annotations

import json
import socket
import sys

import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch_geometric.distributed import rpc as pyg_rpc
from torch_geometric.distributed.dist_context import DistContext


class Lookup(pyg_rpc.RPCCallBase):
    """A worker's feature rows: ``100 * rank + i`` for row ``i``."""

    def __init__(self, rank: int) -> None:
        self.features = torch.arange(10.0).unsqueeze(1) + 100 * rank

    def rpc_async(self, ids: torch.Tensor) -> torch.Tensor:
        return self.features[ids]

    def rpc_sync(self, ids: torch.Tensor) -> torch.Tensor:
        return self.features[ids].sum()


def run(rank: int, port: int, out: str) -> None:
    context = DistContext(rank=rank, global_rank=rank, world_size=2, global_world_size=2,
                          group_name="pyg")
    pyg_rpc.init_rpc(context, "127.0.0.1", port, rpc_timeout=60)
    try:
        partitions = pyg_rpc.rpc_partition_to_workers(context, 2, rank)
        router = pyg_rpc.RPCRouter(partitions)
        call_id = pyg_rpc.rpc_register(Lookup(rank))
        pyg_rpc.global_barrier(timeout=60)
        other = router.get_to_worker(1 - rank)
        rows = pyg_rpc.rpc_async(other, call_id, args=(torch.tensor([1, 3, 5]),)).wait()
        total = pyg_rpc.rpc_sync(other, call_id, args=(torch.tensor([0, 9]),)).item()
        pyg_rpc.global_barrier(timeout=60)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"rpc": rpc.rpc_sync.__module__, "partitions": partitions,
                           "rows": rows.flatten().tolist(), "sum": total,
                           "initialized": pyg_rpc.rpc_is_initialized()}, f)
    finally:
        pyg_rpc.shutdown_rpc(f"pyg-{rank}")


def main() -> None:
    out = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: the workers are copies of this process, which imported torch and the library
    # once and has started no thread yet (a forkserver imports them again in its server).
    mp.start_processes(run, args=(port, out), nprocs=2, start_method="fork")
    with open(out) as f:
        print("RESULT " + f.read(), flush=True)


if __name__ == "__main__":
    main()
