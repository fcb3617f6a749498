"""Unit tests for rpcx._wire.codec, the codec, used directly without an agent.

Covers envelopes, small tensors travelling in the header, tensors travelling out of band
(every dtype family, odd shapes and strides, frames re-delivered as flat uint8 copies the
way the gloo transport delivers them: tests of that path send every tensor out of band,
through the ``out_of_band`` fixture), pickle memoization, autograd flags, errors, and
codec extensions.
"""

from __future__ import annotations

import pickle
import sys
import types
from typing import Any

import pytest
import torch

from rpcx._wire import reducers
from rpcx._wire.codec import (
    DecodeContext,
    EncodeContext,
    Placed,
    current_decode_context,
    current_encode_context,
    decode_envelope,
    decode_notes,
    decode_payload,
    decode_scope,
    encode,
    has_notes,
    register_extension,
)
from rpcx.errors import SerializationError
from rpcx.messages import MessageKind
from rpcx.transport import Frame

KIND = 3
RID = 42


@pytest.fixture
def out_of_band(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor travels beside the header, however small (the path large ones take)."""
    monkeypatch.setattr(reducers, "INLINE_MAX_BYTES", -1)


def round_trip(payload: Any, *, peer: int = 1) -> Any:
    frame = encode(KIND, RID, payload, EncodeContext(peer))
    return decode_payload(frame, DecodeContext(peer))


def as_gloo_delivers(frame: Frame) -> Frame:
    """The frame a byte-moving transport delivers: flat uint8 copies of every buffer."""
    return Frame(frame.header, [b.reshape(-1).view(torch.uint8).clone() for b in frame.buffers])


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor) -> None:
    assert type(got) is torch.Tensor
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.device.type == "cpu"
    assert torch.equal(got, want)


def sample_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=gen)
    return {
        "float32": torch.randn(3, 4, generator=gen),
        "float64": torch.randn(5, dtype=torch.float64, generator=gen),
        "float16": torch.randn(2, 3, generator=gen).half(),
        "bfloat16": torch.randn(7, generator=gen).bfloat16(),
        "int64": torch.arange(-10, 10),
        "int32": torch.arange(12, dtype=torch.int32).reshape(3, 4),
        "int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "uint8": torch.tensor([0, 1, 255], dtype=torch.uint8),
        "bool": torch.tensor([[True, False, True], [False, False, True]]),
        "complex64": torch.randn(4, dtype=torch.complex64, generator=gen),
        "complex128": torch.randn(2, 2, dtype=torch.complex128, generator=gen),
        "zero_dim": torch.tensor(3.5),
        "zero_dim_bool": torch.tensor(True),
        "empty": torch.empty(0),
        "empty_2d": torch.empty(0, 3, dtype=torch.int16),
        "transposed": base.t(),
        "strided": base[::2, 1::2],
        "expanded": torch.arange(3.0).expand(4, 3),
        "offset_view": base[2:],
    }


# ------------------------------------------------------------------------------ envelope


@pytest.mark.parametrize(("kind", "rid"), [(0, 0), (1, 1), (63, 2**64 - 1), (7, 123456789)])
def test_envelope_round_trip(kind: int, rid: int) -> None:
    frame = encode(kind, rid, None, EncodeContext(0))
    assert decode_envelope(frame) == (kind, rid)
    assert decode_scope(frame) == (None, 0)
    assert decode_payload(frame, DecodeContext(0)) is None


def test_scoped_envelope_round_trip() -> None:
    frame = encode(9, 42, [1, "two"], EncodeContext(0, scope=(3 << 48) | 5, scope_tag=77))
    assert decode_envelope(frame) == (9, 42)
    assert decode_scope(frame) == ((3 << 48) | 5, 77)
    assert decode_payload(frame, DecodeContext(0)) == [1, "two"]


def test_kinds_above_63_are_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        encode(64, 1, None, EncodeContext(0))


@pytest.mark.parametrize("scope", [None, 99])
def test_notes_ride_between_envelope_and_payload(scope: int | None) -> None:
    ctx = EncodeContext(0, scope=scope)
    ctx.notes.append((6, [((1, 2), (3, 4), 0)]))
    frame = encode(3, 17, {"payload": torch.arange(3)}, ctx)
    assert has_notes(frame) and decode_envelope(frame) == (3, 17)
    assert decode_scope(frame) == (scope, 0)
    assert decode_notes(frame) == [(6, [((1, 2), (3, 4), 0)])]
    out = decode_payload(frame, DecodeContext(0))
    assert torch.equal(out["payload"], torch.arange(3))
    plain = encode(3, 17, None, EncodeContext(0))
    assert not has_notes(plain) and decode_notes(plain) == []


def test_envelope_reads_without_unpickling() -> None:
    frame = encode(KIND, RID, object(), EncodeContext(0))
    broken = Frame(frame.header[:9] + b"not a pickle", frame.buffers)
    assert decode_envelope(broken) == (KIND, RID)


def test_plain_payload_round_trip() -> None:
    payload = {"args": (1, 2.5, "x", None, [True, b"bytes"]), "kwargs": {"k": {1, 2}}}
    assert round_trip(payload) == payload


@pytest.mark.usefixtures("out_of_band")
def test_encode_context_records_peer_and_frame_uses_its_buffers() -> None:
    ctx = EncodeContext(5)
    frame = encode(KIND, RID, torch.ones(2), ctx)
    assert ctx.peer == 5
    assert frame.buffers is ctx.buffers


# ------------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("name", list(sample_tensors()))
def test_tensor_round_trip(name: str) -> None:
    tensor = sample_tensors()[name]
    assert_same_tensor(round_trip(tensor), tensor)


@pytest.mark.usefixtures("out_of_band")
@pytest.mark.parametrize("name", list(sample_tensors()))
def test_tensor_round_trip_through_flat_uint8_buffers(name: str) -> None:
    tensor = sample_tensors()[name]
    frame = encode(KIND, RID, [tensor], EncodeContext(1))
    delivered = as_gloo_delivers(frame)
    assert all(b.dtype == torch.uint8 and b.dim() == 1 for b in delivered.buffers)
    (got,) = decode_payload(delivered, DecodeContext(1))
    assert_same_tensor(got, tensor)


@pytest.mark.usefixtures("out_of_band")
def test_all_sample_tensors_in_one_message_through_uint8_buffers() -> None:
    tensors = sample_tensors()
    frame = encode(KIND, RID, tensors, EncodeContext(1))
    assert len(frame.buffers) == len(tensors)
    got = decode_payload(as_gloo_delivers(frame), DecodeContext(1))
    assert got.keys() == tensors.keys()
    for name, want in tensors.items():
        assert_same_tensor(got[name], want)


@pytest.mark.usefixtures("out_of_band")
def test_buffers_are_contiguous() -> None:
    tensors = sample_tensors()
    frame = encode(KIND, RID, list(tensors.values()), EncodeContext(0))
    assert all(b.is_contiguous() for b in frame.buffers)


def test_tensor_data_travels_as_buffers_not_in_header() -> None:
    tensor = torch.zeros(1024 * 1024, dtype=torch.uint8)  # 1 MiB
    frame = encode(KIND, RID, {"t": tensor}, EncodeContext(0))
    assert len(frame.header) < 512
    assert len(frame.buffers) == 1
    assert frame.buffers[0].numel() * frame.buffers[0].element_size() == 1024 * 1024
    assert frame.nbytes == len(frame.header) + 1024 * 1024


def test_decoded_tensor_does_not_alias_the_sender() -> None:
    tensor = torch.arange(4.0)
    frame = encode(KIND, RID, tensor, EncodeContext(0))
    got = decode_payload(as_gloo_delivers(frame), DecodeContext(0))
    got.add_(1)
    assert torch.equal(tensor, torch.arange(4.0))


# ---------------------------------------------------------- small tensors, in the header

_CONTIGUOUS_SAMPLES = [name for name, t in sample_tensors().items() if t.is_contiguous()]


@pytest.mark.parametrize("name", _CONTIGUOUS_SAMPLES)
def test_small_tensor_travels_in_the_header(name: str) -> None:
    tensor = sample_tensors()[name]
    frame = encode(KIND, RID, [tensor], EncodeContext(1))
    assert frame.buffers == []
    (got,) = decode_payload(frame, DecodeContext(1))
    assert_same_tensor(got, tensor)


def test_in_band_up_to_the_limit_then_beside_the_header() -> None:
    limit = reducers.INLINE_MAX_BYTES
    at_limit = torch.arange(limit, dtype=torch.uint8)
    past_it = torch.arange(limit + 1, dtype=torch.uint8)
    frame = encode(KIND, RID, (at_limit, past_it), EncodeContext(0))
    assert len(frame.buffers) == 1 and frame.buffers[0].numel() == limit + 1
    assert limit < len(frame.header) < limit + 512
    got = decode_payload(frame, DecodeContext(0))
    assert torch.equal(got[0], at_limit) and torch.equal(got[1], past_it)


def test_tensor_from_the_header_is_writable_and_its_own() -> None:
    sent = torch.arange(6.0).reshape(2, 3)
    frame = encode(KIND, RID, sent, EncodeContext(0))
    assert frame.buffers == []
    got = decode_payload(frame, DecodeContext(0))
    got.add_(1)  # (a read-only buffer would warn and refuse)
    assert torch.equal(sent, torch.arange(6.0).reshape(2, 3))
    assert torch.equal(got, sent + 1)
    assert got.data_ptr() % 16 == 0  # aligned for any dtype's element


def test_a_view_beside_a_tensor_in_the_header_keeps_its_strides() -> None:
    sent = torch.arange(6.0).reshape(2, 3)
    frame = encode(KIND, RID, (sent, sent.t()), EncodeContext(0))
    assert len(frame.buffers) == 1  # (the view: its span, beside the header)
    got, got_t = decode_payload(frame, DecodeContext(0))
    assert torch.equal(got, sent)
    assert torch.equal(got_t, sent.t()) and got_t.stride() == sent.t().stride()


def test_room_in_the_header_is_per_message() -> None:
    limit = reducers.INLINE_MAX_BYTES
    half = torch.zeros(limit // 2 + 1, dtype=torch.uint8)  # two do not fit together
    many = [torch.full((1024,), i, dtype=torch.uint8) for i in range(limit // 1024 + 8)]
    frame = encode(KIND, RID, (half, half.clone(), many), EncodeContext(0))
    header_bytes = len(frame.header)
    # In the header: the first half, then as many of ``many`` as the rest of the room
    # takes; beside it: the second half and the others.
    fit = (limit - half.numel()) // 1024
    assert len(frame.buffers) == 1 + len(many) - fit
    assert frame.buffers[0].numel() == half.numel()
    assert half.numel() + 1024 * fit < header_bytes < limit + 4096
    got_a, got_b, got_many = decode_payload(frame, DecodeContext(0))
    assert torch.equal(got_a, half) and torch.equal(got_b, half)
    assert all(torch.equal(g, t) for g, t in zip(got_many, many, strict=True))


def test_tensors_keep_stream_order_across_header_and_buffers() -> None:
    small_a, large, small_b = torch.ones(2), torch.zeros(1 << 16), torch.arange(3.0)
    enc = EncodeContext(0)
    frame = encode(KIND, RID, [small_a, large, small_b], enc)
    assert len(frame.buffers) == 1 and frame.buffers[0].numel() == 1 << 16
    assert [t is want for t, want in zip(enc.tensors, (small_a, large, small_b), strict=True)] \
        == [True, True, True]
    dec = DecodeContext(0)
    got = decode_payload(frame, dec)
    assert [t is g for t, g in zip(dec.tensors, got, strict=True)] == [True, True, True]


def test_tensor_without_readable_memory_goes_beside_the_header() -> None:
    zeros = torch._efficientzerotensor(3)  # zeros by definition: no memory at all
    freed = torch.arange(4.0)
    freed.untyped_storage().resize_(0)  # (as FSDP frees a parameter's storage)
    for tensor in (zeros, freed):
        assert tensor.data_ptr() == 0 and tensor.nbytes > 0
        frame = encode(KIND, RID, tensor, EncodeContext(0))  # (read at 0: a crash)
        assert len(frame.buffers) == 1 and frame.buffers[0].data_ptr() == 0


@pytest.mark.parametrize("requires_grad", [True, False])
def test_small_parameter_and_grad_flags_travel_in_the_header(requires_grad: bool) -> None:
    param = torch.nn.Parameter(torch.randn(2, 2), requires_grad=requires_grad)
    leaf = torch.randn(3, requires_grad=True)
    frame = encode(KIND, RID, (param, leaf * 2), EncodeContext(0))
    assert frame.buffers == []
    got_param, got_leaf = decode_payload(frame, DecodeContext(0))
    assert type(got_param) is torch.nn.Parameter
    assert got_param.requires_grad is requires_grad
    assert torch.equal(got_param.detach(), param.detach())
    assert got_leaf.requires_grad and got_leaf.is_leaf
    got_leaf.sum().backward()
    assert torch.equal(got_leaf.grad, torch.ones(3))


def test_small_conjugated_and_negated_views_are_materialized_in_the_header() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    lazy_conj, lazy_neg = z.conj(), torch._neg_view(z)
    assert lazy_conj.is_conj() and lazy_neg.is_neg()
    frame = encode(KIND, RID, (lazy_conj, lazy_neg), EncodeContext(0))
    assert frame.buffers == []
    got_conj, got_neg = decode_payload(frame, DecodeContext(0))
    assert torch.equal(got_conj, z.conj().resolve_conj())
    assert torch.equal(got_neg, -z)


def _forged_inline(data: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    class Forged:
        def __reduce__(self) -> Any:
            return (reducers._rebuild_inline, (data, dtype, shape, False, False))

    return Forged()


@pytest.mark.parametrize(("data", "dtype", "shape", "match"), [
    (bytes(8), "torch.float32", (2,), "not a bytearray"),
    (bytearray(7), "torch.float32", (2,), "7 bytes"),
    (bytearray(8), "torch.float32", (3,), "8 bytes"),
    (bytearray(), "torch.float32", (10**9,), "0 bytes"),  # (no allocation on its word)
    (bytearray(8), "torch.float32", (-1,), "shape"),
    (bytearray(8), "torch.float32", [2], "shape"),
    (bytearray(4), "torch.qint8", (4,), "qint8"),  # (no quantizer: reading it crashes)
    (bytearray(4), "torch.nonsense", (4,), "nonsense"),
])
@pytest.mark.parametrize("kind", [KIND, int(MessageKind.AUTOGRAD_CHAIN)])
def test_malformed_tensor_in_the_header_is_refused(
    data: Any, dtype: str, shape: Any, match: str, kind: int
) -> None:
    # (AUTOGRAD_CHAIN: a bookkeeping kind, read by the unpickler that allows only plain
    # data and the codec's own rebuild functions)
    frame = encode(kind, RID, [_forged_inline(data, dtype, shape)], EncodeContext(0))
    with pytest.raises(SerializationError, match=match):
        decode_payload(frame, DecodeContext(0))


def test_same_small_tensor_twice_is_one_object() -> None:
    tensor = torch.arange(6.0)
    frame = encode(KIND, RID, [tensor, {"again": tensor}], EncodeContext(0))
    first, inner = decode_payload(frame, DecodeContext(0))
    assert first is inner["again"]
    assert torch.equal(first, tensor)


@pytest.mark.usefixtures("out_of_band")
def test_same_tensor_twice_is_one_buffer_and_one_object() -> None:
    tensor = torch.arange(6.0)
    frame = encode(KIND, RID, [tensor, {"again": tensor}], EncodeContext(0))
    assert len(frame.buffers) == 1
    first, inner = decode_payload(as_gloo_delivers(frame), DecodeContext(0))
    assert first is inner["again"]
    assert torch.equal(first, tensor)


@pytest.mark.usefixtures("out_of_band")
def test_distinct_equal_tensors_stay_distinct() -> None:
    a, b = torch.ones(3), torch.ones(3)
    frame = encode(KIND, RID, (a, b), EncodeContext(0))
    assert len(frame.buffers) == 2
    got_a, got_b = decode_payload(frame, DecodeContext(0))
    assert got_a is not got_b


def test_requires_grad_preserved() -> None:
    leaf = torch.randn(3, requires_grad=True)
    non_leaf = leaf * 2
    plain = torch.randn(3)
    got_leaf, got_non_leaf, got_plain = round_trip((leaf, non_leaf, plain))
    assert got_leaf.requires_grad and got_leaf.is_leaf
    assert got_non_leaf.requires_grad and got_non_leaf.is_leaf  # history does not travel
    assert not got_plain.requires_grad
    assert torch.equal(got_leaf.detach(), leaf.detach())
    assert torch.equal(got_non_leaf.detach(), non_leaf.detach())


@pytest.mark.usefixtures("out_of_band")
def test_requires_grad_preserved_through_uint8_buffers() -> None:
    leaf = torch.randn(2, 3, requires_grad=True)
    frame = encode(KIND, RID, leaf, EncodeContext(0))
    got = decode_payload(as_gloo_delivers(frame), DecodeContext(0))
    assert got.requires_grad
    got.sum().backward()
    assert torch.equal(got.grad, torch.ones(2, 3))


@pytest.mark.parametrize("requires_grad", [True, False])
def test_parameter_preserved(requires_grad: bool) -> None:
    param = torch.nn.Parameter(torch.randn(2, 2), requires_grad=requires_grad)
    frame = encode(KIND, RID, {"p": param}, EncodeContext(0))
    got = decode_payload(as_gloo_delivers(frame), DecodeContext(0))["p"]
    assert type(got) is torch.nn.Parameter
    assert got.requires_grad is requires_grad
    assert torch.equal(got.detach(), param.detach())


def test_module_state_round_trip() -> None:
    module = torch.nn.Linear(3, 2)
    got = round_trip(module)
    assert isinstance(got, torch.nn.Linear)
    assert type(got.weight) is torch.nn.Parameter
    assert torch.equal(got.weight.detach(), module.weight.detach())
    assert torch.equal(got.bias.detach(), module.bias.detach())


def test_contexts_list_tensors_in_buffer_order() -> None:
    a, b = torch.ones(2), torch.zeros(3, dtype=torch.int32)
    enc = EncodeContext(0)
    frame = encode(KIND, RID, {"first": a, "second": b, "again": a}, enc)
    assert len(enc.tensors) == 2
    assert enc.tensors[0] is a and enc.tensors[1] is b
    dec = DecodeContext(0)
    got = decode_payload(frame, dec)
    assert len(dec.tensors) == 2
    assert dec.tensors[0] is got["first"] and dec.tensors[1] is got["second"]
    assert dec.buffers is frame.buffers


def test_non_cpu_tensor_without_a_map_refused_naming_the_device_and_the_fix() -> None:
    tensor = torch.empty(2, device="meta")
    with pytest.raises(SerializationError, match="meta") as info:
        encode(KIND, RID, [tensor], EncodeContext(0))
    assert "set_device_map" in str(info.value)


def test_unmapped_device_error_comes_from_the_routes() -> None:
    from rpcx._wire.devices import WorkerDevices, plan_routes

    routes = plan_routes(0, [WorkerDevices("a", 0), WorkerDevices("b", 0)])
    tensor = torch.empty(2, device="meta")
    ctx = EncodeContext(1, routes=routes, response=True)
    with pytest.raises(SerializationError, match="a response from worker 'a' to 'b'"):
        encode(KIND, RID, {"x": [tensor]}, ctx)


def test_placed_tensor_on_cpu_round_trips_unchanged() -> None:
    from rpcx._wire.codec import Placed

    tensor = torch.arange(4.0)
    ctx = EncodeContext(0)
    frame = encode(KIND, RID, [Placed(tensor, torch.device("cpu"))], ctx)
    assert ctx.placements == {}  # CPU tensors stay on the CPU whatever is asked
    (got,) = decode_payload(frame, DecodeContext(0))
    assert torch.equal(got, tensor)


@pytest.mark.usefixtures("out_of_band")
def test_sparse_tensor_round_trip_out_of_band() -> None:
    dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    sparse = dense.to_sparse()
    frame = encode(KIND, RID, sparse, EncodeContext(0))
    assert len(frame.buffers) == 2  # indices and values, beside the header
    got = decode_payload(as_gloo_delivers(frame), DecodeContext(0))
    assert got.layout is torch.sparse_coo and got.is_coalesced()
    assert torch.equal(got.to_dense(), dense)


@pytest.mark.parametrize("coalesced", [False, True])
def test_sparse_tensor_keeps_requires_grad_and_coalescing(coalesced: bool) -> None:
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0, 1, 1], [2, 0, 2]]), torch.tensor([3.2, 4.1, 5.3]), (3, 3),
        requires_grad=True, check_invariants=True,
    )
    if coalesced:
        sparse = sparse.detach().coalesce().requires_grad_()
    before = len(torch._utils._sparse_tensors_to_validate)
    got = decode_payload(as_gloo_delivers(encode(KIND, RID, sparse, EncodeContext(0))),
                         DecodeContext(0))
    assert got.requires_grad and got.is_leaf and got.is_coalesced() == coalesced
    assert torch.equal(got.detach().to_dense(), sparse.detach().to_dense())
    # torch's own unpickling parks every sparse tensor in a module-level list that only
    # torch.load empties: rpcx's must not.
    assert len(torch._utils._sparse_tensors_to_validate) == before


@pytest.mark.usefixtures("out_of_band")
# The test builds the tensors itself, and torch says once per process that they are beta.
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("layout", ["csr", "csc", "bsr", "bsc"])
def test_compressed_sparse_layouts_round_trip(layout: str) -> None:
    dense = torch.tensor([[1.0, 0.0, 0.0, 2.0], [0.0, 0.0, 3.0, 0.0],
                          [0.0, 4.0, 0.0, 0.0], [5.0, 0.0, 0.0, 6.0]])
    sparse = {
        "csr": dense.to_sparse_csr, "csc": dense.to_sparse_csc,
        "bsr": lambda: dense.to_sparse_bsr((2, 2)), "bsc": lambda: dense.to_sparse_bsc((2, 2)),
    }[layout]()
    frame = encode(KIND, RID, sparse, EncodeContext(0))
    assert len(frame.buffers) == 3
    got = decode_payload(as_gloo_delivers(frame), DecodeContext(0))
    assert got.layout is sparse.layout and torch.equal(got.to_dense(), dense)


@pytest.mark.usefixtures("out_of_band")
def test_malformed_sparse_tensor_is_refused() -> None:
    sparse = torch.tensor([[0.0, 1.0], [2.0, 0.0]]).to_sparse()
    frame = as_gloo_delivers(encode(KIND, RID, sparse, EncodeContext(0)))
    indices = frame.buffers[0].view(torch.int64)
    indices[0] = 7  # a row index out of bounds: would read past the values later
    with pytest.raises(SerializationError, match=r"out of bounds|size"):
        decode_payload(frame, DecodeContext(0))


@pytest.mark.usefixtures("out_of_band")
@pytest.mark.parametrize("name", ["transposed", "strided", "expanded", "offset_view"])
def test_views_keep_their_strides_and_travel_as_their_span(name: str) -> None:
    tensor = sample_tensors()[name]
    frame = encode(KIND, RID, tensor, EncodeContext(0))
    (buffer,) = frame.buffers
    span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    assert buffer.is_contiguous() and buffer.numel() == span
    assert buffer.data_ptr() == tensor.data_ptr()  # no copy on the sending side
    got = decode_payload(as_gloo_delivers(frame), DecodeContext(0))
    assert_same_tensor(got, tensor)
    assert got.stride() == tensor.stride()


@pytest.mark.usefixtures("out_of_band")
def test_small_view_of_a_large_storage_travels_as_a_copy() -> None:
    column = torch.arange(1 << 16, dtype=torch.float32).reshape(256, 256)[:, 5]
    frame = encode(KIND, RID, column, EncodeContext(0))
    assert frame.buffers[0].numel() == 256  # not the 255 rows it spans
    got = decode_payload(as_gloo_delivers(frame), DecodeContext(0))
    assert_same_tensor(got, column)
    assert got.is_contiguous()


@pytest.mark.usefixtures("out_of_band")
def test_contiguous_tensor_is_its_own_buffer() -> None:
    tensor = torch.arange(12.0).reshape(3, 4)[1:]
    frame = encode(KIND, RID, tensor, EncodeContext(0))
    assert frame.buffers[0] is not None and frame.buffers[0].data_ptr() == tensor.data_ptr()
    assert frame.buffers[0].shape == tensor.shape  # no span, no copy: the common path


@pytest.mark.usefixtures("out_of_band")
def test_view_reaching_past_its_buffer_is_refused() -> None:
    view = torch.arange(20.0).reshape(4, 5).t()
    frame = as_gloo_delivers(encode(KIND, RID, view, EncodeContext(0)))
    short = Frame(frame.header, [frame.buffers[0][:-4]])
    with pytest.raises(SerializationError, match="past its buffer"):
        decode_payload(short, DecodeContext(0))


# -------------------------------------------------------------------------------- errors


def test_unpicklable_payload_raises_serialization_error() -> None:
    with pytest.raises(SerializationError) as info:
        encode(KIND, RID, {"f": lambda: None}, EncodeContext(0))
    assert isinstance(info.value, RuntimeError)
    assert info.value.__cause__ is not None


def test_unpicklable_lock_raises_serialization_error() -> None:
    import threading

    with pytest.raises(SerializationError, match="lock"):
        encode(KIND, RID, threading.Lock(), EncodeContext(0))


def test_encode_failure_leaves_no_context_behind() -> None:
    with pytest.raises(SerializationError):
        encode(KIND, RID, [torch.ones(1), lambda: None], EncodeContext(0))
    with pytest.raises(SerializationError):
        current_encode_context()


def test_missing_module_raises_serialization_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = "rpcx_test_vanishing_module"
    module = types.ModuleType(name)

    class Vanishing:
        pass

    Vanishing.__module__ = name
    Vanishing.__qualname__ = "Vanishing"
    module.Vanishing = Vanishing  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, module)
    frame = encode(KIND, RID, {"obj": Vanishing()}, EncodeContext(0))
    monkeypatch.delitem(sys.modules, name)
    with pytest.raises(SerializationError, match=name):
        decode_payload(frame, DecodeContext(0))
    with pytest.raises(SerializationError):
        current_decode_context()


def test_corrupt_header_raises_serialization_error() -> None:
    frame = encode(KIND, RID, [1, 2, 3], EncodeContext(0))
    with pytest.raises(SerializationError):
        decode_payload(Frame(frame.header[:-3], frame.buffers), DecodeContext(0))


def test_contexts_outside_codec_raise() -> None:
    with pytest.raises(SerializationError, match="pickled"):
        current_encode_context()
    with pytest.raises(SerializationError, match="unpickled"):
        current_decode_context()


def test_plain_pickle_of_a_tensor_is_unaffected() -> None:
    tensor = torch.arange(3)
    assert torch.equal(pickle.loads(pickle.dumps(tensor)), tensor)


# ---------------------------------------------------------------------------- extensions


class Handle:
    """A custom class with a codec extension: it travels as (name, tensor, peer)."""

    def __init__(self, name: str, data: torch.Tensor, peer: int = -1, agent: Any = None):
        self.name = name
        self.data = data
        self.peer = peer
        self.agent = agent


def reduce_handle(obj: Handle, ctx: EncodeContext) -> Any:
    return rebuild_handle, (obj.name, obj.data, ctx.peer)


def rebuild_handle(name: str, data: torch.Tensor, sender_saw_peer: int) -> Handle:
    ctx = current_decode_context()
    return Handle(name, data, peer=ctx.peer * 1000 + sender_saw_peer, agent=ctx.agent)


register_extension(Handle, reduce_handle)


def test_extension_round_trip_uses_both_contexts() -> None:
    data = torch.arange(5.0)
    agent = object()
    enc = EncodeContext(peer=2)
    frame = encode(KIND, RID, {"h": Handle("x", data)}, enc)
    assert len(enc.tensors) == 1 and enc.tensors[0] is data
    dec = DecodeContext(peer=7, agent=agent)
    got = decode_payload(as_gloo_delivers(frame), dec)["h"]
    assert type(got) is Handle
    assert got.name == "x"
    assert torch.equal(got.data, data)
    assert got.peer == 7 * 1000 + 2
    assert got.agent is agent
    assert dec.tensors[0] is got.data


def test_extension_registration_is_idempotent_for_the_same_reduce() -> None:
    register_extension(Handle, reduce_handle)  # same function again: allowed
    assert round_trip(Handle("y", torch.ones(1))).name == "y"


def test_extension_cannot_be_replaced() -> None:
    def other(obj: Handle, ctx: EncodeContext) -> Any:
        return rebuild_handle, (obj.name, obj.data, 0)

    with pytest.raises(ValueError, match="Handle"):
        register_extension(Handle, other)
    assert round_trip(Handle("z", torch.ones(1)), peer=3).peer == 3 * 1000 + 3


def test_rebuild_function_outside_decode_raises() -> None:
    with pytest.raises(SerializationError):
        rebuild_handle("x", torch.ones(1), 0)


@pytest.mark.usefixtures("out_of_band")
def test_conjugate_view_round_trip_through_uint8_buffers() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    lazy = z.conj()
    assert lazy.is_conj()
    frame = encode(KIND, RID, lazy, EncodeContext(0))
    got = decode_payload(as_gloo_delivers(frame), DecodeContext(0))
    assert_same_tensor(got.resolve_conj(), lazy.resolve_conj())


@pytest.mark.usefixtures("out_of_band")
def test_frame_marks_the_buffers_the_codec_copied_as_owned() -> None:
    plain = torch.arange(8.0)
    strided_small = torch.arange(16.0).reshape(4, 4).t()  # travels as its storage span
    strided_wide = torch.zeros(4096, 64)[:, 0]  # span too wide: a contiguous copy
    conjugated = torch.tensor([1 + 2j, 3 - 1j]).conj()  # materialized while encoding
    frame = encode(
        KIND, RID, (plain, strided_small, strided_wide, conjugated), EncodeContext(peer=1)
    )
    assert frame.owned == frozenset({2, 3})
    assert frame.buffers[0].data_ptr() == plain.data_ptr()  # shared: transports copy it
    out = decode_payload(frame, DecodeContext(peer=0))
    assert torch.equal(out[2], strided_wide) and torch.equal(out[3], conjugated)


def test_bookkeeping_payloads_are_read_as_plain_data_and_tensors_only() -> None:
    import os
    import uuid

    from rpcx.messages import CONTROL_KINDS
    from rpcx.testing.remote import SetsEnvironmentWhenUnpickled

    marker = f"RPCX_TEST_{uuid.uuid4().hex}"
    # (A gradient bound for a device travels as a Placed: on GPUs, every backward hop.)
    placed = Placed(torch.full((3,), 2.0), torch.device("cpu"))
    grads = (7, [(1, 0, torch.arange(4.0)), (2, 1, torch.ones(2, 3).t()), (3, 0, placed)])
    for kind in sorted(CONTROL_KINDS):
        frame = encode(kind, 0, grads, EncodeContext(1))
        context_id, entries = decode_payload(frame, DecodeContext(0))
        assert context_id == 7 and torch.equal(entries[1][2], torch.ones(2, 3).t())
        assert torch.equal(entries[2][2], placed.tensor)
        hostile = encode(kind, 0, (7, SetsEnvironmentWhenUnpickled(marker)), EncodeContext(1))
        with pytest.raises(SerializationError, match="plain data and tensors only"):
            decode_payload(hostile, DecodeContext(0))
        # The recovery read keeps the frame and puts an inert stand-in where the
        # refused object was; it still runs nothing the stream names.
        context_id, stand_in = decode_payload(hostile, DecodeContext(0), lenient=True)
        assert context_id == 7 and type(stand_in).__name__ == "_Missing"
    assert marker not in os.environ
    # A call's payload is no bookkeeping: it may name any function.
    call = encode(MessageKind.CALL, 1, (torch.add, (1, 2), {}), EncodeContext(1))
    assert decode_payload(call, DecodeContext(0))[0] is torch.add
