"""Conformance: distributed autograd, DistributedOptimizer, RemoteModule, DDP + RPC.

Part of :mod:`rpcx.testing.conformance` (which re-exports these classes).
"""

from __future__ import annotations

import contextvars
import functools
import pickle
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch

import rpcx
import rpcx.autograd as dist_autograd
from rpcx._core import context as _context
from rpcx.autograd import service as autograd_service_module
from rpcx.autograd.service import AutogradService
from rpcx.autograd.service import service as autograd_service
from rpcx.nn import RemoteModule
from rpcx.optim import DistributedOptimizer
from rpcx.testing import remote, training
from rpcx.testing.world import World

__all__ = ["TestDDPHybrid", "TestDistAutograd", "TestDistributedOptimizer", "TestRemoteModule"]

W0, W1, W2, W3 = "worker0", "worker1", "worker2", "worker3"
TOL = 1e-6


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    assert a is not None and b is not None, "a gradient is missing"
    return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=TOL)


def _no_contexts(world: World) -> list[dict[str, int]]:
    # Releases travel in the background; each worker first waits for its own to land.
    for _ in range(2):
        stats = [rpcx.rpc_sync(name, training.autograd_stats, timeout=60) for name in world.names]
    return stats


def _in_threads(fns: list[Any]) -> list[Any]:
    """Run each callable on its own thread as this worker; return results (or raise)."""
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int, fn: Any, ctx: contextvars.Context) -> None:
        try:
            results[i] = ctx.run(fn)
        except BaseException as exc:  # re-raised on the test thread
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(i, fn, contextvars.copy_context()), daemon=True)
        for i, fn in enumerate(fns)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a training thread did not finish within 120 s"
    if errors:
        raise errors[0]
    return results


class TestDistAutograd:
    """``rpcx.autograd``: contexts, the distributed backward pass, gradients."""

    def test_gradient_through_one_call(self, rpc_world: World) -> None:
        w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            y = rpcx.rpc_sync(W1, training.scale, args=(w, 3.0))
            assert y.requires_grad
            dist_autograd.backward(context_id, [(y * y).sum()])
            grads = dist_autograd.get_gradients(context_id)
        assert list(grads) == [w]
        assert _close(grads[w], 18 * w.detach())
        assert w.grad is None  # gradients go to the context, not .grad

    def test_builtin_and_async_calls(self, rpc_world: World) -> None:
        w = torch.tensor([2.0, -1.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            a = rpcx.rpc_sync(W1, torch.mul, args=(w, w))
            b = rpcx.rpc_async(W2, training.scale, args=(w, 5.0)).wait()
            dist_autograd.backward(context_id, [(a + b).sum()])
            grad = dist_autograd.get_gradients(context_id)[w]
        assert _close(grad, 2 * w.detach() + 5)

    def test_multi_hop_chain_back_to_the_start(self, rpc_world: World) -> None:
        # worker0 -> worker1 -> worker2 -> worker0 -> worker3; x**(2**5) in the end.
        x = torch.tensor([1.1, 0.9], dtype=torch.float64, requires_grad=True)
        with dist_autograd.context() as context_id:
            y = rpcx.rpc_sync(W1, training.square_then_call, args=(x, [W2, W0, W3]))
            dist_autograd.backward(context_id, [y.sum()])
            grad = dist_autograd.get_gradients(context_id)[x]
        expected = 16 * x.detach() ** 15
        assert torch.allclose(grad, expected, rtol=1e-12)

    def test_error_in_the_middle_of_a_chain_reaches_the_driver(self, rpc_world: World) -> None:
        # worker0 -> worker1 (whose backward raises) -> worker2: the chain runs
        # worker0, worker1, worker2, then worker1 again, where it fails; the driver
        # raises that error, naming worker1, and the world is fine afterwards.
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            y = rpcx.rpc_sync(W1, training.fail_in_backward_then_call, args=(x, [W2]))
            with pytest.raises(ValueError, match="refuses on purpose") as raised:
                dist_autograd.backward(context_id, [y.sum()])
        assert f"raised on worker '{W1}'" in "\n".join(getattr(raised.value, "__notes__", []))
        with dist_autograd.context() as context_id:
            y = rpcx.rpc_sync(W1, training.square_then_call, args=(x, [W2]))
            dist_autograd.backward(context_id, [y.sum()])
            assert _close(dist_autograd.get_gradients(context_id)[x], 4 * x.detach() ** 3)

    def test_gradients_the_next_worker_cannot_read_fail_the_backward_now(
            self, rpc_world: World, monkeypatch: pytest.MonkeyPatch) -> None:
        # The gradient this worker owes worker1 travels as an object that bookkeeping
        # messages may not carry: worker1 ends the chain with that error, and backward
        # raises it at once, naming worker1 and the cause. (On GPUs every gradient once
        # failed that way, and backward waited out rpc_timeout.)
        collect = AutogradService.collect

        def collect_placed(self: AutogradService, peer: int, context_id: int, tag: int,
                           index: int, grad: torch.Tensor,
                           source: torch.device | None = None) -> None:
            collect(self, peer, context_id, tag, index, grad, torch.device("cpu"))

        monkeypatch.setattr(AutogradService, "collect", collect_placed)
        monkeypatch.setattr(autograd_service_module, "Placed", training.UnreadableGradient)
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            y = rpcx.rpc_sync(W1, training.scale, args=(x, 3.0))
            with pytest.raises(rpcx.SerializationError,
                               match=f"worker '{W1}' could not unpickle") as raised:
                dist_autograd.backward(context_id, [y.sum()])
        assert "plain data and tensors only" in str(raised.value)
        monkeypatch.undo()
        with dist_autograd.context() as context_id:  # and the world is fine afterwards
            y = rpcx.rpc_sync(W1, training.scale, args=(x, 3.0))
            dist_autograd.backward(context_id, [y.sum()])
            assert _close(dist_autograd.get_gradients(context_id)[x], torch.full((2,), 3.0))

    def test_driver_hands_the_chain_on_before_its_own_pass_ends(self, rpc_world: World) -> None:
        # The driver's pass ends with a wait (queued by a node, as DDP queues its wait
        # for the all-reduce) that only worker1's pass can end. So the chain must leave
        # as soon as what the pass owes is known, not when the pass ends, or the wait
        # runs out and backward fails.
        key = uuid.uuid4().hex
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        w = torch.tensor([3.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            held = training.act_in_backward(
                w * 2.0, functools.partial(training.wait_at_end_of_pass, key, 60.0))
            y = rpcx.rpc_sync(W1, training.set_event_in_backward, args=(x, W0, key))
            dist_autograd.backward(context_id, [y.sum() + held.sum()])
            grads = dist_autograd.get_gradients(context_id)
        assert _close(grads[x], torch.ones(2)) and _close(grads[w], torch.full((1,), 2.0))

    def test_same_worker_reached_several_times(self, rpc_world: World) -> None:
        # worker1 sends x to worker2 twice and uses it itself: 2x * 3x + x.
        x = torch.tensor([0.5, 1.5], dtype=torch.float64, requires_grad=True)
        with dist_autograd.context() as context_id:
            y = rpcx.rpc_sync(W1, training.use_twice_remotely, args=(x, W2))
            z = rpcx.rpc_sync(W2, training.scale, args=(x, 4.0))  # and worker2 directly
            dist_autograd.backward(context_id, [(y + z).sum()])
            grad = dist_autograd.get_gradients(context_id)[x]
        assert torch.allclose(grad, 12 * x.detach() + 1 + 4, rtol=1e-12)

    def test_gradients_meeting_on_a_worker_run_once_summed(self, rpc_world: World) -> None:
        # worker1 clips gradients in backward (not linear) and sends its output to two
        # peers: like torch's engine, it must clip the sum of both gradients, once.
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        (expected,) = torch.autograd.grad(
            (training.ClipGrad.apply(x * 1.0) * 0.8 * 2).sum(), [x]  # type: ignore[no-untyped-call]
        )
        with dist_autograd.context() as context_id:
            y = rpcx.rpc_sync(W1, training.clip_then_fan_out, args=(x, [W2, W3]))
            dist_autograd.backward(context_id, [y.sum()])
            assert _close(dist_autograd.get_gradients(context_id)[x], expected)

    def test_gradients_waiting_on_one_sent_tensor_are_summed(self, rpc_world: World) -> None:
        # Gradients for a tensor this worker sent wait for its next pass; two that
        # arrive for the same tensor before that pass (paths of different lengths
        # through other workers can do that) must add up, not replace each other.
        # Delivered here by worker1 over the wire, as its passes would deliver them.
        x = torch.tensor([1.0, 2.0], requires_grad=True)
        svc = autograd_service(_context.current_agent())
        with dist_autograd.context() as context_id:
            rpcx.rpc_sync(W1, training.scale, args=(x, 3.0))
            (tag,) = svc.get(context_id).sends
            backward = (1, 1)  # as if worker1 drove a backward pass
            for grad in (torch.tensor([1.0, 10.0]), torch.tensor([100.0, 1000.0])):
                rpcx.rpc_sync(W1, remote.send_gradient,
                              args=(context_id, W0, backward, tag, 0, grad))
            reply = svc.rounds.handle_run(rpcx.get_worker_info(W1),
                                          (context_id, backward, None, False))
            assert reply == [[], [[0, False]]]  # no next round; nothing waits here
            grads = dist_autograd.get_gradients(context_id)
        assert _close(grads[x], torch.tensor([101.0, 1010.0]))

    def test_ladder_costs_passes_linear_in_depth(self, rpc_world: World) -> None:
        # y <- f(y) on worker1 + f(y) on worker2, eight times: 2**8 paths to the leaf.
        depth = 8
        x = torch.ones(1, requires_grad=True)
        before = sum(s["passes"] for s in _no_contexts(rpc_world))
        with dist_autograd.context() as context_id:
            y = x
            for _ in range(depth):
                y = (rpcx.rpc_sync(W1, training.scale, args=(y, 1.0))
                     + rpcx.rpc_sync(W2, training.scale, args=(y, 1.0)))
            dist_autograd.backward(context_id, [y.sum()])
            assert _close(dist_autograd.get_gradients(context_id)[x], torch.tensor([2.0**depth]))
        passes = sum(s["passes"] for s in _no_contexts(rpc_world)) - before
        assert passes <= 4 * depth, f"{passes} local passes for a ladder of depth {depth}"

    def test_late_nested_call_does_not_revive_a_released_context(self, rpc_world: World) -> None:
        # The call is still running on worker1 when the block ends; its nested call to
        # worker2 happens after worker1 heard of the release, and must not recreate the
        # context on worker2, where no release would ever come.
        key = uuid.uuid4().hex
        w = torch.ones(2, requires_grad=True)
        with dist_autograd.context():
            future = rpcx.rpc_async(W1, training.wait_then_forward, args=(key, w, W2))
        dist_autograd._wait_released()  # worker1 has released it
        rpcx.rpc_sync(W1, remote.release, args=(key,))
        assert _close(future.wait(), 2 * w.detach())
        stats = _no_contexts(rpc_world)
        assert all(s["contexts"] == 0 for s in stats), stats

    def test_calls_from_callbacks_stay_in_the_context(self, rpc_world: World) -> None:
        w = torch.tensor([1.0, 2.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            y = rpcx.rpc_sync(W1, training.scale_twice_in_callbacks, args=(w, W2))
            dist_autograd.backward(context_id, [y.sum()])
            assert _close(dist_autograd.get_gradients(context_id)[w], torch.full((2,), 6.0))

    @pytest.mark.parametrize("api", ["rpc_async", "remote"])
    def test_proxy_call_waiting_for_its_value_runs_in_the_context(
            self, rpc_world: World, api: str) -> None:
        # fairscale's pipeline calls methods of handlers whose remote() may still be
        # making them: the method runs once the value exists, on the thread that made
        # it, and what it sends must be recorded in the caller's context all the same.
        key = uuid.uuid4().hex
        made = rpcx.remote(W1, remote.MadeOnRelease, args=(key,))
        w = torch.tensor([1.0, 2.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            if api == "rpc_async":
                pending = made.rpc_async().times_on(W2, w, 3.0)
            else:
                pending = made.remote().times_on(W2, w, 3.0)
            rpcx.rpc_sync(W1, remote.release, args=(key,))
            y = pending.wait() if api == "rpc_async" else pending.to_here()
            dist_autograd.backward(context_id, [y.sum()])
            assert _close(dist_autograd.get_gradients(context_id)[w], torch.full((2,), 3.0))

    def test_retain_graph_twice(self, rpc_world: World) -> None:
        w = torch.tensor([1.0, 2.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            loss = rpcx.rpc_sync(W1, training.scale, args=(w, 2.0)).sum()
            dist_autograd.backward(context_id, [loss], retain_graph=True)
            dist_autograd.backward(context_id, [loss], retain_graph=True)
            assert _close(dist_autograd.get_gradients(context_id)[w], torch.full((2,), 4.0))
            dist_autograd.backward(context_id, [loss])
            assert _close(dist_autograd.get_gradients(context_id)[w], torch.full((2,), 6.0))
            with pytest.raises(RuntimeError, match="second time"):
                dist_autograd.backward(context_id, [loss])

    def test_local_only_backward(self, rpc_world: World) -> None:
        w = torch.tensor([3.0], requires_grad=True)
        w.grad = torch.tensor([100.0])
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [(w * w).sum()])
            assert _close(dist_autograd.get_gradients(context_id)[w], torch.tensor([6.0]))
        assert _close(w.grad, torch.tensor([100.0]))  # untouched

    def test_contexts_are_isolated(self, rpc_world: World) -> None:
        w = torch.tensor([1.0, 1.0], requires_grad=True)
        with dist_autograd.context() as first:
            y1 = rpcx.rpc_sync(W1, training.scale, args=(w, 2.0)).sum()
        with dist_autograd.context() as second:
            y2 = rpcx.rpc_sync(W1, training.scale, args=(w, 7.0)).sum()
            dist_autograd.backward(second, [y2])
            assert _close(dist_autograd.get_gradients(second)[w], torch.full((2,), 7.0))
        with pytest.raises(RuntimeError, match="Could not find autograd context"):
            dist_autograd.get_gradients(first)  # released when its block ended
        assert first != second
        del y1

    def test_remote_and_to_here_in_the_graph(self, rpc_world: World) -> None:
        w = torch.tensor([1.0, -2.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            rref = rpcx.remote(W2, training.scale, args=(w, 5.0))
            fetched = rref.to_here()
            dist_autograd.backward(context_id, [(fetched * 3).sum()])
            assert _close(dist_autograd.get_gradients(context_id)[w], torch.full((2,), 15.0))

    def test_rref_proxy_calls_record_both_sides(self, rpc_world: World) -> None:
        module = rpcx.remote(W3, training.Linear, args=(3, 2, 11))
        x = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
        local = training.Linear(3, 2, 11)
        expected_out = local(x)
        expected_out.sum().backward()
        assert x.grad is not None
        x_grad_expected = x.grad.clone()
        x.grad = None
        with dist_autograd.context() as context_id:
            out = module.rpc_sync().forward(x)
            assert _close(out, expected_out)
            dist_autograd.backward(context_id, [out.sum()])
            assert _close(dist_autograd.get_gradients(context_id)[x], x_grad_expected)
            remote_grads = rpcx.rpc_sync(W3, training.local_gradients, args=(context_id, module))
        for got, param in zip(remote_grads, local.parameters(), strict=True):
            assert got is not None and _close(got, param.grad)
        assert rpcx.rpc_sync(W3, training.grads_are_untouched, args=(module,))

    def test_concurrent_trainers_against_one_owner(self, rpc_world: World) -> None:
        module = rpcx.remote(W3, training.Linear, args=(4, 3, 5))
        inputs = {w: torch.full((2, 4), float(i + 1)) for i, w in enumerate((W0, W1, W2))}
        reference = training.Linear(4, 3, 5)

        def expected(x: torch.Tensor) -> list[torch.Tensor]:
            reference.zero_grad()
            out = reference(x)
            (out * out).sum().backward()
            return [p.grad.clone() for p in reference.parameters() if p.grad is not None]

        # lr=0: every step sees the same weights, so each context's gradient is known.
        futures = [
            rpcx.rpc_async(w, training.train_against, args=(module, inputs[w], 10, 0.0))
            for w in (W1, W2)
        ]
        histories = {W0: training.train_against(module, inputs[W0], 10, 0.0)}
        histories.update((w, f.wait()) for w, f in zip((W1, W2), futures, strict=True))
        for worker, history in histories.items():
            want = expected(inputs[worker])
            for step in history:
                assert all(_close(g, e) for g, e in zip(step, want, strict=True)), worker

    def test_contexts_released_on_every_worker(self, rpc_world: World) -> None:
        # A thousand iterations over three hops: nothing may pile up anywhere.
        w = torch.tensor([1.0], requires_grad=True)
        for i in range(1000):
            with dist_autograd.context() as context_id:
                y = rpcx.rpc_sync(W1, training.square_then_call, args=(w, [W2, W3]))
                if i % 2 == 0:
                    dist_autograd.backward(context_id, [y.sum()])
        # Released after an error too.
        with pytest.raises(ZeroDivisionError), dist_autograd.context():
            rpcx.rpc_sync(W1, training.square_then_call, args=(w, [W2]))
            raise ZeroDivisionError
        stats = _no_contexts(rpc_world)
        assert all(s["contexts"] == 0 and s["releasing"] == 0 for s in stats), stats

    def test_clear_errors(self, rpc_world: World) -> None:
        with pytest.raises(RuntimeError, match="Could not find autograd context with id: 12345"):
            dist_autograd.backward(12345, [torch.ones((), requires_grad=True)])
        w = torch.tensor([1.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            y = rpcx.rpc_sync(W1, training.scale, args=(w, 2.0))
            with pytest.raises(RuntimeError, match=r"rpcx\.autograd\.backward"):
                y.sum().backward()  # the local engine cannot cross workers
            with pytest.raises(RuntimeError, match="scalars"):
                dist_autograd.backward(context_id, [y.expand(3)])
            with pytest.raises(RuntimeError, match="do not nest"), dist_autograd.context():
                pass
            assert dist_autograd.current_context_id() == context_id

    def test_rref_backward(self, rpc_world: World) -> None:
        w = torch.tensor([2.0, 3.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            rref = rpcx.remote(W1, training.scale, args=(w, 4.0))
            total = rpcx.remote(W1, torch.sum, args=(rref.to_here(),))
            total.backward(context_id)  # starts on the owner, crosses back to here
            assert _close(dist_autograd.get_gradients(context_id)[w], torch.full((2,), 4.0))
        local = rpcx.RRef((w * w).sum())
        local.backward()  # no context: a local backward on the owner, into .grad
        assert _close(w.grad, 2 * w.detach())
        with pytest.raises(RuntimeError, match="owner"):
            total.backward()  # local mode needs the owner


class TestDistributedOptimizer:
    """DistributedOptimizer against the same model trained in one process."""

    def test_split_model_matches_local_training(self, rpc_world: World) -> None:
        # embedding on worker1, LSTM on worker2, MLP decoder on worker3, driven from here
        emb = rpcx.remote(W1, training.Embedding, args=(20, 6, 1))
        lstm = rpcx.remote(W2, training.LSTMBlock, args=(6, 5, 2))
        dec = rpcx.remote(W3, training.MLP, args=(5, 7, 20, 3))
        params = []
        for module in (emb, lstm, dec):
            params += training._param_rrefs(module)
        opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9)

        local = [
            training.Embedding(20, 6, 1), training.LSTMBlock(6, 5, 2), training.MLP(5, 7, 20, 3)
        ]
        local_params = [p for m in local for p in m.parameters()]
        local_opt = torch.optim.SGD(local_params, lr=0.1, momentum=0.9)
        criterion = torch.nn.CrossEntropyLoss()
        generator = torch.Generator().manual_seed(0)
        for _ in range(4):
            tokens = torch.randint(0, 20, (3, 5), generator=generator)
            target = torch.randint(0, 20, (15,), generator=generator)

            local_opt.zero_grad()
            out = local[2](local[1](local[0](tokens)))
            criterion(out.reshape(15, 20), target).backward()
            local_opt.step()

            with dist_autograd.context() as context_id:
                hidden = lstm.rpc_sync().forward(emb.rpc_sync().forward(tokens))
                out = dec.rpc_sync().forward(hidden)
                dist_autograd.backward(context_id, [criterion(out.reshape(15, 20), target)])
                got = []
                for module in (emb, lstm, dec):
                    got += rpcx.rpc_sync(module.owner(), training.local_gradients,
                                         args=(context_id, module))
                want = [p.grad for p in local_params]
                assert all(_close(g, w) for g, w in zip(got, want, strict=True))
                opt.step(context_id)
        remote_params = []
        for module in (emb, lstm, dec):
            remote_params += rpcx.rpc_sync(module.owner(), training.parameters_of, args=(module,))
        assert all(_close(r, p.detach()) for r, p in zip(remote_params, local_params, strict=True))

    def test_concurrent_steps_on_one_owner(self, rpc_world: World) -> None:
        module = rpcx.remote(W3, training.Linear, args=(2, 2, 9))
        before = rpcx.rpc_sync(W3, training.parameters_of, args=(module,))
        steps = 8
        futures = [
            rpcx.rpc_async(w, training.train_against, args=(module, torch.ones(1, 2), steps, 0.01))
            for w in (W1, W2)
        ]
        for future in futures:
            assert len(future.wait()) == steps
        after = rpcx.rpc_sync(W3, training.parameters_of, args=(module,))
        assert not any(torch.equal(a, b) for a, b in zip(after, before, strict=True))

    @pytest.mark.parametrize("shared", [False, True], ids=["own-optimizers", "one-optimizer"])
    def test_concurrent_steps_do_not_mix_gradients(self, rpc_world: World, shared: bool) -> None:
        # Two trainers step the same owner's parameters at the same moment, each with
        # its own context's gradients. A step lends those to .grad; unserialized, one
        # step would run with the other's gradients (and leave them in .grad). The
        # probe optimizer holds the first step open until the second begins (bounded),
        # so a missing lock shows every time, not by chance.
        module = rpcx.remote(W3, training.Linear, args=(2, 2, 9))
        params = training._param_rrefs(module)
        before = rpcx.rpc_sync(W3, training.parameters_of, args=(module,))
        probe = uuid.uuid4().hex

        def make() -> DistributedOptimizer:
            return DistributedOptimizer(remote.OverlapProbeSGD, params, lr=1.0, probe=probe)

        one = make() if shared else None
        inputs = [torch.full((1, 2), 1.0), torch.full((1, 2), 3.0)]
        both_ready = threading.Barrier(2)

        def trainer(x: torch.Tensor) -> None:
            opt = one or make()
            with dist_autograd.context() as context_id:
                dist_autograd.backward(context_id, [module.rpc_sync().forward(x).sum()])
                both_ready.wait(60)
                opt.step(context_id)

        _in_threads([lambda x=x: trainer(x) for x in inputs])
        entered, overlapped = rpcx.rpc_sync(W3, remote.probe_overlaps, args=(probe,))
        assert (entered, overlapped) == (2, 0), "optimizer steps on one owner overlapped"
        reference = training.Linear(2, 2, 9)
        for x in inputs:
            reference(x).sum().backward()  # .grad: the sum of both trainers' gradients
        after = rpcx.rpc_sync(W3, training.parameters_of, args=(module,))
        for got, start, param in zip(after, before, reference.parameters(), strict=True):
            assert _close(got, start - param.grad)
        assert rpcx.rpc_sync(W3, training.grads_are_untouched, args=(module,))

    def test_errors_name_the_owner(self, rpc_world: World) -> None:
        module = rpcx.remote(W2, training.Linear, args=(2, 2, 9))
        opt = DistributedOptimizer(torch.optim.SGD, training._param_rrefs(module), lr=0.1)
        with pytest.raises(RuntimeError, match="Could not find autograd context") as info:
            opt.step(999)
        assert "worker2" in str(info.value) + "".join(getattr(info.value, "__notes__", []))
        with pytest.raises(TypeError):
            DistributedOptimizer(torch.optim.SGD, training._param_rrefs(module), no_such_arg=1)


class TestRemoteModule:
    """``rpcx.nn.RemoteModule``."""

    def test_forward_and_forward_async(self, rpc_world: World) -> None:
        remote_linear = RemoteModule(f"{W1}/cpu", training.Linear, args=(3, 2, 4))
        local = training.Linear(3, 2, 4)
        x = torch.randn(5, 3)
        assert _close(remote_linear(x), local(x))
        assert _close(remote_linear.forward_async(x).wait(), local(x))
        assert remote_linear.get_module_rref().owner_name() == W1

    def test_rank_addressing_and_kwargs(self, rpc_world: World) -> None:
        remote_linear = RemoteModule("rank:2/cpu", training.Linear,
                                     kwargs={"dim_in": 2, "dim_out": 2, "seed": 1})
        assert remote_linear.get_module_rref().owner_name() == W2
        with pytest.raises(ValueError, match="remote_device"):
            RemoteModule("", training.Linear, args=(2, 2, 1))
        with pytest.raises(rpcx.UnknownWorkerError):
            RemoteModule("nobody/cpu", training.Linear, args=(2, 2, 1))

    def test_train_eval_and_parameters(self, rpc_world: World) -> None:
        remote_mlp = RemoteModule(f"{W2}/cpu", training.MLP, args=(2, 3, 1, 0))
        assert remote_mlp.is_training()
        remote_mlp.eval()
        assert not remote_mlp.is_training() and not remote_mlp.training
        remote_mlp.train()
        assert remote_mlp.is_training()
        params = remote_mlp.remote_parameters()
        assert len(params) == 4 and all(p.owner_name() == W2 for p in params)
        with pytest.raises(ValueError, match="remote_parameters"):
            remote_mlp.parameters()

    def test_init_from_module_rref_and_sending(self, rpc_world: World) -> None:
        rref = rpcx.remote(W3, training.Linear, args=(2, 2, 8))
        wrapped = RemoteModule.init_from_module_rref(f"{W3}/cpu", rref)
        x = torch.ones(1, 2)
        here = wrapped(x)
        there = rpcx.rpc_sync(W1, training.call_module, args=(wrapped, x))
        assert _close(here, there)
        with pytest.raises(RuntimeError, match="only be pickled by rpcx"):
            pickle.dumps(wrapped)

    def test_methods_that_would_act_on_the_local_stub_raise(self, rpc_world: World) -> None:
        """torch's test_unsupported_methods: same type and wording as torch."""
        module = RemoteModule(f"{W1}/cpu", training.Linear, args=(2, 2, 1))
        calls: dict[str, Callable[[], object]] = {
            "register_buffer": lambda: module.register_buffer("b", torch.ones(1)),
            "register_parameter": lambda: module.register_parameter(
                "p", torch.nn.Parameter(torch.ones(1))),
            "add_module": lambda: module.add_module("m", None),
            "state_dict": module.state_dict,
            "to": lambda: module.to("cpu"),
            "named_parameters": module.named_parameters,
            "zero_grad": module.zero_grad,
            "register_forward_hook": lambda: module.register_forward_hook(lambda *a: None),
        }
        for method, call in calls.items():
            with pytest.raises(ValueError, match=rf"Method ``{method}`` not supported"):
                call()
        assert not module._buffers and not module._parameters  # nothing landed locally
        assert _close(module(torch.ones(1, 2)), training.Linear(2, 2, 1)(torch.ones(1, 2)))

    def test_error_paths(self, rpc_world: World) -> None:
        for bad, message in [
            ("/cpu", "names no worker"),
            (f"{W1}/no_such_device", "bad device 'no_such_device'"),
            (42, "must be a string"),
        ]:
            with pytest.raises(ValueError, match=message):
                RemoteModule(bad, training.Linear, args=(2, 2, 1))  # type: ignore[arg-type]
        with pytest.raises(rpcx.UnknownWorkerError, match="worker3"):
            RemoteModule("rank:99/cpu", training.Linear, args=(2, 2, 1))
        # Built on the owner: its errors keep their type and say what went wrong.
        with pytest.raises(TypeError, match=r"built a int, not an nn\.Module"):
            RemoteModule(f"{W1}/cpu", remote.not_a_module)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            RemoteModule(f"{W1}/cpu", training.Linear, args=(2,))  # missing arguments
        rref = rpcx.remote(W3, training.Linear, args=(2, 2, 8))
        # Not an error (as in torch): the module runs on its RRef's owner, whatever
        # worker remote_device names.
        assert RemoteModule.init_from_module_rref(f"{W1}/cpu", rref).on.name == W3
        module = RemoteModule(f"{W2}/cpu", training.Linear, args=(2, 2, 1))
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            module(torch.ones(1, 5))  # the forward fails on the owner
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            module.forward_async(torch.ones(1, 5)).wait()
        assert _close(module(torch.ones(1, 2)), training.Linear(2, 2, 1)(torch.ones(1, 2)))

    def test_training_lowers_the_loss(self, rpc_world: World) -> None:
        remote_mlp = RemoteModule(f"{W1}/cpu", training.MLP, args=(4, 8, 1, 3))
        opt = DistributedOptimizer(torch.optim.Adam, remote_mlp.remote_parameters(), lr=0.05)
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(32, 4, generator=generator)
        y = x.sum(dim=1, keepdim=True)
        losses = []
        for _ in range(40):
            with dist_autograd.context() as context_id:
                loss = ((remote_mlp(x) - y) ** 2).mean()
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
                losses.append(float(loss.detach()))
        assert losses[-1] < 0.2 * losses[0], losses


class TestDDPHybrid:
    """The seeds' DDP + RPC program: DDP trainers, embedding on a parameter server."""

    def test_ddp_weights_identical_on_both_trainers(self, rpc_world: World) -> None:
        emb = rpcx.remote(W3, training.embedding_bag, args=(100, 16, 0))
        before = rpcx.rpc_sync(W3, training.parameters_of, args=(emb,))
        path = training.new_store_path()
        steps = 6
        futures = [
            rpcx.rpc_async(w, training.ddp_trainer, args=(emb, rank, path, steps), timeout=120)
            for rank, w in enumerate((W1, W2))
        ]
        first, second = (f.wait() for f in futures)
        assert torch.equal(first["weight"], second["weight"])
        assert torch.equal(first["bias"], second["bias"])
        for a, b in zip(first["dense_grads"], second["dense_grads"], strict=True):
            assert torch.equal(a, b)  # DDP's all-reduce reached the context's gradients
            assert a.abs().sum() > 0
        assert first["grad_untouched"] and second["grad_untouched"]
        after = rpcx.rpc_sync(W3, training.parameters_of, args=(emb,))
        assert not torch.equal(before[0], after[0])  # the remote embedding trained too
