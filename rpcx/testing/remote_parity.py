"""Functions the torch-parity conformance tests (:mod:`rpcx.testing.conformance_parity`)
run on other workers. They live in the package so every worker process can import them.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

import rpcx
import rpcx.autograd as dist_autograd
from rpcx._core import context as _context
from rpcx.messages import MessageKind
from rpcx.testing import training

# ------------------------------------------------------------------------------ tensors


def layout_of(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], tuple[int, ...], bool, bool]:
    """``(layout, shape, strides or (), contiguous, requires_grad)`` as received here."""
    strides = tuple(tensor.stride()) if tensor.layout is torch.strided else ()
    contiguous = tensor.is_contiguous() if tensor.layout is torch.strided else False
    return str(tensor.layout), tuple(tensor.shape), strides, contiguous, tensor.requires_grad


def non_cont_test(t_view: torch.Tensor, t_cont: torch.Tensor) -> torch.Tensor:
    """torch's ``non_cont_test``: the view must arrive as a view, the copy contiguous."""
    if t_view.is_contiguous():
        raise AssertionError("t_view arrived contiguous")
    if not t_cont.is_contiguous():
        raise AssertionError("t_cont arrived non-contiguous")
    if not torch.equal(t_view, t_cont):
        raise AssertionError("t_view differs from t_cont")
    return t_view


def sparse_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` of two sparse tensors, checking they arrived sparse."""
    if not (a.is_sparse and b.is_sparse):
        raise AssertionError(f"arrived as {a.layout} and {b.layout}")
    return torch.add(a, b)


# ------------------------------------------------------------------------------- RRefs


def check_rref_confirmed(rref: rpcx.RRef[Any]) -> bool:
    """torch's ``check_rref_confirmed``: no waiting, the state the call runs with."""
    return rref.confirmed_by_owner()


def delay_confirmations(seconds: float) -> None:
    """Make this worker (an owner) send its RREF_CONFIRM messages ``seconds`` late.

    A fault injector: it delays a message, so that a test can tell whether a call runs
    before or after its RRef's confirmation arrives. Undo with
    :func:`restore_confirmations`.
    """
    agent = _context.current_agent()
    original = type(agent).send_one_way.__get__(agent)

    def notify(dst: Any, kind: MessageKind, payload: Any) -> None:
        if kind != MessageKind.RREF_CONFIRM:
            original(dst, kind, payload)
            return
        timer = threading.Timer(seconds, original, args=(dst, kind, payload))
        timer.daemon = True
        timer.start()

    setattr(agent, "send_one_way", notify)  # noqa: B010  (an instance attribute shadows the method)


def restore_confirmations() -> None:
    """Undo :func:`delay_confirmations` on this worker."""
    agent = _context.current_agent()
    if "send_one_way" in vars(agent):
        delattr(agent, "send_one_way")


def identity(value: Any) -> Any:
    """``value`` itself."""
    return value


def rref_backward_error(rref: rpcx.RRef[Any], context_id: int) -> tuple[str, str]:
    """``(type name, message)`` of what ``rref.backward(context_id)`` raises here."""
    try:
        rref.backward(context_id)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "", ""


# ------------------------------------------------------------------------- autograd


def owner_gradient(context_id: int, rref: rpcx.RRef[torch.Tensor]) -> torch.Tensor | None:
    """The context's gradient here for the tensor ``rref`` (owned here) holds."""
    return dist_autograd.get_gradients(context_id).get(rref.local_value())



class RemoteNet(torch.nn.Module):
    """torch's ``RemoteNet`` of the DDP tests: a linear layer and a ReLU, seeded."""

    def __init__(self, d_in: int, d_out: int, seed: int) -> None:
        super().__init__()
        self.fc = training._init_(torch.nn.Linear(d_in, d_out), seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``relu(fc(x))``."""
        out: torch.Tensor = torch.relu(self.fc(x))
        return out


class _Hybrid(torch.nn.Module):
    """torch's ``HybridModel`` for DDP "outside": a local layer before and after a
    remote one, so the backward pass crosses workers between the two local layers."""

    def __init__(self, net: rpcx.RRef[torch.nn.Module] | torch.nn.Module) -> None:
        super().__init__()
        self.net = net
        self.fc1 = torch.nn.Linear(2, 2, bias=False)
        self.fc2 = torch.nn.Linear(3, 1, bias=False)
        training._init_(self.fc1, 11)
        training._init_(self.fc2, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``fc2(net(fc1(x)))``, the middle one on its worker."""
        hidden = self.fc1(x)
        if isinstance(self.net, rpcx.RRef):
            hidden = self.net.rpc_sync().forward(hidden)
        else:
            hidden = self.net(hidden)
        out: torch.Tensor = self.fc2(hidden)
        return out


def ddp_outside_trainer(
    net: rpcx.RRef[torch.nn.Module], group_rank: int, store_path: str, weight: float
) -> dict[str, Any]:
    """One of two trainers that wrap a model spanning an RPC call in DDP.

    Returns the gradients the context received for the DDP parameters, this trainer's
    own local gradients (plain autograd through a local copy of the remote layer), and
    whether the parameters' ``.grad`` was left alone.
    """
    from torch.nn.parallel import DistributedDataParallel

    group = training.private_gloo_group(store_path, group_rank, 2)
    model = _Hybrid(net)
    ddp = DistributedDataParallel(model, process_group=group)
    inputs = torch.tensor([[1.0, -2.0], [0.5, 3.0], [-1.5, 0.25]])
    values = torch.tensor([[1.0], [-2.0], [0.5]]) * weight
    with dist_autograd.context() as context_id:
        loss = (ddp(inputs) * values).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
        dist_grads = [grads[p].clone() for p in (model.fc1.weight, model.fc2.weight)]
    untouched = all(p.grad is None for p in model.parameters())
    # The reference: the same model with a local copy of the remote layer.
    local_net = RemoteNet(2, 3, 0)
    local_net.load_state_dict(
        {k: v.clone() for k, v in rpcx.rpc_sync(net.owner(), _state_of, args=(net,)).items()}
    )
    replica = _Hybrid(local_net)  # same seeds: the same local layers
    torch.autograd.backward([(replica(inputs) * values).sum()])
    local = [p.grad.clone() for p in (replica.fc1.weight, replica.fc2.weight)
             if p.grad is not None]
    del ddp, group
    return {"dist": dist_grads, "local": local, "untouched": untouched}


def _state_of(module: rpcx.RRef[torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.local_value().state_dict().items()}
