"""Unit tests for rpcx.options: defaults, mutability, validation and device maps.

CPU-only: ``torch.device("cuda:1")`` objects can be created without a GPU, and nothing
here initializes RPC (torch's own options are only constructed to read their fields).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.rpc as torch_rpc

from rpcx.options import (
    DEFAULT_INIT_METHOD,
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    invert_device_map,
    normalize_device,
    normalize_device_map,
)

CUDA0 = torch.device("cuda:0")
CUDA1 = torch.device("cuda:1")
CUDA2 = torch.device("cuda:2")
CPU = torch.device("cpu")


# ------------------------------------------------------------------------------ defaults


def test_defaults_match_torch_tensorpipe_options() -> None:
    theirs = torch_rpc.TensorPipeRpcBackendOptions()
    ours = TensorPipeRpcBackendOptions()
    assert ours.rpc_timeout == theirs.rpc_timeout
    assert ours.init_method == theirs.init_method
    assert ours.num_worker_threads == theirs.num_worker_threads
    assert ours.device_maps == {} == dict(theirs.device_maps)
    assert ours.devices == [] == list(theirs.devices)


def test_module_constants_match_base_defaults() -> None:
    opts = RpcBackendOptions()
    assert opts.rpc_timeout == DEFAULT_RPC_TIMEOUT_SEC
    assert opts.init_method == DEFAULT_INIT_METHOD
    assert opts.num_worker_threads == DEFAULT_NUM_WORKER_THREADS
    assert isinstance(opts.rpc_timeout, float)


def test_constructor_coerces_numeric_fields() -> None:
    opts = RpcBackendOptions(rpc_timeout=5, num_worker_threads=3.0)  # type: ignore[arg-type]
    assert opts.rpc_timeout == 5.0 and isinstance(opts.rpc_timeout, float)
    assert opts.num_worker_threads == 3 and isinstance(opts.num_worker_threads, int)


def test_tensorpipe_options_are_keyword_only_like_torch() -> None:
    with pytest.raises(TypeError):
        TensorPipeRpcBackendOptions(8)  # type: ignore[misc]
    opts = TensorPipeRpcBackendOptions(
        num_worker_threads=8, rpc_timeout=2.5, init_method="tcp://127.0.0.1:1"
    )
    assert (opts.num_worker_threads, opts.rpc_timeout, opts.init_method) == (
        8,
        2.5,
        "tcp://127.0.0.1:1",
    )


def test_private_torch_arguments_are_accepted() -> None:
    opts = TensorPipeRpcBackendOptions(_transports=["uv"], _channels=["basic"])
    assert opts._transports == ["uv"]
    assert opts._channels == ["basic"]


# ---------------------------------------------------------------------------- mutability


def test_fields_are_mutable_after_construction() -> None:
    opts = TensorPipeRpcBackendOptions()
    opts.init_method = "file:///tmp/rendezvous"
    opts.rpc_timeout = 7.0
    opts.num_worker_threads = 2
    assert opts.init_method == "file:///tmp/rendezvous"
    assert opts.rpc_timeout == 7.0
    assert opts.num_worker_threads == 2
    opts.validate()


def test_repr_names_type_and_fields() -> None:
    text = repr(RpcBackendOptions(rpc_timeout=3.0, init_method="tcp://h:1"))
    assert text.startswith("RpcBackendOptions(")
    assert "rpc_timeout=3.0" in text
    assert "init_method='tcp://h:1'" in text
    assert "_transports" not in repr(TensorPipeRpcBackendOptions())


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize("url", ["env://", "tcp://127.0.0.1:29500", "file:///tmp/x"])
def test_validate_accepts_urls(url: str) -> None:
    RpcBackendOptions(init_method=url).validate()
    TensorPipeRpcBackendOptions(init_method=url).validate()


def test_validate_accepts_zero_timeout() -> None:
    RpcBackendOptions(rpc_timeout=0).validate()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("rpc_timeout", -1.0, "rpc_timeout"),
        ("num_worker_threads", 0, "num_worker_threads"),
        ("num_worker_threads", -3, "num_worker_threads"),
        ("init_method", "localhost:29500", "init_method"),
        ("init_method", "", "init_method"),
        ("init_method", None, "init_method"),
        ("max_frame_bytes", 1000, "max_frame_bytes"),
        ("max_bytes_in_flight", -1, "max_bytes_in_flight"),
    ],
)
def test_validate_rejects(field: str, value: object, match: str) -> None:
    for opts in (RpcBackendOptions(), TensorPipeRpcBackendOptions()):
        setattr(opts, field, value)
        with pytest.raises(ValueError, match=match):
            opts.validate()


def test_validate_rechecks_device_maps_edited_in_place() -> None:
    opts = TensorPipeRpcBackendOptions(device_maps={"w1": {0: 1}})
    opts.validate()
    opts.device_maps["w1"][CUDA2] = CUDA1  # bypasses set_device_map: two locals -> cuda:1
    with pytest.raises(ValueError, match="one-to-one"):
        opts.validate()


# ------------------------------------------------------------------------------ devices


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (1, CUDA1),
        (0, CUDA0),
        ("cuda:1", CUDA1),
        ("cpu", CPU),
        (torch.device("cuda", 2), CUDA2),
        (torch.device("cpu"), CPU),
    ],
)
def test_normalize_device(given: object, expected: torch.device) -> None:
    result = normalize_device(given)  # type: ignore[arg-type]
    assert isinstance(result, torch.device)
    assert result == expected


@pytest.mark.parametrize("bad", ["cuda", torch.device("cuda"), True, False, -1, "not-a-device"])
def test_normalize_device_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        normalize_device(bad)  # type: ignore[arg-type]


def test_cuda_without_index_message_suggests_an_index() -> None:
    with pytest.raises(ValueError, match="cuda:0"):
        normalize_device("cuda")


def test_normalize_device_map_normalizes_keys_and_values() -> None:
    result = normalize_device_map({0: "cuda:1", "cpu": torch.device("cpu"), "cuda:2": 0})
    assert result == {CUDA0: CUDA1, CPU: CPU, CUDA2: CUDA0}
    assert all(
        isinstance(k, torch.device) and isinstance(v, torch.device) for k, v in result.items()
    )


def test_normalize_device_map_rejects_non_mapping() -> None:
    with pytest.raises(ValueError, match="dict"):
        normalize_device_map([(0, 1)])  # type: ignore[arg-type]


def test_normalize_device_map_rejects_a_local_device_named_twice() -> None:
    with pytest.raises(ValueError, match="twice"):
        normalize_device_map({0: 1, "cuda:0": 2})


# ------------------------------------------------------------------------- device maps


def test_set_device_map_normalizes() -> None:
    opts = TensorPipeRpcBackendOptions()
    opts.set_device_map("w1", {0: "cuda:1", "cpu": "cpu"})
    assert opts.device_maps == {"w1": {CUDA0: CUDA1, CPU: CPU}}


def test_set_device_map_is_incremental() -> None:
    opts = TensorPipeRpcBackendOptions()
    opts.set_device_map("w1", {0: 1})
    opts.set_device_map("w1", {1: 2})
    opts.set_device_map("w1", {0: 1})  # repeating an identical entry is fine
    opts.set_device_map("w2", {0: 0})
    assert opts.device_maps == {"w1": {CUDA0: CUDA1, CUDA1: CUDA2}, "w2": {CUDA0: CUDA0}}


def test_set_device_map_conflicting_entry_raises_and_keeps_old_map() -> None:
    opts = TensorPipeRpcBackendOptions()
    opts.set_device_map("w1", {0: 1})
    with pytest.raises(ValueError, match="already mapped"):
        opts.set_device_map("w1", {0: 2})
    assert opts.device_maps == {"w1": {CUDA0: CUDA1}}


def test_set_device_map_many_to_one_in_one_call_raises() -> None:
    opts = TensorPipeRpcBackendOptions()
    with pytest.raises(ValueError, match="one-to-one"):
        opts.set_device_map("w1", {0: 1, 2: 1})
    assert opts.device_maps == {}


def test_set_device_map_many_to_one_across_calls_raises() -> None:
    opts = TensorPipeRpcBackendOptions()
    opts.set_device_map("w1", {0: 1})
    with pytest.raises(ValueError, match="one-to-one"):
        opts.set_device_map("w1", {2: 1})
    assert opts.device_maps == {"w1": {CUDA0: CUDA1}}


def test_set_device_map_rejects_bool_and_indexless_cuda() -> None:
    opts = TensorPipeRpcBackendOptions()
    with pytest.raises(ValueError):
        opts.set_device_map("w1", {True: 1})
    with pytest.raises(ValueError):
        opts.set_device_map("w1", {0: "cuda"})
    assert opts.device_maps == {}


def test_device_maps_in_constructor() -> None:
    opts = TensorPipeRpcBackendOptions(
        device_maps={"w1": {0: 1}, "w2": {"cuda:1": torch.device("cuda:0")}}
    )
    assert opts.device_maps == {"w1": {CUDA0: CUDA1}, "w2": {CUDA1: CUDA0}}


def test_device_maps_in_constructor_are_validated() -> None:
    with pytest.raises(ValueError, match="one-to-one"):
        TensorPipeRpcBackendOptions(device_maps={"w1": {0: 1, 1: 1}})


def test_constructor_copies_the_caller_device_map() -> None:
    given = {"w1": {0: 1}}
    opts = TensorPipeRpcBackendOptions(device_maps=given)
    opts.set_device_map("w1", {2: 3})
    assert given == {"w1": {0: 1}}


def test_set_devices_normalizes() -> None:
    opts = TensorPipeRpcBackendOptions(devices=[0, "cuda:1"])
    assert opts.devices == [CUDA0, CUDA1]
    opts.set_devices(["cpu", torch.device("cuda", 2)])
    assert opts.devices == [CPU, CUDA2]


def test_set_devices_rejects_duplicates() -> None:
    opts = TensorPipeRpcBackendOptions()
    with pytest.raises(ValueError, match="duplicates"):
        opts.set_devices([0, "cuda:0"])
    with pytest.raises(ValueError, match="duplicates"):
        TensorPipeRpcBackendOptions(devices=[1, 1])


def test_invert_device_map() -> None:
    assert invert_device_map({CUDA0: CUDA1, CUDA1: CUDA2, CPU: CPU}) == {
        CUDA1: CUDA0,
        CUDA2: CUDA1,
        CPU: CPU,
    }
    assert invert_device_map({}) == {}
    forward = normalize_device_map({0: 1, 1: 0})
    assert invert_device_map(invert_device_map(forward)) == forward


def test_max_frame_bytes_defaults_to_64_gib_and_is_a_keyword_of_both_classes() -> None:
    assert RpcBackendOptions().max_frame_bytes == 64 << 30
    assert TensorPipeRpcBackendOptions(max_frame_bytes=1 << 30).max_frame_bytes == 1 << 30
    assert RpcBackendOptions(max_frame_bytes=2 << 20).max_frame_bytes == 2 << 20


def test_max_bytes_in_flight_defaults_to_1_gib_and_0_turns_it_off() -> None:
    assert RpcBackendOptions().max_bytes_in_flight == 1 << 30
    assert TensorPipeRpcBackendOptions(max_bytes_in_flight=0).max_bytes_in_flight == 0
    RpcBackendOptions(max_bytes_in_flight=0).validate()
