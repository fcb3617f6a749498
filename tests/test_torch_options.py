"""Half-migrated programs: torch's own options objects and BackendType, passed to rpcx.

A program whose imports were changed to rpcx may still build
``torch.distributed.rpc.TensorPipeRpcBackendOptions`` or pass ``rpc.BackendType.TENSORPIPE``.
rpcx reads torch's options into its own, and rejects what it cannot read with a message
that names what to use.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.rpc as torch_rpc

import rpcx
from rpcx._core import context as _context
from rpcx.options import RpcBackendOptions, TensorPipeRpcBackendOptions, as_rpcx_options

CUDA0 = torch.device("cuda:0")
CUDA1 = torch.device("cuda:1")


def test_torch_tensorpipe_options_are_read_field_by_field() -> None:
    theirs = torch_rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=3,
        rpc_timeout=7.5,
        init_method="tcp://127.0.0.1:1234",
        device_maps={"w1": {"cuda:0": "cuda:1"}},
        devices=["cuda:0"],
    )
    theirs.set_device_map("w2", {"cuda:1": "cuda:0"})
    ours = as_rpcx_options(theirs)
    assert type(ours) is TensorPipeRpcBackendOptions
    assert ours.num_worker_threads == 3
    assert ours.rpc_timeout == 7.5
    assert ours.init_method == "tcp://127.0.0.1:1234"
    assert ours.device_maps == {"w1": {CUDA0: CUDA1}, "w2": {CUDA1: CUDA0}}
    assert ours.devices == [CUDA0]
    ours.validate()


def test_torch_tensorpipe_defaults_become_rpcx_defaults() -> None:
    ours = as_rpcx_options(torch_rpc.TensorPipeRpcBackendOptions())
    assert vars(ours) == vars(TensorPipeRpcBackendOptions())


def test_torch_base_options_are_read() -> None:
    ours = as_rpcx_options(torch_rpc.RpcBackendOptions(12.0, "file:///tmp/x"))
    assert type(ours) is RpcBackendOptions
    assert (ours.rpc_timeout, ours.init_method) == (12.0, "file:///tmp/x")


def test_rpcx_and_duck_typed_options_pass_through_unchanged() -> None:
    ours = TensorPipeRpcBackendOptions(rpc_timeout=3)
    assert as_rpcx_options(ours) is ours

    class PluginOptions:  # a plugin's own options type, not derived from rpcx's
        rpc_timeout = 1.0
        init_method = "env://"
        num_worker_threads = 2

        def validate(self) -> None:
            pass

    plugin_options = PluginOptions()
    assert as_rpcx_options(plugin_options) is plugin_options


def test_torch_faulty_agent_options_are_rejected_with_what_to_use() -> None:
    testing = pytest.importorskip("torch.distributed.rpc._testing")
    faulty = testing.FaultyTensorPipeRpcBackendOptions(
        num_worker_threads=2, rpc_timeout=3, init_method="env://",
        messages_to_fail=[], messages_to_delay={}, num_fail_sends=0,
    )
    with pytest.raises(TypeError, match="FaultyTensorPipeRpcBackendOptions") as info:
        as_rpcx_options(faulty)
    assert "use rpcx.TensorPipeRpcBackendOptions" in str(info.value)


def test_something_else_is_a_type_error_not_an_attribute_error() -> None:
    with pytest.raises(TypeError, match=r"rpcx\.TensorPipeRpcBackendOptions.*got dict"):
        as_rpcx_options({"rpc_timeout": 5})
    with pytest.raises(TypeError, match="rpc_backend_options must be an options object"):
        rpcx.init_rpc("w", backend="loopback", rank=0, world_size=1,
                      rpc_backend_options={"rpc_timeout": 5})


@pytest.fixture
def file_init(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


@pytest.fixture
def leave() -> Iterator[None]:
    yield
    agent = _context.maybe_current_agent()
    if agent is not None and agent.is_running:
        rpcx.shutdown()


def test_init_rpc_with_torch_options_runs_with_their_settings(file_init: str,
                                                             leave: None) -> None:
    theirs = torch_rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=3, rpc_timeout=7, init_method=file_init
    )
    rpcx.init_rpc("w", backend="loopback", rank=0, world_size=1, rpc_backend_options=theirs)
    assert rpcx.get_rpc_timeout() == 7
    assert rpcx.rpc_sync("w", torch.add, args=(torch.ones(2), 1)).tolist() == [2.0, 2.0]


def test_torch_backend_type_and_options_select_rpcx_tensorpipe(file_init: str,
                                                              leave: None) -> None:
    # torch's BackendType.TENSORPIPE means rpcx's tensorpipe backend (the same engine),
    # whatever $RPCX_BACKEND says: a backend named in init_rpc wins.
    if "tensorpipe" not in rpcx.backend_names():  # pragma: no cover - torch without RPC
        pytest.skip("rpcx's tensorpipe backend is not installed")
    rpcx.init_rpc(
        "w", backend=torch_rpc.BackendType.TENSORPIPE, rank=0, world_size=1,
        rpc_backend_options=torch_rpc.TensorPipeRpcBackendOptions(
            rpc_timeout=9, init_method=file_init
        ),
    )
    assert rpcx.debug_info()["backend"] == "tensorpipe"
    assert rpcx.get_rpc_timeout() == 9
    assert rpcx.rpc_sync("w", torch.mul, args=(torch.ones(2), 3)).tolist() == [3.0, 3.0]
