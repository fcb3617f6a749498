"""fairscale's ``DistributedPipeline`` (fairscale 0.4.13), unchanged, on two workers.

The scenarios of fairscale's own tests of it, on CPU (written here from scratch): build
pipelines of ``RemoteModule`` layers on one and two workers, run them forward (whole
and in micro-batches, with each checkpointing mode), backward through
``DistributedLoss``, and train two steps with ``DistributedOptimizer`` (a sequence, a
layer split in two shards that meet again, and the same graph traced from an
``nn.Sequential``). Its backward is where distributed autograd is tested hardest: the
micro-batches' gradients reach each stage's parameters through paths that cross
different numbers of calls, and its checkpoint pops saved state once per backward.

Prints ``RESULT <json>``: which RPC ran it and each scenario's outcome (sums and losses
rounded to 5 places, or the error). Arguments name scenarios to run alone.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

warnings.filterwarnings("ignore", category=FutureWarning)  # (fairscale's own use of torch)

import torch  # noqa: E402
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
from fairscale.experimental.nn.distributed_pipeline import (  # noqa: E402
    DistributedLoss,
    DistributedPipeline,
    PipelineModulesGraph,
)
from fairscale.experimental.nn.distributed_pipeline.trace import make_graph  # noqa: E402
from torch.distributed.nn import RemoteModule  # noqa: E402
from torch.distributed.optim import DistributedOptimizer  # noqa: E402

W0, W1 = "worker0/cpu", "worker1/cpu"


def sequence(layers: list[tuple[type[nn.Module], tuple[Any, ...]]], devices: list[str],
             **options: Any) -> DistributedPipeline:
    graph = PipelineModulesGraph()
    graph.add_sequence([RemoteModule(device, cls, args, {})
                        for (cls, args), device in zip(layers, devices, strict=True)], [0])
    return DistributedPipeline(graph, **options)


def fill(parameter: rpc.RRef, number: int) -> None:
    """Give a parameter values that depend only on its shape and its number."""
    with torch.no_grad():
        tensor = parameter.local_value()
        tensor.copy_(torch.linspace(-1.0, 1.0, tensor.numel()).reshape(tensor.shape)
                     * (0.5 + 0.1 * number))


def train(pipe: DistributedPipeline, x: torch.Tensor, steps: int = 2) -> list[float]:
    """``steps`` SGD steps of an MSE loss against the input, from parameters set by
    :func:`fill` (the order in which workers build layers, and so draw their random
    initial values, is not the program's); the losses."""
    for number, parameter in enumerate(pipe.parameter_rrefs()):
        rpc.rpc_sync(parameter.owner(), fill, args=(parameter, number))
    criterion = DistributedLoss(nn.MSELoss)
    optimizer = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.05)
    losses = []
    for _ in range(steps):
        with dist_autograd.context() as context_id:
            loss = criterion(pipe(x), rpc.RRef(x))
            loss.backward(context_id)
            optimizer.step(context_id)
        losses.append(loss.to_here())
    return [round(float(loss), 5) for loss in losses]


class Concatenate(nn.Module):
    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return torch.cat(inputs, dim=1)


class Split(nn.Module):
    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(input, (input.shape[1] + 1) // 2, dim=1)


class Sharded(nn.Module):
    """A linear layer in two shards on two workers, split and concatenated remotely."""

    def __init__(self) -> None:
        super().__init__()
        self.split = RemoteModule(W0, Split, (), {})
        self.shards = nn.ModuleList([RemoteModule(W0, nn.Linear, (2, 2), {}),
                                     RemoteModule(W1, nn.Linear, (2, 2), {})])
        self.concatenate = RemoteModule(W1, Concatenate, ())

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        halves = self.split(input)
        return self.concatenate(*[self.shards[i](halves[i]) for i in range(2)])


def seed(value: int) -> None:
    torch.manual_seed(value)


def seed_everywhere(value: int) -> None:
    """The same random state on both workers (each builds its own layers)."""
    seed(value)
    rpc.rpc_sync("worker1", seed, args=(value,))


def create() -> Any:
    sequence([(nn.Linear, (4, 4))], [W0], chunks=1)
    sequence([(nn.Linear, (4, 4)), (nn.ReLU, ())], [W0, W0], chunks=1)
    pipe = sequence([(nn.Linear, (4, 4)), (nn.ReLU, ())], [W0, W1], chunks=1)
    return len(pipe.parameter_rrefs())


def forward() -> Any:
    relu = sequence([(nn.ReLU, ())], [W0], chunks=1)
    one = relu(torch.tensor([1.0, -1.0])).to_here().tolist()
    chunked = sequence([(nn.ReLU, ())], [W0], chunks=4)
    x = torch.tensor([1.0, -1.0, 2.0, -2.0, 3.0, -3.0, 4.0, -4.0])
    return [one, chunked(x).to_here().tolist()]


def forward_multi(checkpoint: str) -> Callable[[], Any]:
    def run() -> Any:
        seed_everywhere(3)
        x = torch.randn(8, 4, requires_grad=True)
        pipe = sequence([(nn.Linear, (4, 4)), (nn.ReLU, ())], [W0, W1], chunks=4,
                        checkpoint=checkpoint)
        y = pipe(x).to_here()
        return [list(y.shape), y.requires_grad, round(float(y.sum()), 5)]
    return run


def backward() -> Any:
    seed_everywhere(3)
    x = torch.randn(8, 4)
    pipe = sequence([(nn.Linear, (4, 4)), (nn.ReLU, ())], [W0, W1], chunks=4)
    with dist_autograd.context() as context_id:
        DistributedLoss(nn.MSELoss)(pipe(x), rpc.RRef(x)).backward(context_id)
        return len(dist_autograd.get_gradients(context_id))


def update() -> Any:
    seed_everywhere(3)
    x = torch.randn(8, 4)
    return train(sequence([(nn.Linear, (4, 4)), (nn.ReLU, ())], [W0, W1], chunks=4), x)


def multi_input_multi_output() -> Any:
    seed_everywhere(3)
    x = torch.randn(8, 4)
    first = RemoteModule(W0, nn.Linear, (4, 4), {})
    split = RemoteModule(W0, Split, (), {})
    shards = [RemoteModule(W0, nn.Linear, (2, 2), {}), RemoteModule(W1, nn.Linear, (2, 2), {})]
    concatenate = RemoteModule(W1, Concatenate, ())
    graph = PipelineModulesGraph()
    graph.add_sequence([first, split], [0], 2)
    for i, shard in enumerate(shards):
        graph.add_layer(shard, [(split, i)])
    graph.add_layer(concatenate, shards)
    pipe = DistributedPipeline(graph, chunks=4)
    partitions = [[graph.nodes.index(n) for n in p.nodes] for p in pipe.partitions]
    return [partitions, len(pipe.parameter_rrefs()), train(pipe, x)]


def traced_graph() -> Any:
    seed_everywhere(3)
    x = torch.randn(8, 4)
    model = nn.Sequential(RemoteModule(W0, nn.Linear, (4, 4), {}), Sharded(),
                          RemoteModule(W0, nn.Linear, (4, 4), {}))
    graph = make_graph(model)
    pipe = DistributedPipeline(graph, chunks=4)
    partitions = [[graph.nodes.index(n) for n in p.nodes] for p in pipe.partitions]
    return [partitions, len(pipe.parameter_rrefs()), train(pipe, x)]


SCENARIOS: dict[str, Callable[[], Any]] = {
    "create": create,
    "forward": forward,
    "forward_multi_never": forward_multi("never"),
    "forward_multi_always": forward_multi("always"),
    "forward_multi_except_last": forward_multi("except_last"),
    "backward": backward,
    "update": update,
    "multi_input_multi_output_layers": multi_input_multi_output,
    "auto_graph_extract": traced_graph,
}


def run(rank: int, port: int, names: list[str]) -> None:
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                              rpc_timeout=120)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        outcomes: dict[str, Any] = {}
        for name in names:
            try:
                outcomes[name] = SCENARIOS[name]()
            except Exception as exc:  # the outcome is the error; the run goes on
                outcomes[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
                print(f"{name}:\n{traceback.format_exc()}", file=sys.stderr)
        print("RESULT " + json.dumps({"rpc": rpc.rpc_sync.__module__, **outcomes}),
              flush=True)
    rpc.shutdown()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = sys.argv[1:] or list(SCENARIOS)  # (some of them, by name: to look closer)
    # fork: the workers are copies of this process, which imported torch and fairscale
    # once and has started no thread yet (a forkserver imports them again in its server).
    mp.start_processes(run, args=(port, names), nprocs=2, start_method="fork")


if __name__ == "__main__":
    main()
