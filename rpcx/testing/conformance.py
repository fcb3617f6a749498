"""The conformance suite: what every rpcx backend must do, identically.

Import it into a test module (``from rpcx.testing.conformance import *``) with the
fixtures of :mod:`rpcx.testing.fixtures` active. Every test runs against the module's
``rpc_world``: this process (or thread) is ``worker0``; ``worker1`` to ``worker3`` are
other workers of the backend under test.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import rpcx
from rpcx.testing import remote
from rpcx.testing.conformance_autograd import (
    TestDDPHybrid,
    TestDistAutograd,
    TestDistributedOptimizer,
    TestRemoteModule,
)
from rpcx.testing.conformance_rounds import TestBackwardOnce
from rpcx.testing.world import World

__all__ = [
    "TestAsyncExecution",
    "TestBackwardOnce",
    "TestCalls",
    "TestDDPHybrid",
    "TestDistAutograd",
    "TestDistributedOptimizer",
    "TestErrors",
    "TestFutures",
    "TestRRef",
    "TestRRefLifetime",
    "TestRemoteModule",
    "TestTensors",
    "TestTimeouts",
]

W0, W1, W2, W3 = "worker0", "worker1", "worker2", "worker3"


class TestCalls:
    """rpc_sync / rpc_async / remote addressing, callables and nesting."""

    def test_destination_by_name_rank_and_workerinfo(self, rpc_world: World) -> None:
        info = rpcx.get_worker_info(W1)
        assert info == rpcx.WorkerInfo(W1, 1)
        for to in (W1, 1, info):
            assert rpcx.rpc_sync(to, remote.worker_name) == W1

    def test_worker_infos(self, rpc_world: World) -> None:
        infos = rpcx.get_worker_infos()
        assert [(i.name, i.id) for i in infos] == [(n, r) for r, n in enumerate(rpc_world.names)]
        assert rpcx.get_worker_info() == rpcx.WorkerInfo("worker0", 0)
        assert rpcx.rpc_sync(W2, rpcx.get_worker_info) == rpcx.WorkerInfo(W2, 2)

    def test_kinds_of_callables(self, rpc_world: World) -> None:
        added = rpcx.rpc_sync(W1, torch.add, args=(torch.ones(2), 3))
        assert torch.equal(added, torch.full((2,), 4.0))
        assert rpcx.rpc_sync(W1, remote.Static.triple, args=(5,)) == 15
        counter = rpcx.rpc_sync(W1, remote.Counter, args=(7,))
        assert isinstance(counter, remote.Counter) and counter.count == 7
        assert rpcx.rpc_sync(W1, max, args=([3, 9, 4],)) == 9

    def test_args_and_kwargs(self, rpc_world: World) -> None:
        args, kwargs = rpcx.rpc_sync(W1, remote.echo_kwargs, args=[1, "two"], kwargs={"k": 3})
        assert args == (1, "two") and kwargs == {"k": 3}
        assert rpcx.rpc_sync(W1, remote.echo_kwargs) == ((), {})

    def test_call_to_self(self, rpc_world: World) -> None:
        assert rpcx.rpc_sync("worker0", remote.add, args=(2, 3)) == 5
        assert rpcx.rpc_async(0, remote.worker_name).wait() == "worker0"

    def test_nested_three_workers(self, rpc_world: World) -> None:
        value, route = rpcx.rpc_sync(W1, remote.chain, args=([W2], 0))
        assert (value, route) == (1, [W1, W2])

    def test_nested_back_to_caller(self, rpc_world: World) -> None:
        value, route = rpcx.rpc_sync(W1, remote.chain, args=(["worker0", W2, "worker0"], 10))
        assert (value, route) == (13, [W1, "worker0", W2, "worker0"])

    def test_nesting_deeper_than_the_request_pool(self, rpc_world: World) -> None:
        # 40 hops between worker0 and worker1, each holding a request thread while it
        # waits: 20 blocked threads per worker, more than the default pool of 16.
        depth = 40
        assert rpcx.rpc_sync(W1, remote.ping_pong, args=(depth, "worker0", W1)) == depth

    def test_a_handler_blocked_where_rpcx_cannot_see_does_not_stop_its_peer(
        self, rpc_world: World
    ) -> None:
        # The first call blocks on a plain Event that only the second call, from the
        # same worker, opens. A transport serving requests on its receiving thread must
        # move receiving elsewhere (rpcx._core.lanes: the watchdog), or this never finishes.
        key = f"event-{uuid.uuid4().hex}"
        blocked = rpcx.rpc_async(W1, remote.wait_for_event, args=(key, 30.0))
        assert rpcx.rpc_sync(W1, remote.set_event, args=(key,), timeout=30) == W1
        assert blocked.wait() is True

    def test_replies_from_a_peer_busy_in_a_long_handler_still_arrive(
        self, rpc_world: World
    ) -> None:
        # worker1 runs a long, never-waiting handler for us; calls to worker1 made
        # meanwhile (served concurrently) and their replies must not wait for it.
        busy = rpcx.rpc_async(W1, remote.spin, args=(3.0,))
        assert rpcx.rpc_sync(W1, remote.add, args=(1, 2), timeout=30) == 3
        assert not busy.done(), "the call queued behind the spinning handler"
        assert busy.wait() == 3.0

    def test_hundreds_of_concurrent_calls(self, rpc_world: World) -> None:
        futures = [rpcx.rpc_async(W1 if i % 2 else W2, remote.add, args=(i, 1)) for i in range(400)]
        assert [f.wait() for f in futures] == [i + 1 for i in range(400)]

    def test_bursts_of_thousands_of_small_calls(self, rpc_world: World) -> None:
        # A transport that batches what it sends while a burst is being served (rpcx-shm
        # corks replies) must still deliver every reply: a batch once outgrew one write.
        for _ in range(3):
            futures: list[torch.futures.Future[int]] = [
                rpcx.rpc_async(W1, remote.add, args=(i, 1)) for i in range(5000)
            ]
            assert torch.futures.wait_all(futures) == [i + 1 for i in range(5000)]

    def test_concurrent_calls_with_tensors(self, rpc_world: World) -> None:
        tensors = [torch.full((64,), float(i)) for i in range(100)]
        futures = [rpcx.rpc_async(W2, remote.add, args=(t, 1)) for t in tensors]
        for i, fut in enumerate(futures):
            assert torch.equal(fut.wait(), torch.full((64,), i + 1.0))

    def test_unknown_destination(self, rpc_world: World) -> None:
        known = ", ".join(rpc_world.names)
        for bad in ("no_such_worker", 17, rpcx.WorkerInfo("worker1", 2)):
            with pytest.raises(rpcx.UnknownWorkerError, match=known):
                rpcx.rpc_sync(bad, remote.add, args=(1, 2))
        with pytest.raises(rpcx.UnknownWorkerError):
            rpcx.remote("nope", remote.add, args=(1, 2))
        with pytest.raises(TypeError, match="must be callable"):
            rpcx.rpc_sync(W1, 42)


class TestFutures:
    """rpc_async returns a real torch.futures.Future."""

    def test_is_a_torch_future(self, rpc_world: World) -> None:
        fut = rpcx.rpc_async(W1, remote.add, args=(1, 2))
        assert isinstance(fut, torch.futures.Future)
        assert fut.wait() == 3 and fut.done() and fut.value() == 3

    def test_then_and_callbacks(self, rpc_world: World) -> None:
        seen: list[int] = []
        called = threading.Event()
        fut = rpcx.rpc_async(W1, remote.add, args=(1, 2))
        chained = fut.then(lambda f: f.wait() * 10)

        def record(f: torch.futures.Future[int]) -> None:
            seen.append(f.value())
            called.set()

        fut.add_done_callback(record)
        assert chained.wait() == 30
        # As with torch, wait() may return before every callback has finished running.
        assert called.wait(10)
        assert seen == [3]

    def test_collect_all_and_wait_all(self, rpc_world: World) -> None:
        futures: list[torch.futures.Future[int]] = [
            rpcx.rpc_async(W1, remote.add, args=(i, i)) for i in range(5)
        ]
        done = torch.futures.collect_all(futures).wait()
        assert [f.value() for f in done] == [0, 2, 4, 6, 8]
        assert torch.futures.wait_all([rpcx.rpc_async(W2, remote.add, args=(1, 1))]) == [2]

    def test_callback_may_block_on_the_same_worker(self, rpc_world: World) -> None:
        # The callback waits for a reply from the worker whose reply triggered it.
        fut = rpcx.rpc_async(W1, remote.add, args=(1, 1)).then(
            lambda f: rpcx.rpc_sync(W1, remote.add, args=(f.wait(), 1), timeout=20)
        )
        assert fut.wait() == 3

    def test_callback_may_call_rpc(self, rpc_world: World) -> None:
        fut = rpcx.rpc_async(W1, remote.add, args=(1, 1)).then(
            lambda f: rpcx.rpc_async(W2, remote.add, args=(f.wait(), 1))
        )
        assert fut.wait().wait() == 3


class TestAsyncExecution:
    """@rpcx.functions.async_execution: the reply comes when the returned future does."""

    def test_async_function(self, rpc_world: World) -> None:
        assert rpcx.rpc_sync(W1, remote.async_add_via, args=(W2, 1, 2)) == 4
        assert rpcx.rpc_async(W1, remote.async_add_via, args=("worker0", 1, 2)).wait() == 4

    def test_async_static_method(self, rpc_world: World) -> None:
        assert rpcx.rpc_sync(W1, remote.Static.async_triple, args=(3,)) == 9

    def test_async_with_remote(self, rpc_world: World) -> None:
        rref = rpcx.remote(W1, remote.async_add_via, args=(W2, 2, 3))
        assert rref.to_here() == 6

    def test_async_method_through_rref_proxies(self, rpc_world: World) -> None:
        rref = rpcx.remote(W1, remote.Counter, args=(4,))
        assert rref.rpc_sync().async_double() == 8
        assert rref.rpc_async().async_double().wait() == 8
        assert rref.remote().async_double().to_here() == 8

    def test_async_function_must_return_a_future(self, rpc_world: World) -> None:
        with pytest.raises(TypeError, match=r"must return a torch\.futures\.Future"):
            rpcx.rpc_sync(W1, remote.async_returns_wrong_type)

    def test_torch_decorator_is_honoured(self, rpc_world: World) -> None:
        # Programs that still decorate with torch's async_execution keep working: the
        # reply is the returned future's value (not the future), here and via RRefs.
        from torch.distributed.rpc import functions as torch_functions

        wrapped = torch_functions.async_execution(remote.echo)  # type: ignore[no-untyped-call]
        assert rpcx.functions.is_async_execution(wrapped)
        assert rpcx.rpc_sync(W1, remote.torch_async_add_via, args=(W2, 1, 2)) == 4
        assert rpcx.rpc_async(W1, remote.torch_async_add_via, args=(W0, 2, 2)).wait() == 5
        assert rpcx.remote(W2, remote.torch_async_add_via, args=(W3, 3, 3)).to_here() == 7
        counter = rpcx.remote(W1, remote.Counter, args=(5,))
        assert counter.rpc_sync().torch_async_double() == 10


# A timeout must not fire early, nor late by more than this: generous, for loaded CI
# machines, but a timer running 10x slow (0.5 s firing after 5 s) fails.
TIMEOUT = 0.5
LATE_BY_AT_MOST = 4.0


class _Elapsed:
    """Measures a block; ``check(timeout)`` asserts it ended within the timeout's bounds."""

    def __enter__(self) -> _Elapsed:
        self.started = time.monotonic()
        self.seconds = float("nan")
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.monotonic() - self.started

    def check(self, timeout: float = TIMEOUT) -> None:
        assert self.seconds >= timeout * 0.9, f"timed out early: {self.seconds:.2f} s"
        assert self.seconds < timeout + LATE_BY_AT_MOST, (
            f"a {timeout} s timeout fired after {self.seconds:.2f} s"
        )


class TestTimeouts:
    """Per-call and default timeouts; errors name the call, worker and time.

    Every timeout here is checked for when it fires (not early, not late by more than
    ``LATE_BY_AT_MOST``), and the call it cuts short would otherwise block for far
    longer (``BLOCK``), so an ignored timeout fails the test instead of passing slowly.
    """

    BLOCK = 15.0

    def test_per_call_timeout(self, rpc_world: World) -> None:
        key = uuid.uuid4().hex
        try:
            with _Elapsed() as elapsed, pytest.raises(rpcx.RpcTimeoutError) as info:
                rpcx.rpc_sync(W1, remote.wait_for_release, args=(key, self.BLOCK),
                              timeout=TIMEOUT)
            elapsed.check()
            message = str(info.value)
            assert "rpc_sync(rpcx.testing.remote.wait_for_release)" in message
            assert "'worker1'" in message and f"timeout {TIMEOUT:g} s" in message
            assert isinstance(info.value, TimeoutError)
        finally:
            rpcx.rpc_sync(W1, remote.release, args=(key,))

    def test_async_timeout_goes_to_the_future(self, rpc_world: World) -> None:
        key = uuid.uuid4().hex
        try:
            with _Elapsed() as elapsed:
                fut = rpcx.rpc_async(W2, remote.wait_for_release, args=(key, self.BLOCK),
                                     timeout=TIMEOUT)
                with pytest.raises(rpcx.RpcTimeoutError, match=r"rpc_async\(.*wait_for_release\)"):
                    fut.wait()
            elapsed.check()
        finally:
            rpcx.rpc_sync(W2, remote.release, args=(key,))

    def test_default_timeout(self, rpc_world: World) -> None:
        key = uuid.uuid4().hex
        default = rpcx.get_rpc_timeout()
        rpcx._set_rpc_timeout(TIMEOUT)
        try:
            with _Elapsed() as elapsed, pytest.raises(
                rpcx.RpcTimeoutError, match=rf"timeout {TIMEOUT:g} s"
            ):
                rpcx.rpc_sync(W1, remote.wait_for_release, args=(key, self.BLOCK))
            elapsed.check()
        finally:
            rpcx._set_rpc_timeout(default)
            rpcx.rpc_sync(W1, remote.release, args=(key,))
        assert rpcx.get_rpc_timeout() == default

    def test_zero_means_no_timeout(self, rpc_world: World) -> None:
        key, other = uuid.uuid4().hex, uuid.uuid4().hex
        default = rpcx.get_rpc_timeout()
        rpcx._set_rpc_timeout(0.05)
        try:
            blocked = rpcx.rpc_async(W1, remote.wait_for_release, args=(key, 30.0), timeout=0)
            # Let more than the 0.05 s default pass, measured by a call that times out.
            with pytest.raises(rpcx.RpcTimeoutError):
                rpcx.rpc_sync(W2, remote.wait_for_release, args=(other,), timeout=0.2)
            assert not blocked.done()
            rpcx.rpc_sync(W1, remote.release, args=(key,), timeout=10)
            assert blocked.wait() is True
        finally:
            rpcx._set_rpc_timeout(default)
            rpcx.rpc_sync(W2, remote.release, args=(other,), timeout=10)

    def test_remote_timeout_surfaces_at_to_here(self, rpc_world: World) -> None:
        key = uuid.uuid4().hex
        try:
            with _Elapsed() as elapsed:
                rref = rpcx.remote(W1, remote.wait_for_release, args=(key, self.BLOCK),
                                   timeout=TIMEOUT)
                with pytest.raises(rpcx.RpcTimeoutError, match=r"remote\(.*wait_for_release\)"):
                    rref.to_here()
            elapsed.check()
        finally:
            rpcx.rpc_sync(W1, remote.release, args=(key,))

    def test_to_here_timeout(self, rpc_world: World) -> None:
        # The value exists, but sending it takes BLOCK seconds: to_here must give up
        # after its own timeout, and say so.
        key = uuid.uuid4().hex
        rref = rpcx.remote(W2, remote.SlowToPickle, args=(key, self.BLOCK))
        rref._get_future().wait()  # created: only the fetch is slow
        try:
            with _Elapsed() as elapsed, pytest.raises(
                rpcx.RpcTimeoutError,
                match=rf"to_here\(.*\) to worker 'worker2'.*timeout {TIMEOUT:g} s",
            ):
                rref.to_here(timeout=TIMEOUT)
            elapsed.check()
        finally:
            rpcx.rpc_sync(W2, remote.release, args=(key,))
        assert isinstance(rref.to_here(timeout=10), remote.SlowToPickle)

    def test_to_here_timeout_while_the_value_is_being_created(self, rpc_world: World) -> None:
        key = uuid.uuid4().hex
        block = TIMEOUT + LATE_BY_AT_MOST + 1.0  # just long enough to show the bug
        try:
            rref = rpcx.remote(W2, remote.wait_for_release, args=(key, block), timeout=0)
            with _Elapsed() as elapsed, pytest.raises(rpcx.RpcTimeoutError, match="to_here"):
                rref.to_here(timeout=TIMEOUT)
            elapsed.check()
        finally:
            rpcx.rpc_sync(W2, remote.release, args=(key,))

    @pytest.mark.parametrize("api", ["rpc_sync", "rpc_async", "remote"])
    def test_rref_proxy_timeouts(self, rpc_world: World, api: str) -> None:
        counter = rpcx.remote(W3, remote.Counter, args=(1,))
        assert counter.rpc_sync().value() == 1  # created before the clock starts
        key = uuid.uuid4().hex
        try:
            with _Elapsed() as elapsed, pytest.raises(
                rpcx.RpcTimeoutError, match=rf"{api}\(.*wait_for_release\).*'worker3'"
            ):
                if api == "rpc_sync":
                    counter.rpc_sync(timeout=TIMEOUT).wait_for_release(key, self.BLOCK)
                elif api == "rpc_async":
                    counter.rpc_async(timeout=TIMEOUT).wait_for_release(key, self.BLOCK).wait()
                else:
                    counter.remote(timeout=TIMEOUT).wait_for_release(key, self.BLOCK).to_here()
            elapsed.check()
        finally:
            rpcx.rpc_sync(W3, remote.release, args=(key,))


class TestErrors:
    """Remote exceptions keep their type, message, worker and traceback."""

    def test_builtin_exception_type_and_message(self, rpc_world: World) -> None:
        with pytest.raises(ValueError) as info:
            rpcx.rpc_sync(W1, remote.raise_value_error, args=("bad value",))
        exc = info.value
        assert type(exc) is ValueError and str(exc) == "bad value"
        assert isinstance(exc.__cause__, rpcx.RemoteTraceback)
        assert "raise_value_error" in exc.__cause__.text
        assert "Traceback" in exc.__cause__.text
        assert any("'worker1'" in note and "raise_value_error" in note
                   for note in getattr(exc, "__notes__", []))

    def test_custom_exception_type(self, rpc_world: World) -> None:
        with pytest.raises(remote.CustomError, match="custom"):
            rpcx.rpc_async(W2, remote.raise_custom, args=("custom",)).wait()

    def test_unrebuildable_exception(self, rpc_world: World) -> None:
        with pytest.raises(rpcx.RemoteException) as info:
            rpcx.rpc_sync(W1, remote.raise_unrebuildable)
        exc = info.value
        assert exc.exc_type == "rpcx.testing.remote.UnrebuildableError"
        assert exc.remote_message == "broken: cannot be rebuilt"
        assert exc.worker == W1
        assert "raise_unrebuildable" in exc.remote_traceback
        assert "broken: cannot be rebuilt" in str(exc) and W1 in str(exc)

    def test_unpicklable_argument_fails_at_the_caller(self, rpc_world: World) -> None:
        expected = r"rpc_sync\(.*echo\) to worker 'worker1'"
        with pytest.raises(rpcx.SerializationError, match=expected):
            rpcx.rpc_sync(W1, remote.echo, args=(lambda: 1,))
        with pytest.raises(rpcx.SerializationError):
            rpcx.rpc_async(W1, remote.echo, args=(lambda: 1,))

    def test_unpicklable_result(self, rpc_world: World) -> None:
        with pytest.raises(rpcx.SerializationError, match="could not pickle the result"):
            rpcx.rpc_sync(W1, remote.unpicklable_result)

    def test_function_missing_on_callee(self, rpc_world: World) -> None:
        with pytest.raises(rpcx.SerializationError) as info:
            rpcx.rpc_sync(W2, remote.UnloadableOnCallee())
        message = str(info.value)
        assert "'worker2' could not unpickle the request" in message
        assert "rpcx_testing_module_that_does_not_exist" in message

    def test_error_does_not_break_later_calls(self, rpc_world: World) -> None:
        with pytest.raises(ValueError):
            rpcx.rpc_sync(W1, remote.raise_value_error, args=("x",))
        assert rpcx.rpc_sync(W1, remote.add, args=(1, 1)) == 2


_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex64, torch.complex128,
]


def _sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 4)) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.arange(12).reshape(shape) % 3 == 0
    if dtype.is_complex:
        return torch.complex(torch.arange(12.0), -torch.arange(12.0)).reshape(shape).to(dtype)
    return (torch.arange(12) - 5).reshape(shape).to(dtype)


class TestTensors:
    """Tensor values survive the trip exactly, as copies."""

    @pytest.mark.parametrize("dtype", _DTYPES, ids=str)
    def test_every_dtype(self, rpc_world: World, dtype: torch.dtype) -> None:
        tensor = _sample(dtype)
        out = rpcx.rpc_sync(W1, remote.echo, args=(tensor,))
        assert out.dtype == dtype and out.shape == tensor.shape
        assert torch.equal(out, tensor)

    def test_zero_dim_and_empty(self, rpc_world: World) -> None:
        scalar = torch.tensor(3.5, dtype=torch.float64)
        empty = torch.empty(0, 5, dtype=torch.int32)
        out_scalar, out_empty = rpcx.rpc_sync(W1, remote.echo, args=((scalar, empty),))
        assert out_scalar.dim() == 0 and out_scalar.item() == 3.5
        assert out_empty.shape == (0, 5) and out_empty.dtype == torch.int32

    def test_non_contiguous_views(self, rpc_world: World) -> None:
        base = torch.arange(60.0).reshape(6, 10)
        views = [base.t(), base[:, 2:7:2], base[1::2], base.expand(2, 6, 10)[1]]
        outs = rpcx.rpc_sync(W2, remote.echo, args=(views,))
        for view, out in zip(views, outs, strict=True):
            assert torch.equal(out, view) and out.shape == view.shape

    def test_expanded_size_one_dimensions(self, rpc_world: World) -> None:
        # Contiguous by torch's rules, but with stride 0 in a size-1 dimension.
        for tensor in (torch.ones(()).expand(1), torch.arange(3.0).reshape(3, 1).expand(3, 1),
                       torch.ones(1, 1).expand(1, 1)[:, :1]):
            tensor = tensor.as_strided(tensor.shape, [0] * tensor.dim())
            assert torch.equal(rpcx.rpc_sync(W1, remote.echo, args=(tensor,)), tensor)

    def test_large_tensor(self, rpc_world: World) -> None:
        tensor = torch.randn(16 << 20)  # 64 MiB
        out = rpcx.rpc_sync(W1, remote.echo, args=(tensor,), timeout=120)
        assert torch.equal(out, tensor)

    def test_arguments_are_copies(self, rpc_world: World) -> None:
        for to in (W1, "worker0"):
            tensor = torch.zeros(4)
            out = rpcx.rpc_sync(to, remote.mutate_and_return, args=(tensor,))
            assert torch.equal(tensor, torch.zeros(4)), "the caller's tensor changed"
            assert torch.equal(out, torch.ones(4))

    def test_large_arguments_are_copied_before_rpc_async_returns(self, rpc_world: World) -> None:
        tensor = torch.zeros(8 << 20)  # 32 MiB: too large to travel inline
        future = rpcx.rpc_async(W1, remote.tensor_sum, args=(tensor,), timeout=120)
        tensor.fill_(1.0)  # the call has been made: this must not reach the callee
        assert future.wait() == 0.0

    def test_results_are_copies(self, rpc_world: World) -> None:
        tensor = torch.zeros(3)
        out = rpcx.rpc_sync(W1, remote.echo, args=(tensor,))
        out.add_(5)
        assert torch.equal(tensor, torch.zeros(3))

    def test_nested_containers(self, rpc_world: World) -> None:
        payload: dict[str, Any] = {
            "a": [torch.ones(2), (torch.zeros(1, dtype=torch.int64), {"deep": torch.eye(2)})],
            "b": {"c": [torch.tensor([True, False])], "n": 5, "s": "text"},
        }
        out = rpcx.rpc_sync(W1, remote.echo, args=(payload,))
        assert out.keys() == payload.keys() and out["b"]["n"] == 5 and out["b"]["s"] == "text"
        assert torch.equal(out["a"][0], payload["a"][0])
        assert torch.equal(out["a"][1][0], payload["a"][1][0])
        assert torch.equal(out["a"][1][1]["deep"], torch.eye(2))
        assert torch.equal(out["b"]["c"][0], payload["b"]["c"][0])

    def test_same_tensor_twice_arrives_as_one(self, rpc_world: World) -> None:
        tensor = torch.ones(3)
        assert rpcx.rpc_sync(W1, remote.same_object, args=(tensor, tensor)) is True
        assert rpcx.rpc_sync(W1, remote.same_object, args=(tensor, tensor.clone())) is False

    def test_requires_grad_and_parameter_type(self, rpc_world: World) -> None:
        leaf = torch.ones(2, requires_grad=True)
        param = torch.nn.Parameter(torch.zeros(3))
        assert rpcx.rpc_sync(W1, remote.describe_tensor, args=(leaf,)) == (
            "torch.float32", (2,), True, "Tensor")
        assert rpcx.rpc_sync(W1, remote.describe_tensor, args=(param,)) == (
            "torch.float32", (3,), True, "Parameter")
        out = rpcx.rpc_sync(W1, remote.echo, args=(param,))
        assert isinstance(out, torch.nn.Parameter) and torch.equal(out, param)


class TestRRef:
    """remote(), RRef identity, values and proxies (the lifetime protocol is separate)."""

    def test_remote_and_to_here(self, rpc_world: World) -> None:
        rref = rpcx.remote(W1, remote.add, args=(torch.ones(2), 1))
        assert torch.equal(rref.to_here(), torch.full((2,), 2.0))
        assert rref.owner() == rpcx.WorkerInfo(W1, 1) and rref.owner_name() == W1
        assert not rref.is_owner()
        assert rref.confirmed_by_owner()  # to_here succeeded, so the owner has it

    def test_local_owner_rref(self, rpc_world: World) -> None:
        value = torch.arange(3)
        rref = rpcx.RRef(value)
        assert rref.is_owner() and rref.confirmed_by_owner()
        assert rref.local_value() is value and rref.to_here() is value
        assert rref.owner_name() == "worker0"

    def test_local_value_only_on_owner(self, rpc_world: World) -> None:
        rref = rpcx.remote(W1, remote.Counter, args=(1,))
        with pytest.raises(rpcx.RpcError, match=re.escape("owned by 'worker1'")):
            rref.local_value()
        assert rpcx.rpc_sync(W1, remote.rref_local_value, args=(rref,)).count == 1

    def test_proxies(self, rpc_world: World) -> None:
        rref = rpcx.remote(W2, remote.Counter, args=(10,))
        assert rref.rpc_sync().increment(5) == 15
        assert rref.rpc_async().increment(1).wait() == 16
        result = rref.remote().value()
        assert result.owner_name() == W2 and result.to_here() == 16
        with pytest.raises(KeyError, match="counter failure"):
            rref.rpc_sync().fail()

    def test_proxy_methods_are_sent_as_functions(self, rpc_world: World) -> None:
        # The RPC tutorial's agent starts each episode with
        # rpc_async(ob_rref.owner(), ob_rref.rpc_sync().run_episode, args=(...)).
        counter = rpcx.remote(W1, remote.Counter, args=(1,))
        started = rpcx.rpc_async(counter.owner(), counter.rpc_sync().increment, args=(5,))
        assert started.wait() == 6
        # Run on a third worker, which calls the owner from there; every proxy kind.
        assert rpcx.rpc_sync(W2, remote.call_with, args=(counter.rpc_sync().increment, 1)) == 7
        assert rpcx.rpc_sync(W2, remote.call_and_wait, args=(counter.rpc_async().value,)) == 7
        made = rpcx.rpc_sync(W2, remote.call_with, args=(counter.remote().value,))
        assert made.to_here() == 7
        method = counter.rpc_sync().value
        assert "value" in repr(method) and "rpc_sync" in repr(method)

    def test_rref_passed_to_a_third_worker(self, rpc_world: World) -> None:
        rref = rpcx.remote(W1, remote.Counter, args=(3,))
        assert rpcx.rpc_sync(W2, remote.rref_info, args=(rref,)) == (W1, False)
        assert rpcx.rpc_sync(W1, remote.rref_info, args=(rref,)) == (W1, True)
        assert rpcx.rpc_sync(W2, remote.rref_increment, args=(rref, 2)) == 5
        assert rref.to_here().count == 5

    def test_rref_returned_from_a_call(self, rpc_world: World) -> None:
        rref = rpcx.rpc_sync(W1, remote.make_rref, args=(torch.ones(2),))
        assert rref.owner_name() == W1
        assert torch.equal(rref.to_here(), torch.ones(2))
        assert torch.equal(rpcx.rpc_sync(W2, remote.rref_to_here, args=(rref,)), torch.ones(2))

    def test_local_rref_sent_to_others(self, rpc_world: World) -> None:
        rref = rpcx.RRef(remote.Counter(8))
        assert rpcx.rpc_sync(W1, remote.rref_info, args=(rref,)) == ("worker0", False)
        assert rpcx.rpc_sync(W1, remote.rref_increment, args=(rref, 1)) == 9
        assert rref.local_value().count == 9

    def test_rrefs_in_containers(self, rpc_world: World) -> None:
        rrefs = [rpcx.remote(W1 if i % 2 else W2, remote.add, args=(i, 0)) for i in range(4)]
        out = rpcx.rpc_sync(W1, remote.echo, args=({"refs": rrefs},))
        assert [r.to_here() for r in out["refs"]] == [0, 1, 2, 3]

    def test_remote_failure_surfaces_on_next_use(self, rpc_world: World) -> None:
        rref = rpcx.remote(W1, remote.raise_value_error, args=("creation failed",))
        with pytest.raises(ValueError, match="creation failed"):
            rref.to_here()
        with pytest.raises(ValueError, match="creation failed"):
            rref.rpc_sync().anything()
        assert not rref.confirmed_by_owner()

    def test_remote_to_self(self, rpc_world: World) -> None:
        rref = rpcx.remote("worker0", remote.Counter, args=(2,))
        assert rref.is_owner()
        assert rref.to_here().count == 2
        assert rref.rpc_sync().increment(1) == 3

    def test_rref_cannot_be_pickled_outside_a_call(self, rpc_world: World) -> None:
        import pickle

        with pytest.raises(rpcx.RpcError, match="only be pickled by rpcx"):
            pickle.dumps(rpcx.RRef(1))


def _settle(world: World, rounds: int = 10) -> list[dict[str, int]]:
    """Flush reference bookkeeping on every worker until nothing is left in flight.

    Freeing one value can release RRefs it contained (to values elsewhere), so this
    repeats until two rounds in a row find nothing to do; each round is deterministic
    (every message it sends is acknowledged before it returns).
    """
    stats: list[dict[str, int]] = []
    for _ in range(rounds):
        stats = [rpcx.rpc_sync(name, remote.rref_settle, timeout=60) for name in world.names]
        if all(s["pending_deletes"] == 0 and s["pending_forks"] == 0 for s in stats):
            again = [rpcx.rpc_sync(name, remote.rref_settle, timeout=60) for name in world.names]
            if again == stats:
                return stats
    raise AssertionError(f"RRef bookkeeping did not settle: {stats}")


def _no_references(stats: list[dict[str, int]]) -> bool:
    return all(
        s["owned"] == 0 and s["references_to_owned"] == 0 and s["user_rrefs"] == 0
        and s["owner_rrefs"] == 0
        for s in stats
    )


class TestRRefLifetime:
    """The owner keeps a value exactly while some RRef to it exists anywhere."""

    def test_value_freed_when_the_last_reference_goes(self, rpc_world: World) -> None:
        baseline = rpcx.rpc_sync(W1, remote.tracked_live)
        rref = rpcx.remote(W1, remote.Tracked, args=("x",))
        assert rref.rpc_sync().get() == "x"
        _settle(rpc_world)
        assert rpcx.rpc_sync(W1, remote.tracked_live) == baseline + 1
        del rref
        stats = _settle(rpc_world)
        assert rpcx.rpc_sync(W1, remote.tracked_live) == baseline
        assert _no_references(stats), stats

    def test_three_workers_forking(self, rpc_world: World) -> None:
        # worker0 creates on worker1, passes it to worker2, which passes it back.
        key = uuid.uuid4().hex
        rref = rpcx.remote(W1, remote.add, args=(2, 3))
        rpcx.rpc_sync(W2, remote.hold, args=(key, rref))
        assert rpcx.rpc_sync(W2, remote.wait_confirmed_held, args=(key,)) is True
        route = rpcx.rpc_sync(W2, remote.forward_held, args=(key, [W0], 5))
        assert route == [W2, W0]
        del rref  # worker2 still holds it
        _settle(rpc_world)
        assert rpcx.rpc_sync(W2, remote.held_to_here, args=(key,)) == 5
        rpcx.rpc_sync(W2, remote.drop, args=(key,))
        assert _no_references(_settle(rpc_world))

    def test_chain_of_eight_hops(self, rpc_world: World) -> None:
        rref = rpcx.remote(W3, remote.add, args=(40, 2))
        path = [W1, W2, W3, W0, W1, W2, W3, W1]
        route = rpcx.rpc_sync(W2, remote.forward, args=(rref, path, 42))
        assert route == [W2, *path]
        del rref
        assert _no_references(_settle(rpc_world))

    def test_fork_in_flight_keeps_the_value(self, rpc_world: World) -> None:
        rref = rpcx.remote(W1, remote.add, args=(1, 1))
        future = rpcx.rpc_async(W2, remote.forward, args=(rref, [W3], 2))
        del rref  # dropped while the fork it made is still in flight
        assert future.wait() == [W2, W3]
        assert _no_references(_settle(rpc_world))

    def test_rref_sent_to_its_owner_while_dropped(self, rpc_world: World) -> None:
        # The announcement of a fork for the owner rides in the call's frame; the sender
        # drops its RRef at once, so its deletion races the call to the owner.
        futures = []
        for i in range(200):
            rref = rpcx.remote(W1, remote.add, args=(i, 0))
            futures.append(rpcx.rpc_async(W1, remote.rref_to_here, args=(rref,)))
            del rref
        assert [f.wait() for f in futures] == list(range(200))
        assert _no_references(_settle(rpc_world))

    def test_rref_of_rrefs(self, rpc_world: World) -> None:
        baseline = rpcx.rpc_sync(W2, remote.tracked_live)
        inner = rpcx.remote(W2, remote.Tracked, args=("inner",))
        outer = rpcx.rpc_sync(W3, remote.wrap_in_rref, args=(inner,))
        assert outer.owner_name() == W3
        del inner
        assert rpcx.rpc_sync(W1, remote.unwrap_twice, args=(outer,)).get() == "inner"
        del outer  # freeing the outer value releases the inner reference it holds
        assert _no_references(_settle(rpc_world))
        assert rpcx.rpc_sync(W2, remote.tracked_live) == baseline

    def test_rrefs_in_dicts_and_lists(self, rpc_world: World) -> None:
        refs = {f"r{i}": rpcx.remote(W1 if i % 2 else W2, remote.add, args=(i, 0))
                for i in range(6)}
        nested = {"by_name": refs, "as_list": list(refs.values())}
        out = rpcx.rpc_sync(W3, remote.echo, args=(nested,))
        assert [r.to_here() for r in out["as_list"]] == list(range(6))
        assert out["by_name"]["r3"].to_here() == 3
        assert out["by_name"]["r3"] is out["as_list"][3]  # one object per reference sent
        del refs, nested, out
        assert _no_references(_settle(rpc_world))

    def test_many_concurrent_forks_of_one_rref(self, rpc_world: World) -> None:
        rref = rpcx.remote(W1, remote.add, args=(7, 0))
        futures = [
            rpcx.rpc_async(w, remote.fan_out_and_check, args=(rref, [W1, W2, W3], 7))
            for w in (W1, W2, W3) for _ in range(10)
        ]
        assert [f.wait() for f in futures] == [3] * 30
        assert rref.to_here() == 7
        del rref
        assert _no_references(_settle(rpc_world))

    def test_receiver_is_confirmed_by_owner(self, rpc_world: World) -> None:
        rref = rpcx.remote(W1, remote.add, args=(1, 2))
        assert rpcx.rpc_sync(W2, remote.wait_confirmed, args=(rref,)) is True
        assert rpcx.rpc_sync(W1, remote.wait_confirmed, args=(rref,)) is True  # the owner
        local = rpcx.RRef(3)
        assert rpcx.rpc_sync(W3, remote.wait_confirmed, args=(local,)) is True  # from owner
        assert rref._wait_confirmed(30)
        del rref, local
        assert _no_references(_settle(rpc_world))

    def test_stress_create_fork_drop(self, rpc_world: World) -> None:
        # Thousands of create / fork / drop cycles over four workers, many in flight at
        # once. Every to_here must see its value (never freed early); afterwards nothing
        # may be left on any worker (never leaked).
        workers = [W0, W1, W2, W3]
        cycles, in_flight = 2000, 100
        hops_done = 0
        for start in range(0, cycles, in_flight):
            futures = []
            for i in range(start, min(cycles, start + in_flight)):
                owner = workers[i % 4]
                hops = [workers[(i + k) % 4] for k in (1, 2, 3)]
                rref = rpcx.remote(owner, remote.add, args=(i, 0))
                futures.append(rpcx.rpc_async(hops[0], remote.stress_hop,
                                              args=(rref, i, hops[1:]), timeout=120))
                del rref
            hops_done += sum(f.wait() for f in futures)
        assert hops_done == cycles * 3
        stats = _settle(rpc_world)
        assert _no_references(stats), stats

    def test_remote_failure_surfaces_when_forked(self, rpc_world: World) -> None:
        rref = rpcx.remote(W1, remote.raise_value_error, args=("creation failed",))
        with pytest.raises(ValueError, match="creation failed"):
            rref.to_here()
        with pytest.raises(ValueError, match="creation failed") as info:
            rpcx.rpc_sync(W2, remote.echo, args=(rref,))
        notes = getattr(info.value, "__notes__", [])
        assert any("'worker1'" in n and "remote(" in n for n in notes), notes

    def test_call_that_fails_to_unpickle_releases_its_forks(self, rpc_world: World) -> None:
        # The callee cannot rebuild the arguments, but the RRef among them was forked to
        # it; the owner must still learn that the fork is gone.
        rref = rpcx.RRef(remote.Tracked("local"))
        with pytest.raises(rpcx.SerializationError, match="refuses to be rebuilt"):
            rpcx.rpc_sync(W1, remote.echo, args=([remote.FailsToRebuild(), rref],))
        del rref
        stats = _settle(rpc_world)
        assert _no_references(stats), stats

    def test_remote_that_fails_to_unpickle_fails_every_user(
        self, rpc_world: World, tmp_path: Path
    ) -> None:
        # The owner cannot rebuild remote()'s arguments: a third worker's to_here gets
        # that error at once, not a timeout, and nothing is left behind at the owner.
        # The gate holds the owner's unpickler until the RRef has been sent on; once the
        # failure is known here, sending the RRef fails instead (the test above).
        gate = remote.Gate(str(tmp_path / "gate"))
        try:
            rref = rpcx.remote(W1, remote.echo, args=(remote.FailsToRebuildAfterGate(gate),))
            future = rpcx.rpc_async(W2, remote.rref_to_here_error, args=(rref, 30.0))
            gate.open()
            seen = future.wait()
        finally:
            gate.close()
        assert seen.startswith("SerializationError") and "refuses to be rebuilt" in seen, seen
        with pytest.raises(rpcx.SerializationError, match="could not unpickle"):
            rref.to_here()
        del rref
        stats = _settle(rpc_world)
        assert _no_references(stats), stats

    def test_owner_side_errors(self, rpc_world: World) -> None:
        rref = rpcx.remote(W1, remote.Counter, args=(0,))
        with pytest.raises(TypeError):
            rpcx.rpc_sync(W2, remote.rref_increment, args=(rref, "not a number"))
        with pytest.raises(AttributeError, match="no_such_method"):
            rref.rpc_sync().no_such_method()
        assert rref.rpc_sync().increment(2) == 2  # the value is still there and usable
