"""Models and functions the distributed-autograd conformance tests run on other workers.

Modules take a ``seed`` and draw their initial weights from their own generator, so the
same module built on two workers (or locally, for the reference run) starts identical
without touching the process-wide RNG that in-process workers share.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import rpcx
import rpcx.autograd as dist_autograd
from rpcx.functions import async_execution
from rpcx.optim import DistributedOptimizer


def _init_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.rand(param.shape, generator=generator, dtype=param.dtype) - 0.5)
    return module


class Embedding(torch.nn.Module):
    """An embedding table."""

    def __init__(self, tokens: int, dim: int, seed: int) -> None:
        super().__init__()
        self.table = _init_(torch.nn.Embedding(tokens, dim), seed)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        """Look up ``indices``."""
        out: torch.Tensor = self.table(indices)
        return out


class MLP(torch.nn.Module):
    """Two linear layers with a tanh between."""

    def __init__(self, dim_in: int, hidden: int, dim_out: int, seed: int) -> None:
        super().__init__()
        self.net = _init_(
            torch.nn.Sequential(
                torch.nn.Linear(dim_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, dim_out)
            ),
            seed,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layers."""
        out: torch.Tensor = self.net(x)
        return out


class LSTMBlock(torch.nn.Module):
    """An LSTM returning only its output sequence."""

    def __init__(self, dim_in: int, hidden: int, seed: int) -> None:
        super().__init__()
        self.lstm = _init_(torch.nn.LSTM(dim_in, hidden, batch_first=True), seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the sequence through the LSTM."""
        out, _ = self.lstm(x)
        result: torch.Tensor = out
        return result


class Linear(torch.nn.Module):
    """One linear layer."""

    def __init__(self, dim_in: int, dim_out: int, seed: int) -> None:
        super().__init__()
        self.layer = _init_(torch.nn.Linear(dim_in, dim_out), seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer."""
        out: torch.Tensor = self.layer(x)
        return out


# ------------------------------------------------------------------- small functions


def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x * factor`` (a differentiable remote op)."""
    return x * factor


class UnreadableGradient:
    """Stands in for the codec's ``Placed`` in a test: it pickles by naming a function
    that bookkeeping messages may not name, so the worker it is sent to cannot read it."""

    def __init__(self, tensor: torch.Tensor, device: torch.device) -> None:
        self.tensor = tensor
        self.device = device

    def __reduce__(self) -> tuple[Any, ...]:
        return (torch.clone, (self.tensor,))


def square_then_call(x: torch.Tensor, path: list[str]) -> torch.Tensor:
    """``x**2`` here, then the same on each worker of ``path`` in turn (nested calls)."""
    y = x * x
    if not path:
        return y
    out: torch.Tensor = rpcx.rpc_sync(path[0], square_then_call, args=(y, path[1:]))
    return out


class ActInBackward(torch.autograd.Function):
    """Identity forward; backward first calls ``action()`` (raise, crash, wait, signal)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, action: Callable[[], None]) -> torch.Tensor:
        ctx.action = action
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.action()
        return grad, None


def act_in_backward(x: torch.Tensor, action: Callable[[], None]) -> torch.Tensor:
    """``x`` through a node whose backward calls ``action()`` first."""
    out: torch.Tensor = ActInBackward.apply(x, action)  # type: ignore[no-untyped-call]
    return out


def _refuse() -> None:
    raise ValueError("this backward refuses on purpose")


def wait_at_end_of_pass(key: str, timeout: float) -> None:
    """A backward action: queue a callback that runs once the engine has run every node,
    as DDP's wait for its all-reduce does. It waits (at most ``timeout``) for
    :func:`remote.set_event` of ``key`` here, and raises if it was not set in time."""
    from rpcx.testing import remote

    def wait() -> None:
        if not remote.wait_for_event(key, timeout):
            raise TimeoutError(f"event {key} not set within {timeout} s")

    torch.autograd.Variable._execution_engine.queue_callback(wait)


def _set_event_on(worker: str, key: str) -> None:
    from rpcx.testing import remote

    rpcx.rpc_sync(worker, remote.set_event, args=(key,), timeout=60)


def set_event_in_backward(x: torch.Tensor, worker: str, key: str) -> torch.Tensor:
    """``x`` through a node whose backward, here, sets event ``key`` on ``worker``."""
    return act_in_backward(x * 1.0, functools.partial(_set_event_on, worker, key))


def fail_in_backward_then_call(x: torch.Tensor, path: list[str], crash: bool = False
                               ) -> torch.Tensor:
    """Like :func:`square_then_call`, with a node here whose backward raises (or, with
    ``crash``, ends this process)."""
    y = act_in_backward(x * x, functools.partial(os._exit, 3) if crash else _refuse)
    if not path:
        return y
    out: torch.Tensor = rpcx.rpc_sync(path[0], square_then_call, args=(y, path[1:]))
    return out


def open_context_call_then_crash(peer: str) -> None:
    """Open a context, make ``peer`` join it with a call, then end this process inside
    the context: nobody is left to release it."""
    x = torch.ones(2, requires_grad=True)
    with dist_autograd.context():
        rpcx.rpc_sync(peer, scale, args=(x, 2.0))
        os._exit(3)


def use_twice_remotely(x: torch.Tensor, helper: str) -> torch.Tensor:
    """Sends ``x`` to ``helper`` twice and combines the results with ``x`` itself."""
    a: torch.Tensor = rpcx.rpc_sync(helper, scale, args=(x, 2.0))
    b: torch.Tensor = rpcx.rpc_sync(helper, scale, args=(x, 3.0))
    return a * b + x


class ClipGrad(torch.autograd.Function):
    """Identity forward; backward clamps the gradient to [-1, 1] (not linear in it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.clamp(-1.0, 1.0)


def clip_then_fan_out(x: torch.Tensor, peers: list[str]) -> torch.Tensor:
    """Clip-in-backward here, then the result scaled on each of ``peers``, summed."""
    h = ClipGrad.apply(x * 1.0)  # type: ignore[no-untyped-call]
    outs: list[torch.Tensor] = [rpcx.rpc_sync(p, scale, args=(h, 0.8)) for p in peers]
    return torch.stack(outs).sum(dim=0)


def wait_then_forward(key: str, x: torch.Tensor, to: str) -> torch.Tensor:
    """Wait for ``key``'s gate, then send ``x`` on to ``to`` (a nested call)."""
    from rpcx.testing import remote

    remote.wait_for_release(key)
    out: torch.Tensor = rpcx.rpc_sync(to, scale, args=(x, 2.0))
    return out


@async_execution
def scale_twice_in_callbacks(x: torch.Tensor, to: str) -> torch.futures.Future[torch.Tensor]:
    """``x * 6`` by way of two calls to ``to``, the second made from a callback."""
    first = rpcx.rpc_async(to, scale, args=(x, 2.0))
    return first.then(lambda done: rpcx.rpc_sync(to, scale, args=(done.wait(), 3.0)))


def local_gradients(context_id: int, module: rpcx.RRef[torch.nn.Module]) -> list[Any]:
    """The context's gradients (or None) for each parameter of ``module``, here."""
    grads = dist_autograd.get_gradients(context_id)
    return [grads.get(p) for p in module.local_value().parameters()]


def parameters_of(module: rpcx.RRef[torch.nn.Module]) -> list[torch.Tensor]:
    """Copies of ``module``'s parameters."""
    return [p.detach().clone() for p in module.local_value().parameters()]


def grads_are_untouched(module: rpcx.RRef[torch.nn.Module]) -> bool:
    """True if no parameter of ``module`` has a ``.grad`` (gradients go to contexts)."""
    return all(p.grad is None for p in module.local_value().parameters())


def autograd_stats() -> dict[str, int]:
    """This worker's autograd counts after its own context releases have landed."""
    dist_autograd._wait_released()
    stats: dict[str, int] = rpcx.debug_info()["autograd"]
    return stats


def train_against(
    owner_module: rpcx.RRef[torch.nn.Module], inputs: torch.Tensor, steps: int, lr: float
) -> list[list[torch.Tensor]]:
    """A trainer: forward through the remote module, backward, step; returns each
    step's context gradients of the remote module's parameters (fetched from its owner)."""
    params = _param_rrefs(owner_module)
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=lr)
    history = []
    for _ in range(steps):
        with dist_autograd.context() as context_id:
            out = owner_module.rpc_sync().forward(inputs)
            loss = (out * out).sum()
            dist_autograd.backward(context_id, [loss])
            history.append(rpcx.rpc_sync(
                owner_module.owner(), local_gradients, args=(context_id, owner_module)
            ))
            opt.step(context_id)
    return history


def _param_rrefs(module: rpcx.RRef[torch.nn.Module]) -> list[rpcx.RRef[torch.Tensor]]:
    out: list[rpcx.RRef[torch.Tensor]] = rpcx.rpc_sync(
        module.owner(), parameter_rrefs, args=(module,)
    )
    return out


def parameter_rrefs(module: rpcx.RRef[torch.nn.Module]) -> list[rpcx.RRef[torch.Tensor]]:
    """Owner RRefs to each parameter of ``module`` (run on its owner)."""
    return [rpcx.RRef(p) for p in module.local_value().parameters()]


# ------------------------------------------------------------------- DDP + RPC hybrid


class HybridModel(torch.nn.Module):
    """The seeds' hybrid model: a remote embedding bag, then a local DDP-wrapped linear."""

    def __init__(self, emb_rref: rpcx.RRef[torch.nn.Module], fc: torch.nn.Module) -> None:
        super().__init__()
        self.emb_rref = emb_rref
        self.fc = fc

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Remote lookup, local dense layer."""
        emb = self.emb_rref.rpc_sync().forward(indices, offsets)
        out: torch.Tensor = self.fc(emb)
        return out


def embedding_bag(tokens: int, dim: int, seed: int) -> torch.nn.Module:
    """An ``EmbeddingBag(mode="sum")`` with seeded weights."""
    return _init_(torch.nn.EmbeddingBag(tokens, dim, mode="sum"), seed)


def ddp_trainer(
    emb_rref: rpcx.RRef[torch.nn.Module], group_rank: int, store_path: str, steps: int
) -> dict[str, Any]:
    """One of two DDP trainers (the seeds' hybrid program, on the CPU).

    The dense layer is wrapped in DistributedDataParallel over a private gloo group of
    the two trainers; the embedding lives on the parameter server. Returns the dense
    weights after training and, per step, the dense gradients the context received.
    """
    from torch.nn.parallel import DistributedDataParallel

    group = private_gloo_group(store_path, group_rank, 2)
    # Different initial weights on each trainer: DDP must broadcast rank 0's.
    dense = torch.nn.Linear(16, 8)
    _init_(dense, seed=100 + group_rank)
    fc = DistributedDataParallel(dense, process_group=group)
    model = HybridModel(emb_rref, fc)
    params = rpcx.rpc_sync(emb_rref.owner(), parameter_rrefs, args=(emb_rref,))
    params += [rpcx.RRef(p) for p in model.fc.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    criterion = torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(7 + group_rank)  # each trainer its own data
    dense_grads = []
    for _ in range(steps):
        n = int(torch.randint(20, 50, (1,), generator=generator))
        indices = torch.randint(0, 100, (n,), generator=generator)
        offsets = torch.arange(0, n, 5)
        target = torch.randint(0, 8, (len(offsets),), generator=generator)
        with dist_autograd.context() as context_id:
            loss = criterion(model(indices, offsets), target)
            dist_autograd.backward(context_id, [loss])
            grads = dist_autograd.get_gradients(context_id)
            dense_grads.append(grads[dense.weight].clone())
            opt.step(context_id)
    result = {
        "weight": dense.weight.detach().clone(),
        "bias": dense.bias.detach().clone(),
        "dense_grads": dense_grads,
        "grad_untouched": dense.weight.grad is None,
    }
    del group
    return result


def private_gloo_group(store_path: str, rank: int, size: int) -> Any:
    """A gloo ProcessGroup of its own (not the default group), for DDP.

    Built the way ``dist.new_group`` builds one, without needing a default group, so it
    also works for workers that are threads of one process (the loopback backend).
    """
    store = dist.FileStore(store_path, size)  # type: ignore[attr-defined]
    group = dist.ProcessGroup(store, rank, size)
    backend = dist.ProcessGroupGloo(store, rank, size)  # type: ignore[call-arg]
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


def new_store_path() -> str:
    """A fresh file name for a FileStore (the file must not exist yet)."""
    import tempfile

    handle, path = tempfile.mkstemp(prefix="rpcx-ddp-")
    os.close(handle)
    os.unlink(path)
    return path



def call_module(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` on this worker (a RemoteModule received in a call, say)."""
    out: torch.Tensor = module(x)
    return out
