"""The distributed RNN of torch's RPC tutorial, on any system's modules.

The program is the second half of the "Getting started with Distributed RPC Framework"
tutorial (seed 003), on the CPU: a parameter server holds the embedding table and the
decoder, the trainer runs the LSTM locally, and every iteration is a forward pass
through two remote calls, a distributed backward pass and a ``DistributedOptimizer``
step. The code is the tutorial's; the modules it uses are ``API``'s, which every worker
sets to :func:`systems.api`'s namespace with :func:`set_api` before ``init_rpc`` (the
parameter server runs ``_parameter_rrefs``, which needs ``API.rpc.RRef``, too).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

API: SimpleNamespace  # set in each worker by set_api()


def set_api(ns: SimpleNamespace) -> None:
    """Use ``ns``'s modules (see :func:`systems.api`) in this worker."""
    global API
    API = ns


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


# The tutorial's sizes: batch, tokens, embedding, hidden, indices, LSTM layers.
SIZES = (5, 10, 2, 3, 3, 4)


def run_trainer(ps: str, iterations: int, warmup: int,
                mark: Callable[[str], None] | None = None,
                phases: dict[str, list[float]] | None = None) -> list[float]:
    """The tutorial's training loop against parameter server ``ps``.

    Returns the seconds of each iteration after ``warmup``. ``mark("start")`` runs just
    before the first of them and ``mark("end")`` just after the last (the per-step
    accounting reads its counters there). ``phases``, if given, gets each iteration's
    seconds of ``"forward"`` (to the loss), ``"backward"`` and ``"step"`` (the
    optimizer's) appended.
    """
    batch, ntoken, ninp, nhid, nindices, nlayers = SIZES
    torch.manual_seed(0)
    hidden = (torch.randn(nlayers, nindices, nhid), torch.randn(nlayers, nindices, nhid))
    model = RNNModel(ps, ntoken, ninp, nhid, nlayers)
    opt = API.DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    times = []
    for i in range(warmup + iterations):
        if i == warmup and mark is not None:
            mark("start")
        data = torch.randint(0, ntoken, (batch, nindices))
        target = torch.randint(0, nindices, (batch, ntoken))
        start = time.perf_counter()
        with API.dist_autograd.context() as context_id:
            hidden[0].detach_()
            hidden[1].detach_()
            output, hidden = model(data, hidden)
            loss = criterion(output, target)
            forwarded = time.perf_counter()
            API.dist_autograd.backward(context_id, [loss])
            backward = time.perf_counter()
            opt.step(context_id)
            stepped = time.perf_counter()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            if phases is not None:
                phases.setdefault("forward", []).append(forwarded - start)
                phases.setdefault("backward", []).append(backward - forwarded)
                phases.setdefault("step", []).append(stepped - backward)
    if mark is not None:
        mark("end")
    return times
