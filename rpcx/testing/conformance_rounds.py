"""Conformance: every backward node runs once, with all of its gradients, however many
calls the paths to it cross (torch's FAST mode semantics).

Part of :mod:`rpcx.testing.conformance` (which re-exports the class). The functions
below run on the workers (they are called by reference).
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.utils.checkpoint

import rpcx
import rpcx.autograd as dist_autograd
from rpcx.testing.world import World

__all__ = ["TestBackwardOnce"]

W0, W1, W2 = "worker0", "worker1", "worker2"

# What the backward functions below saw on this worker, by test key.
CALLS: dict[str, list[float]] = collections.defaultdict(list)
# Tensors a call left on its worker for a later call (by test key).
KEPT: dict[str, torch.Tensor] = {}


class Once(torch.autograd.Function):
    """Identity; backward records the sum of its gradient under the key and pops a value
    its forward pushed once (as fairscale's checkpoint does): a second run raises
    (unless ``again``, for a graph that runs twice on purpose)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, key: str, again: bool = False) -> torch.Tensor:
        ctx.key = key
        ctx.stash = collections.deque([object()] * (2 if again else 1))
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        CALLS[ctx.key].append(float(grad.sum()))
        ctx.stash.pop()
        return grad, None, None


def calls(key: str) -> list[float]:
    """What ``Once`` (and the hooks) recorded here under ``key``."""
    return list(CALLS.pop(key, []))


def ident(t: torch.Tensor) -> torch.Tensor:
    return t


def relay(t: torch.Tensor, to: str, factor: float) -> torch.Tensor:
    """``t * factor`` on ``to``, from here: the path crosses two more messages."""
    out: torch.Tensor = rpcx.rpc_sync(to, torch.mul, args=(t, factor))
    return out


def direct_and_nested(x: torch.Tensor, key: str, via: list[str], again: bool = False
                      ) -> tuple[torch.Tensor, ...]:
    """``y = Once(x)`` here; ``y`` goes back directly and through the workers ``via``
    (each multiplies by 2)."""
    y: torch.Tensor = Once.apply(x, key, again)  # type: ignore[no-untyped-call]
    z = y
    for hop in via:
        z = rpcx.rpc_sync(hop, torch.mul, args=(z, 2.0))
    return y, z


def inner_frontier(x: torch.Tensor, key: str, helper: str) -> torch.Tensor:
    """``m = Once(x)``; ``a = m * 2`` returns directly, ``b = m * 3`` through ``helper``:
    ``m``'s node waits while ``a``'s node runs (a frontier inside the pass)."""
    m: torch.Tensor = Once.apply(x, key)  # type: ignore[no-untyped-call]
    b: torch.Tensor = rpcx.rpc_sync(helper, relay, args=(m * 3, W0, 1.0))
    return m * 2 + b


def frontier_below_frontier(x: torch.Tensor, key: str, helper: str) -> torch.Tensor:
    """``h = Once(x)``, ``g = exp(h)``; ``h + g`` returns directly and ``g`` also through
    ``helper``: both ``g``'s and ``h``'s nodes wait, and ``g``'s lies above ``h``'s."""
    h: torch.Tensor = Once.apply(x, key)  # type: ignore[no-untyped-call]
    g = h.exp()
    z: torch.Tensor = rpcx.rpc_sync(helper, relay, args=(g, W0, 1.0))
    return h + g + z


def hooked(x: torch.Tensor, key: str, via: str) -> torch.Tensor:
    """A parameter, reached directly and through ``via``, and an intermediate tensor on
    the direct path, each hooked."""
    weight = KEPT.setdefault(f"{key}/weight", torch.tensor([0.5, -1.0], requires_grad=True))
    if f"{key}/hooked" not in KEPT:
        KEPT[f"{key}/hooked"] = weight
        weight.register_hook(  # type: ignore[no-untyped-call]
            lambda g: CALLS[f"{key}/weight"].append(float(g.sum())))
        accumulate: Any = torch.autograd.graph.get_gradient_edge(weight).node
        accumulate.register_hook(lambda gi, go: CALLS[f"{key}/accumulate"].append(1.0))
    h = x * weight
    u = h * 1.0
    u.register_hook(  # type: ignore[no-untyped-call]
        lambda g: CALLS[f"{key}/u"].append(float(g.sum())))
    z: torch.Tensor = rpcx.rpc_sync(via, relay, args=(h, W1, 3.0))
    return u + z


def weight_gradient(key: str, context_id: int) -> torch.Tensor:
    return dist_autograd.get_gradients(context_id)[KEPT[f"{key}/weight"]]


def keep_once(x: torch.Tensor, key: str) -> torch.Tensor:
    """``h = Once(x)`` kept here; ``h * 2`` returned."""
    h: torch.Tensor = Once.apply(x, key)  # type: ignore[no-untyped-call]
    KEPT[key] = h
    return h * 2


def kept_times_three(key: str) -> torch.Tensor:
    """``3 * h`` of :func:`keep_once`, in a message of its own."""
    return KEPT.pop(key) * 3


class NestedBackward(torch.autograd.Function):
    """Identity; backward runs a local backward of its own through ``weight`` (as a
    reentrant checkpoint recomputes and runs backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight = weight
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        with torch.enable_grad():
            torch.autograd.backward((ctx.weight * 5.0).sum())
        return grad, None


def nested_backward(x: torch.Tensor, key: str) -> torch.Tensor:
    """``x * w`` through a node whose backward runs its own backward through ``w``."""
    weight = KEPT.setdefault(f"{key}/weight", torch.ones(2, requires_grad=True))
    out: torch.Tensor = NestedBackward.apply(x * weight, weight)  # type: ignore[no-untyped-call]
    return out


def weight_grad_attribute(key: str) -> torch.Tensor | None:
    grad = KEPT[f"{key}/weight"].grad
    return None if grad is None else grad.clone()


def reentrant_checkpoint(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.utils.checkpoint.checkpoint(
        torch.sin, x * 1, use_reentrant=True)
    return out


class TestBackwardOnce:
    """Every node of a context runs once per backward(), with the sum of its gradients."""

    def test_node_reached_directly_and_through_the_caller_runs_once(
            self, rpc_world: World) -> None:
        # The shape of fairscale's pipelines: worker1's output comes back to worker0
        # directly and by way of a nested call through worker0.
        key = "direct-and-nested"
        x = torch.ones(3, requires_grad=True)
        with dist_autograd.context() as context_id:
            y, z = rpcx.rpc_sync(W1, direct_and_nested, args=(x, key, [W0]))
            dist_autograd.backward(context_id, [(y + z).sum()])
            grad = dist_autograd.get_gradients(context_id)[x]
        assert torch.equal(grad, torch.full((3,), 3.0))  # d(y + 2y)/dx, as torch gives
        assert rpcx.rpc_sync(W1, calls, args=(key,)) == [9.0]  # once, the sum

    def test_three_workers_and_two_backward_passes(self, rpc_world: World) -> None:
        key = "three-workers"
        x = torch.ones(2, requires_grad=True)
        with dist_autograd.context() as context_id:
            y, z = rpcx.rpc_sync(W1, direct_and_nested, args=(x, key, [W2, W0], True))
            loss = (y + z).sum()
            dist_autograd.backward(context_id, [loss], retain_graph=True)
            assert rpcx.rpc_sync(W1, calls, args=(key,)) == [10.0]
            dist_autograd.backward(context_id, [loss])  # gradients add up
            grad = dist_autograd.get_gradients(context_id)[x]
            assert rpcx.rpc_sync(W1, calls, args=(key,)) == [10.0]
            with pytest.raises(RuntimeError, match="second time"):
                dist_autograd.backward(context_id, [loss])
        assert torch.equal(grad, torch.full((2,), 10.0))

    def test_a_node_waits_inside_a_pass(self, rpc_world: World) -> None:
        key = "inner-frontier"
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            out = rpcx.rpc_sync(W1, inner_frontier, args=(x, key, W2))
            dist_autograd.backward(context_id, [out.sum()])
            grad = dist_autograd.get_gradients(context_id)[x]
        assert torch.equal(grad, torch.full((2,), 5.0))
        assert rpcx.rpc_sync(W1, calls, args=(key,)) == [10.0]

    def test_a_waiting_node_below_another(self, rpc_world: World) -> None:
        key = "frontier-below"
        x = torch.tensor([0.5, -0.5], requires_grad=True)
        local = x.detach().clone().requires_grad_()
        (expected,) = torch.autograd.grad((local + 2 * local.exp()).sum(), [local])
        with dist_autograd.context() as context_id:
            out = rpcx.rpc_sync(W1, frontier_below_frontier, args=(x, key, W2))
            dist_autograd.backward(context_id, [out.sum()])
            grad = dist_autograd.get_gradients(context_id)[x]
        assert torch.allclose(grad, expected, rtol=1e-6)
        assert rpcx.rpc_sync(W1, calls, args=(key,)) == pytest.approx([float(expected.sum())])

    def test_hooks_run_once(self, rpc_world: World) -> None:
        # A tensor hook on a parameter and a post-hook on its AccumulateGrad (where DDP's
        # reducer hooks), reached directly and through two more messages, run once,
        # with the summed gradient; so does a hook on an intermediate tensor.
        key = "hooks"
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            out = rpcx.rpc_sync(W1, hooked, args=(x, key, W2))
            dist_autograd.backward(context_id, [out.sum()])
            weight_grad = rpcx.rpc_sync(W1, weight_gradient, args=(key, context_id))
        assert torch.equal(weight_grad, 4 * x.detach())  # (x*w + 3*x*w) by w
        assert rpcx.rpc_sync(W1, calls, args=(f"{key}/weight",)) == [12.0]
        assert rpcx.rpc_sync(W1, calls, args=(f"{key}/accumulate",)) == [1.0]
        assert rpcx.rpc_sync(W1, calls, args=(f"{key}/u",)) == [2.0]

    def test_an_output_nobody_uses_in_a_message_of_its_own(self, rpc_world: World) -> None:
        # worker1 sends h * 3 in a reply nobody uses: its gradient never comes (torch's
        # FAST mode waits for it forever). The backward still finishes, and h's node
        # runs once, with what reached it.
        key = "unused-message"
        x = torch.ones(2, requires_grad=True)
        with dist_autograd.context() as context_id:
            used = rpcx.rpc_sync(W1, keep_once, args=(x, key))
            rpcx.rpc_sync(W1, kept_times_three, args=(key,))  # never used
            dist_autograd.backward(context_id, [used.sum()])
            grad = dist_autograd.get_gradients(context_id)[x]
        assert torch.equal(grad, torch.full((2,), 2.0))
        assert rpcx.rpc_sync(W1, calls, args=(key,)) == [4.0]

    def test_a_nested_backward_keeps_its_gradients_in_grad(self, rpc_world: World) -> None:
        # Like torch's distributed engine: the outer pass's gradient goes to the
        # context, the one of a backward run inside a backward function (a reentrant
        # checkpoint's) stays in .grad.
        key = "nested"
        x = torch.tensor([1.0, 3.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            out = rpcx.rpc_sync(W1, nested_backward, args=(x, key))
            dist_autograd.backward(context_id, [out.sum()])
            weight_grad = rpcx.rpc_sync(W1, weight_gradient, args=(key, context_id))
        assert torch.equal(weight_grad, x.detach())
        in_grad = rpcx.rpc_sync(W1, weight_grad_attribute, args=(key,))
        assert in_grad is not None and torch.equal(in_grad, torch.full((2,), 5.0))

    def test_a_reentrant_checkpoint_refuses_as_on_torch(self, rpc_world: World) -> None:
        x = torch.ones(2, requires_grad=True)
        with dist_autograd.context() as context_id:
            out = rpcx.rpc_sync(W1, reentrant_checkpoint, args=(x,))
            with pytest.raises(RuntimeError, match="use_reentrant=True"):
                dist_autograd.backward(context_id, [out.sum()])
