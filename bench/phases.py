"""A distributed RNN's training step, phase by phase, on torch and on rpcx backends.

Two models: ``tutorial``, the RPC tutorial's RNN (``rnn_model.py``: SGD, the remote
modules called through ``rpc_sync`` of a helper), and ``example``, examples/rnn (RRef
proxies, Adam). Each step of the trainer is timed in four phases: the forward pass
(the two remote modules and the local LSTM, and the loss), ``dist_autograd.backward``,
the ``DistributedOptimizer`` step, and the whole step with its context. ``--local`` adds
a line for the same model with every module in the one process (``loss.backward()`` and
the local optimizer): the floor of any RPC version of the step.

Rounds interleave the systems (each round runs every system once, in ``--systems``
order); the table gives, per system and phase, the median per step over ``--steps``
steps after ``--warmup``, as the range over rounds. Usage::

    python bench/phases.py [--model tutorial|example] [--systems torch,auto]
                           [--rounds 2] [--steps 400] [--warmup 100] [--local]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

HERE = pathlib.Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "rnn"
PHASES = ("forward", "backward", "step", "all")


def _tutorial_local() -> tuple[Callable[[], Any], Callable[[Any], Any], Any]:
    """The tutorial's model in one process: (batch maker, forward from a batch to the
    loss, optimizer). (Its RPC version is ``rnn_model.run_trainer``'s.)"""
    import rnn_model

    batch, ntoken, ninp, nhid, nindices, nlayers = rnn_model.SIZES
    torch.manual_seed(0)
    hidden = [(torch.randn(nlayers, nindices, nhid), torch.randn(nlayers, nindices, nhid))]
    criterion = torch.nn.CrossEntropyLoss()
    emb = rnn_model.EmbeddingTable(ntoken, ninp, 0.5)
    lstm = torch.nn.LSTM(ninp, nhid, nlayers, dropout=0.5)
    dec = rnn_model.Decoder(ntoken, nhid, 0.5)
    optimizer = torch.optim.SGD([*emb.parameters(), *lstm.parameters(), *dec.parameters()],
                                lr=0.05)

    def make() -> Any:
        return (torch.randint(0, ntoken, (batch, nindices)),
                torch.randint(0, nindices, (batch, ntoken)))

    def forward(data: Any) -> Any:
        inputs, target = data
        hidden[0][0].detach_()
        hidden[0][1].detach_()
        output, hidden[0] = lstm(emb(inputs), hidden[0])
        return criterion(dec(output), target)

    return make, forward, optimizer


def _example(ns: Any, local: bool) -> tuple[Callable[[], Any], Callable[[Any], Any], Any]:
    """examples/rnn's model: (batch maker, forward from a batch to the loss, optimizer)."""
    import main as example

    criterion = torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(0)
    if local:
        emb, dec = example.EmbeddingTable(1), example.Decoder(3)
        lstm = example._seeded(torch.nn.LSTM(example.EMBED, example.HIDDEN, example.LAYERS), 2)
        params = [*emb.parameters(), *lstm.parameters(), *dec.parameters()]
        optimizer: Any = torch.optim.Adam(params, lr=0.02)

        def model(tokens: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = dec(lstm(emb(tokens))[0])
            return out
    else:
        model = example.SplitLanguageModel("ps")
        optimizer = ns.DistributedOptimizer(torch.optim.Adam, model.parameter_rrefs(), lr=0.02)

    def forward(data: Any) -> Any:
        inputs, targets = data
        logits = model(inputs)
        return criterion(logits.reshape(-1, example.VOCAB), targets.reshape(-1))

    return (lambda: example.batch(generator)), forward, optimizer


def _steps(ns: Any, args: argparse.Namespace, local: bool) -> dict[str, float]:
    if args.model == "tutorial" and not local:
        import rnn_model

        phases: dict[str, list[float]] = {}
        steps = rnn_model.run_trainer("ps", args.steps, args.warmup, phases=phases)
        phases["all"] = steps
        return {phase: statistics.median(phases[phase]) * 1e3 for phase in PHASES}
    make, forward, optimizer = _tutorial_local() if args.model == "tutorial" else _example(
        ns, local)
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for step in range(args.warmup + args.steps):
        data = make()
        started = time.perf_counter()
        if local:
            optimizer.zero_grad()
            loss = forward(data)
            forwarded = time.perf_counter()
            loss.backward()
            backward = time.perf_counter()
            optimizer.step()
            stepped = time.perf_counter()
        else:
            with ns.dist_autograd.context() as context_id:
                loss = forward(data)
                forwarded = time.perf_counter()
                ns.dist_autograd.backward(context_id, [loss])
                backward = time.perf_counter()
                optimizer.step(context_id)
                stepped = time.perf_counter()
        ended = time.perf_counter()
        if step >= args.warmup:
            for phase, seconds in zip(PHASES, (forwarded - started, backward - forwarded,
                                               stepped - backward, ended - started),
                                      strict=True):
                times[phase].append(seconds)
    return {phase: statistics.median(values) * 1e3 for phase, values in times.items()}


def _worker(rank: int, system: str, args: argparse.Namespace, init_method: str, out: str
            ) -> None:
    import systems

    sys.path.insert(0, str(EXAMPLE))  # (both workers unpickle the example's modules)
    torch.set_num_threads(1)
    ns = systems.api(system)
    import rnn_model

    rnn_model.set_api(ns)
    if args.model == "example" and system == systems.BASELINE:
        import main as example

        example.rpcx = ns.rpc  # (the example's RRef, remote and rpc_sync: torch's)
    systems.init_worker(ns, "trainer" if rank == 0 else "ps", rank, 2, init_method)
    if rank == 0:
        result = _steps(ns, args, local=False)
        pathlib.Path(out).write_text(json.dumps(result))
    ns.rpc.shutdown()


def _run(system: str, args: argparse.Namespace) -> dict[str, float]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(_worker, args=(system, args, "file://" + os.path.join(tmp, "rdv"),
                                          out), nprocs=2, start_method="spawn")
        result: dict[str, float] = json.loads(pathlib.Path(out).read_text())
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", choices=("tutorial", "example"), default="tutorial")
    parser.add_argument("--systems", default="torch,auto")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--local", action="store_true",
                        help="also time the model with every module in one process")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(EXAMPLE))
    names = args.systems.split(",") + (["local"] if args.local else [])
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for round_number in range(1, args.rounds + 1):
        for name in names:
            if name == "local":
                import systems

                torch.set_num_threads(1)
                result = _steps(systems.api("torch"), args, local=True)
            else:
                result = _run(name, args)
            results[name].append(result)
            print(f"round {round_number}/{args.rounds}: {name}: " + ", ".join(
                f"{phase} {ms:.3f} ms" for phase, ms in result.items()), file=sys.stderr,
                flush=True)
    print(f"{args.model} RNN, ms per step (median over {args.steps} steps; range over "
          f"{args.rounds} rounds)\n")
    print("| system | " + " | ".join(PHASES) + " |")
    print("|---|" + "---:|" * len(PHASES))
    for name, rounds in results.items():
        cells = []
        for phase in PHASES:
            values = [r[phase] for r in rounds]
            cells.append(f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1
                         else f"{values[0]:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
