"""A language model split across two workers: distributed autograd and optimizer.

The pattern of the RPC tutorial's "Distributed RNN": the parameter server ``ps`` holds
the embedding table and the decoder, the trainer runs the LSTM between them. Each
iteration is a forward pass through two remote calls, one ``rpcx.autograd.backward``
that reaches the parameters on both workers, and one ``DistributedOptimizer`` step
that updates them where they live.

The text is synthetic and learnable: token ``t`` is always followed by ``(5t + 3) mod
V``, from a random first token, so a model that has learned the rule predicts every
token after the first.

    python examples/rnn/main.py                           # default backend, rpcx.spawn
    python examples/rnn/main.py --backend loopback --epochs 10
    torchrun --nproc-per-node 2 examples/rnn/main.py --backend gloo

Exit status 0 when the trainer's accuracy on the last epoch passes ``--target``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

import rpcx
import rpcx.autograd as dist_autograd
from rpcx.optim import DistributedOptimizer

TRAINER, PS = 0, 1  # the trainer is rank 0: rpcx.launch returns its verdict
VOCAB, EMBED, HIDDEN, LAYERS = 16, 8, 32, 2
SEQUENCE, BATCH = 12, 16


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    """``module`` with weights drawn from its own generator (the same on every backend)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_((torch.rand(param.shape, generator=generator) - 0.5) * 0.4)
    return module


class EmbeddingTable(nn.Module):
    """Tokens -> vectors; lives on the parameter server."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.encoder = _seeded(nn.Embedding(VOCAB, EMBED), seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.encoder(tokens)
        return out


class Decoder(nn.Module):
    """Hidden states -> logits over the vocabulary; lives on the parameter server."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.decoder = _seeded(nn.Linear(HIDDEN, VOCAB), seed)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.decoder(hidden)
        return out


def parameter_rrefs(module: nn.Module) -> list[rpcx.RRef[torch.Tensor]]:
    """An RRef to each of ``module``'s parameters, owned where it runs."""
    return [rpcx.RRef(param) for param in module.parameters()]


def _remote_parameters(module: rpcx.RRef[nn.Module]) -> list[rpcx.RRef[torch.Tensor]]:
    return parameter_rrefs(module.local_value())


class SplitLanguageModel(nn.Module):
    """Embedding and decoder on ``ps`` (through RRefs), the LSTM here."""

    def __init__(self, ps: str) -> None:
        super().__init__()
        self.embedding = rpcx.remote(ps, EmbeddingTable, args=(1,))
        self.lstm = _seeded(nn.LSTM(EMBED, HIDDEN, LAYERS), 2)
        self.decoder = rpcx.remote(ps, Decoder, args=(3,))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded = self.embedding.rpc_sync().forward(tokens)
        hidden, _ = self.lstm(embedded)
        logits: torch.Tensor = self.decoder.rpc_sync().forward(hidden)
        return logits

    def parameter_rrefs(self) -> list[rpcx.RRef[torch.Tensor]]:
        """Every parameter as an RRef: the remote ones from their owner, the LSTM's here."""
        remote = [rpcx.rpc_sync(rref.owner(), _remote_parameters, args=(rref,))
                  for rref in (self.embedding, self.decoder)]
        return remote[0] + parameter_rrefs(self.lstm) + remote[1]


def batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, both ``[SEQUENCE, BATCH]``."""
    tokens = [torch.randint(0, VOCAB, (BATCH,), generator=generator)]
    for _ in range(SEQUENCE):
        tokens.append((5 * tokens[-1] + 3) % VOCAB)
    text = torch.stack(tokens)
    return text[:-1], text[1:]


def train(args: argparse.Namespace) -> bool:
    """The trainer's loop; True when the last epoch's accuracy passes the target."""
    model = SplitLanguageModel("ps")
    optimizer = DistributedOptimizer(torch.optim.Adam, model.parameter_rrefs(), lr=0.02)
    criterion = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(args.seed)
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        started, total_loss, correct, counted = time.perf_counter(), 0.0, 0, 0
        for _ in range(args.iterations):
            inputs, targets = batch(generator)
            with dist_autograd.context() as context_id:
                logits = model(inputs)
                loss = criterion(logits.reshape(-1, VOCAB), targets.reshape(-1))
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
            total_loss += loss.item()
            # The first prediction of a sequence only sees its first token: skip it.
            predicted = logits[1:].argmax(dim=-1)
            correct += int((predicted == targets[1:]).sum())
            counted += predicted.numel()
        accuracy = correct / counted
        elapsed = time.perf_counter() - started
        print(f"epoch {epoch:2d}  loss {total_loss / args.iterations:.4f}  "
              f"accuracy {accuracy:.3f}  {elapsed * 1e3 / args.iterations:.2f} ms/iteration",
              flush=True)
    passed = accuracy >= args.target
    print(f"accuracy {accuracy:.3f} {'>=' if passed else '<'} target {args.target}")
    return passed


def run_worker(worker: rpcx.LaunchedWorker, args: argparse.Namespace) -> bool:
    """The trainer trains; the parameter server only serves."""
    options = rpcx.TensorPipeRpcBackendOptions(init_method=worker.init_method(), rpc_timeout=120)
    name = "trainer" if worker.rank == TRAINER else "ps"
    rpcx.init_rpc(name, rank=worker.rank, world_size=2, backend=args.backend,
                  rpc_backend_options=options)
    passed = True
    if worker.rank == TRAINER:
        backend = rpcx.debug_info()["backend"]  # the one init_rpc chose
        print(f"a language model split over trainer and ps on the {backend!r} backend: "
              f"{args.epochs} epochs of {args.iterations} iterations", flush=True)
        passed = train(args)
    rpcx.shutdown()
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default=None,
                        help="rpcx backend (default: $RPCX_BACKEND, else rpcx's default)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=25, help="iterations per epoch")
    parser.add_argument("--target", type=float, default=0.9,
                        help="last epoch's next-token accuracy that counts as learned")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    passed = rpcx.launch(run_worker, args=(args,), nprocs=2, backend=args.backend)
    if not rpcx.under_torchrun():
        print("done" if passed else "FAILED")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
