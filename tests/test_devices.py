"""Device maps across a world: validation, routes, inversion, and the init-time exchange.

CPU-only: declarations carry device counts as data, so maps that name GPUs are checked
without one. The tensors themselves move in tests/test_cuda.py (skipped without a GPU).
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any

import pytest
import torch

import rpcx
from rpcx._wire.codec import DecodeContext, EncodeContext, decode_payload, encode
from rpcx._wire.devices import SAME_DEVICE, WorkerDevices, plan_dynamic_routes, plan_routes
from rpcx.testing.world import start_world, world

CPU = torch.device("cpu")
CUDA0, CUDA1, CUDA2 = (torch.device("cuda", i) for i in range(3))


def declare(name: str, count: int = 2, **maps: dict[object, object]) -> WorkerDevices:
    from rpcx.options import normalize_device_map

    return WorkerDevices(name, count, {to: normalize_device_map(m) for to, m in maps.items()})


def test_requests_use_own_map_and_responses_the_callers_inverse() -> None:
    a = declare("a", b={0: 1, 1: 0})
    b = declare("b")
    c = declare("c", a={"cuda:1": "cuda:0"})
    routes_a = plan_routes(0, [a, b, c])
    routes_b = plan_routes(1, [a, b, c])
    assert routes_a.for_request(1) == {CUDA0: CUDA1, CUDA1: CUDA0}
    assert routes_a.for_request(2) is None  # a has no map to c
    assert routes_a.for_response(2) == {CUDA0: CUDA1}  # c's map to a, inverted
    assert routes_b.for_response(0) == {CUDA1: CUDA0, CUDA0: CUDA1}
    assert routes_b.for_request(0) is None  # b set nothing: its own calls carry no GPU data


def test_calls_to_oneself_keep_devices_unless_mapped() -> None:
    routes = plan_routes(0, [declare("a"), declare("b")])
    assert routes.for_request(0) is SAME_DEVICE
    assert SAME_DEVICE.get(CUDA1) == CUDA1
    mapped = plan_routes(0, [declare("a", a={0: 1}), declare("b")])
    assert mapped.for_request(0) == {CUDA0: CUDA1}
    assert mapped.for_response(0) == {CUDA1: CUDA0}


def test_devices_default_to_those_the_maps_name() -> None:
    a = declare("a", 3, b={2: 0})
    b = declare("b", 3, a={1: 2})
    routes = plan_routes(0, [a, b])
    assert routes.devices == [CUDA2]  # outgoing from cuda:2, incoming to cuda:2
    assert plan_routes(1, [a, b]).devices == [CUDA0, CUDA1]
    explicit = WorkerDevices("a", 3, a.device_maps, [CUDA2, CUDA0])  # kept as given
    assert plan_routes(0, [explicit, b]).devices == [CUDA2, CUDA0]


@pytest.mark.parametrize(
    ("workers", "message"),
    [
        ([declare("a", nobody={0: 0}), declare("b")], "not a worker of this world"),
        ([declare("a", b={0: 5}), declare("b")], "'b' has 2 CUDA device"),
        ([declare("a", 1, b={3: 0}), declare("b")], "'a' has 1 CUDA device"),
        ([WorkerDevices("a", 2, {"b": {CUDA0: CUDA1, CUDA1: CUDA1}}), declare("b")],
         "one-to-one"),
        ([WorkerDevices("a", 2, {}, [torch.device("cuda:4")]), declare("b")],
         "'a' has 2 CUDA device"),
        ([WorkerDevices("a", 2, {"b": {torch.device("meta"): CUDA0}}), declare("b")],
         "CPU and CUDA devices only"),
        ([WorkerDevices("a", 2, {"b": {CUDA1: CUDA0}}, [CUDA0]), declare("b")],
         r"'a': its device map to 'b' uses cuda:1, which is not in its devices"),
        ([declare("a", b={0: 1}), WorkerDevices("b", 2, {}, [CUDA0])],
         r"'b': 'a''s device map to it uses cuda:1"),
    ],
)
def test_invalid_declarations_raise_naming_worker_and_entry(
    workers: list[WorkerDevices], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan_routes(0, workers)


def test_a_dynamic_world_routes_newcomers_as_they_join() -> None:
    # lead (rank 0) maps to "late" before late exists; mid (rank 2) joins first, with a
    # map to lead; late joins at rank 1 with a map to mid.
    lead = declare("lead", late={0: 1})
    mid = declare("mid", lead={1: 0})
    late = declare("late", mid={0: 0})
    routes = plan_dynamic_routes(0, {0: lead}, 1)  # the first worker, alone
    assert routes.for_request(1) is None and routes.devices == []  # (none used yet)
    routes.admit(2, mid)
    assert routes.names == ["lead", "<rank 1: vacant>", "mid"]
    assert routes.for_response(2) == {CUDA0: CUDA1}  # mid's map to lead, inverted
    assert routes.devices == [CUDA0]
    routes.admit(1, late)
    assert routes.names == ["lead", "late", "mid"]
    assert routes.for_request(1) == {CUDA0: CUDA1}  # lead's map, waiting since the start
    assert routes.devices == [CUDA0]
    # late's own view, planned as it joins
    joined = plan_dynamic_routes(1, {0: lead, 1: late, 2: mid}, 3)
    assert joined.for_request(2) == {CUDA0: CUDA0}
    assert joined.for_response(0) == {CUDA1: CUDA0}
    # a rank taken again: the new holder's maps replace the old one's
    routes.admit(2, declare("again", lead={0: 0}))
    assert routes.names[2] == "again" and routes.for_response(2) == {CUDA0: CUDA0}


@pytest.mark.parametrize(("newcomer", "message"), [
    (declare("late", 1, lead={0: 3}), "'lead' has 2 CUDA device"),
    (declare("late", 1, lead={2: 0}), "'late' has 1 CUDA device"),
    (declare("late", 0), "'late' has 0 CUDA device"),  # (lead's map to late names cuda:0)
])
def test_a_newcomer_whose_maps_do_not_fit_is_refused_naming_the_entry(
        newcomer: WorkerDevices, message: str) -> None:
    routes = plan_dynamic_routes(0, {0: declare("lead", late={1: 0})}, 1)
    with pytest.raises(ValueError, match=message):
        routes.admit(1, newcomer)
    assert routes.for_request(1) is None and len(routes.names) == 1  # nothing taken


def test_a_newcomer_refused_after_its_routes_were_taken_leaves_none_behind() -> None:
    routes = plan_dynamic_routes(0, {0: declare("lead", late={0: 1})}, 1)
    undo = routes.admit(1, declare("late", lead={1: 0}))
    assert routes.for_request(1) == {CUDA0: CUDA1} and routes.names == ["lead", "late"]
    undo()  # (the roster refused it: its name was taken)
    assert routes.for_request(1) is None and routes.for_response(1) is None
    assert routes.names == ["lead"] and routes.devices == []


def test_a_map_to_a_worker_not_there_yet_still_checks_its_own_devices() -> None:
    with pytest.raises(ValueError, match="'lead' has 2 CUDA device"):
        plan_dynamic_routes(0, {0: declare("lead", later={7: 0})}, 1)


def test_declarations_travel_as_plain_data() -> None:
    original = WorkerDevices("a", 2, {"b": {CUDA0: CUDA1}}, [CUDA0])
    data = original.to_bytes()
    assert json.loads(data)["device_maps"] == {"b": {"cuda:0": "cuda:1"}}
    assert WorkerDevices.from_bytes(data) == original


class _RunsCode:
    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, ("import os; os.environ['RPCX_TEST_PICKLE_RAN'] = 'yes'",))


@pytest.mark.parametrize("data", [
    pickle.dumps(("a", 0, {}, [])),  # the old format
    pickle.dumps(_RunsCode()),  # a value written by a stray store client
    b"not json", b"[]", b'{"name": "a"}',
    b'{"name": 1, "device_count": 0, "device_maps": {}, "devices": []}',
    b'{"name": "a", "device_count": -1, "device_maps": {}, "devices": []}',
    b'{"name": "a", "device_count": 0, "device_maps": {"b": ["x"]}, "devices": []}',
    b'{"name": "a", "device_count": 0, "device_maps": {}, "devices": ["warp:9"]}',
])
def test_anything_else_in_the_store_is_refused_and_never_run(data: bytes) -> None:
    os.environ.pop("RPCX_TEST_PICKLE_RAN", None)
    with pytest.raises(ValueError, match="not a device declaration"):
        WorkerDevices.from_bytes(data)
    assert "RPCX_TEST_PICKLE_RAN" not in os.environ


def test_missing_entry_messages_say_which_map_to_set() -> None:
    routes = plan_routes(0, [declare("a"), declare("b")])
    request = routes.explain_missing(1, CUDA0, response=False)
    assert "set_device_map('b'" in request and "'a'" in request and "cuda:0" in request
    response = routes.explain_missing(1, CUDA1, response=True)
    assert "set_device_map('a'" in response and "inverse" in response


def test_codec_records_the_mapped_device_and_refuses_unmapped_ones() -> None:
    # meta tensors stand in for GPU tensors: the codec decides placement before any copy.
    routes = plan_routes(0, [declare("a", b={0: 1}), declare("b")])
    assert routes.target(1, CUDA0, response=False) == CUDA1
    assert routes.target(1, CUDA1, response=False) is None
    ctx = EncodeContext(1, routes=routes, stage_devices=False)
    with pytest.raises(rpcx.SerializationError, match=r"set_device_map\('b'"):
        encode(3, 1, torch.empty(2, device="meta"), ctx)


def test_cpu_tensors_ignore_maps() -> None:
    routes = plan_routes(0, [declare("a", b={"cpu": 0}), declare("b")])
    ctx = EncodeContext(1, routes=routes)
    frame = encode(3, 1, torch.ones(3), ctx)
    got = decode_payload(frame, DecodeContext(1))
    assert got.device == CPU and torch.equal(got, torch.ones(3))


def test_init_rpc_rejects_a_map_to_a_device_the_peer_lacks(rpcx_backend: str) -> None:
    # Every worker checks every declaration with the same data, so all fail the same way
    # at init_rpc instead of at the first call. (This machine may have no GPU at all.)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    bad = {"worker1": {count: 0}}  # one past this machine's last device
    expected = rf"'worker0': device map to 'worker1' names cuda:{count}"
    with pytest.raises(ValueError, match=expected):
        start_world(rpcx_backend, size=2, device_maps=bad, rpc_timeout=30).close()


def test_worlds_with_cpu_only_maps_run_normally(rpcx_backend: str) -> None:
    # A map naming only the CPU is valid everywhere, and CPU tensors stay on the CPU.
    with world(rpcx_backend, size=2, device_maps={"worker1": {"cpu": "cpu"}}):
        got = rpcx.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))
        assert got.device == CPU and torch.equal(got, torch.full((2,), 2.0))


def test_a_crafted_store_value_fails_init_rpc_and_runs_nothing(tmp_path: Any) -> None:
    # A store client posing as rank 1 writes a pickle that would run code as rank 1's
    # device declaration: rank 0's init_rpc refuses it, naming the rank, before any
    # transport exists.
    import threading

    from rpcx._world import rendezvous

    init_method = f"file://{tmp_path / 'rendezvous'}"
    posed: list[BaseException] = []

    def intruder() -> None:
        try:
            store = rendezvous.open_store(init_method, 1, 2, 30.0)
            session, _ = rendezvous.join_world(store, "intruder", 1, 2, 30.0)
            session.set("devices/1", pickle.dumps(_RunsCode()))
        except BaseException as exc:
            posed.append(exc)

    os.environ.pop("RPCX_TEST_PICKLE_RAN", None)
    thread = threading.Thread(target=intruder, daemon=True)
    thread.start()
    options = rpcx.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=30)
    with pytest.raises(rpcx.RpcError, match="invalid device declaration for rank 1"):
        rpcx.init_rpc("w0", rank=0, world_size=2, backend="gloo", rpc_backend_options=options)
    thread.join(30)
    assert not posed, posed
    assert "RPCX_TEST_PICKLE_RAN" not in os.environ
