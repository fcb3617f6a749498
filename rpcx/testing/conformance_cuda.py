"""Conformance: CUDA tensors along device maps, on every backend; skipped without a GPU.

Direct transports (tensorpipe) move device memory themselves; the others stage it
through host memory. The placement rules are the same: requests follow the caller's
map, responses the inverse of it, gradients go back where their tensors came from.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import rpcx
import rpcx.autograd as dist_autograd
from rpcx.nn import RemoteModule
from rpcx.optim import DistributedOptimizer
from rpcx.testing import remote
from rpcx.testing.fixtures import WorldKeeper
from rpcx.testing.world import World, world

__all__ = ["TestCudaDeviceMaps"]


def _remote_index() -> int:
    return 1 if torch.cuda.device_count() > 1 else 0  # a different GPU where there is one


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestCudaDeviceMaps:
    """Requests follow the caller's map, responses and gradients the inverse."""

    @pytest.fixture
    def cuda_world(self, rpcx_backend: str, rpc_world_keeper: WorldKeeper) -> Iterator[World]:
        # A world of its own: the module's shared world, if this process runs one, goes
        # first (a process is one worker at a time on multi-process backends).
        rpc_world_keeper.close()
        there = _remote_index()
        maps = {"worker0": {there: 0}, "worker1": {0: there}}
        with world(rpcx_backend, size=2, device_maps=maps) as started:
            yield started

    def test_tensor_follows_the_map_and_the_result_the_inverse(self, cuda_world: World) -> None:
        sent = torch.arange(6.0, device="cuda:0")
        seen, doubled = rpcx.rpc_sync("worker1", remote.device_and_double, args=(sent,))
        assert seen == f"cuda:{_remote_index()}"
        assert doubled.device == torch.device("cuda:0")
        assert torch.equal(doubled, sent * 2)

    def test_unmapped_device_fails_naming_the_map_to_set(
            self, rpcx_backend: str, rpc_world_keeper: WorldKeeper) -> None:
        rpc_world_keeper.close()
        with world(rpcx_backend, size=2):
            with pytest.raises(rpcx.SerializationError, match=r"set_device_map\('worker1'"):
                rpcx.rpc_sync("worker1", remote.echo, args=(torch.ones(2, device="cuda:0"),))
            # A CUDA result with no route back fails at the callee, and says so.
            with pytest.raises(rpcx.SerializationError, match="inverse"):
                rpcx.rpc_sync("worker1", remote.cuda_ones, args=(2, 0))

    def test_rref_to_here_of_a_cuda_value(self, cuda_world: World) -> None:
        rref = rpcx.remote("worker1", remote.cuda_ones, args=(3, _remote_index()))
        value = rref.to_here()
        assert value.device == torch.device("cuda:0") and torch.equal(value.cpu(), torch.ones(3))

    def test_distributed_backward_through_cuda_tensors(self, cuda_world: World) -> None:
        x = torch.arange(4.0, device="cuda:0", requires_grad=True)
        with dist_autograd.context() as context_id:
            y = rpcx.rpc_sync("worker1", torch.mul, args=(x, 3.0))
            assert y.device == torch.device("cuda:0")
            dist_autograd.backward(context_id, [(y * y).sum()])
            grads = dist_autograd.get_gradients(context_id)
        assert grads[x].device == torch.device("cuda:0")
        assert torch.allclose(grads[x], 18 * x.detach())  # d/dx (3x)^2 = 18x

    def test_remote_module_on_a_gpu_trains(self, cuda_world: World) -> None:
        there = _remote_index()
        module = RemoteModule(f"worker1/cuda:{there}", torch.nn.Linear, args=(4, 1))
        optimizer = DistributedOptimizer(torch.optim.SGD, module.remote_parameters(), lr=0.1)
        before = [p.to_here().cpu() for p in module.remote_parameters()]
        inputs = torch.ones(2, 4, device="cuda:0")
        with dist_autograd.context() as context_id:
            out = module(inputs)
            assert out.device == torch.device("cuda:0")  # mapped back to the caller's GPU
            dist_autograd.backward(context_id, [out.sum()])
            optimizer.step(context_id)
        after = [p.to_here().cpu() for p in module.remote_parameters()]
        assert all(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
