"""Per-iteration time of the RPC tutorial's distributed RNN, rpcx against torch.

The program is the second half of the "Getting started with Distributed RPC Framework"
tutorial (seed 003), on the CPU: a parameter server ``ps`` holds the embedding table and
the decoder, the ``trainer`` runs the LSTM locally, and every iteration is a forward pass
through two remote calls, a distributed backward pass and a ``DistributedOptimizer``
step. The same code runs on torch.distributed.rpc and on each rpcx backend (only the
modules it is given differ); the trainer reports milliseconds per iteration. Usage::

    python bench/bench_rnn.py [--systems torch,gloo,loopback] [--iterations 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn


def _api(system: str) -> SimpleNamespace:
    """The tutorial's imports, from torch or from rpcx."""
    if system == "torch":
        import torch.distributed.autograd as dist_autograd
        import torch.distributed.rpc as rpc
        from torch.distributed.optim import DistributedOptimizer
    else:
        import rpcx as rpc
        import rpcx.autograd as dist_autograd
        from rpcx.optim import DistributedOptimizer
    return SimpleNamespace(
        rpc=rpc, dist_autograd=dist_autograd, DistributedOptimizer=DistributedOptimizer
    )


API: SimpleNamespace  # set in each worker


# ---------------------------------------------------------------- the tutorial's model


def _call_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    args = [method, rref, *list(args)]  # type: ignore[assignment]
    return API.rpc.rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


def _parameter_rrefs(module: nn.Module) -> list[Any]:
    return [API.rpc.RRef(param) for param in module.parameters()]


class EmbeddingTable(nn.Module):
    """Encoding layers of the RNNModel (on the CPU here)."""

    def __init__(self, ntoken: int, ninp: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.encoder.weight.data.uniform_(-0.1, 0.1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(self.encoder(input))
        return out


class Decoder(nn.Module):
    """The output layer."""

    def __init__(self, ntoken: int, nhid: int, dropout: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.bias.data.zero_()
        self.decoder.weight.data.uniform_(-0.1, 0.1)

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.decoder(self.drop(output))
        return out


class RNNModel(nn.Module):
    """Embedding and decoder on the parameter server, LSTM here."""

    def __init__(self, ps: str, ntoken: int, ninp: int, nhid: int, nlayers: int,
                 dropout: float = 0.5) -> None:
        super().__init__()
        self.emb_table_rref = API.rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout))
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder_rref = API.rpc.remote(ps, Decoder, args=(ntoken, nhid, dropout))

    def forward(self, input: torch.Tensor, hidden: Any) -> Any:
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, input)
        output, hidden = self.rnn(emb, hidden)
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self) -> list[Any]:
        remote_params = []
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_table_rref))
        remote_params.extend(_parameter_rrefs(self.rnn))
        remote_params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return remote_params


def run_trainer(iterations: int, warmup: int) -> list[float]:
    """The tutorial's training loop; seconds per iteration after ``warmup``."""
    batch, ntoken, ninp, nhid, nindices, nlayers = 5, 10, 2, 3, 3, 4
    torch.manual_seed(0)
    hidden = (torch.randn(nlayers, nindices, nhid), torch.randn(nlayers, nindices, nhid))
    model = RNNModel("ps", ntoken, ninp, nhid, nlayers)
    opt = API.DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    times = []
    for i in range(warmup + iterations):
        data = torch.randint(0, ntoken, (batch, nindices))
        target = torch.randint(0, nindices, (batch, ntoken))
        start = time.perf_counter()
        with API.dist_autograd.context() as context_id:
            hidden[0].detach_()
            hidden[1].detach_()
            output, hidden = model(data, hidden)
            loss = criterion(output, target)
            API.dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


# ---------------------------------------------------------------------------- driver


def _worker(rank: int, system: str, init_method: str, iterations: int, out_path: str) -> None:
    global API
    API = _api(system)
    options = API.rpc.TensorPipeRpcBackendOptions(init_method=init_method)
    kwargs = {} if system == "torch" else {"backend": system}
    name = "trainer" if rank == 1 else "ps"
    API.rpc.init_rpc(name, rank=rank, world_size=2, rpc_backend_options=options, **kwargs)
    if rank == 1:
        times = run_trainer(iterations, warmup=max(10, iterations // 10))
        pathlib.Path(out_path).write_text(json.dumps(times))
    API.rpc.shutdown()


def run_system(system: str, iterations: int) -> float:
    """Milliseconds per iteration (median) of one two-worker run of ``system``."""
    with tempfile.TemporaryDirectory() as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        out_path = os.path.join(tmp, "times.json")
        args = (system, init_method, iterations, out_path)
        if system == "loopback":
            import rpcx

            rpcx.spawn(_worker, args=args, nprocs=2, backend="loopback")
        else:
            mp.start_processes(_worker, args=args, nprocs=2, start_method="spawn")
        times = json.loads(pathlib.Path(out_path).read_text())
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", default="torch,gloo,tensorpipe,loopback")
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternate the systems this many times; report medians")
    args = parser.parse_args()
    systems = args.systems.split(",")
    if "torch" in systems:
        try:
            import numpy  # noqa: F401
        except ImportError:
            print("torch.distributed.rpc needs numpy for init_rpc: pip install numpy",
                  file=sys.stderr)
            return 2
    per_round: dict[str, list[float]] = {s: [] for s in systems}
    for round_index in range(args.rounds):
        for system in systems:
            print(f"round {round_index + 1}/{args.rounds}: {system} ...", file=sys.stderr,
                  flush=True)
            per_round[system].append(run_system(system, args.iterations))
    summary = {s: statistics.median(v) for s, v in per_round.items()}
    base = summary.get("torch")
    print(f"{'system':<10}{'ms / iteration':>18}")
    for system, ms in summary.items():
        ratio = f" ({base / ms:.2f}x)" if base and system != "torch" else ""
        print(f"{system:<10}{ms:>12.2f}{ratio}")
    print("distributed RNN of the RPC tutorial, trainer + ps; ratio >1 means faster than torch")
    out_dir = pathlib.Path(__file__).parent / "results"
    out_dir.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    (out_dir / f"rnn-{stamp}.json").write_text(
        json.dumps({"ms_per_iteration": summary, "rounds": per_round,
                    "iterations": args.iterations}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
