"""Unit tests for rpcx.worker: WorkerInfo identity semantics and worker-name rules."""

from __future__ import annotations

import copy
import pickle

import pytest

from rpcx.errors import InvalidWorkerNameError
from rpcx.worker import MAX_NAME_LENGTH, WorkerInfo, validate_worker_name

# ----------------------------------------------------------------------------- WorkerInfo


def test_fields() -> None:
    info = WorkerInfo("trainer0", 3)
    assert info.name == "trainer0"
    assert info.id == 3


def test_equality() -> None:
    assert WorkerInfo("w", 1) == WorkerInfo("w", 1)
    assert WorkerInfo("w", 1) != WorkerInfo("w", 2)
    assert WorkerInfo("w", 1) != WorkerInfo("v", 1)
    assert WorkerInfo("w", 1) != ("w", 1)
    assert WorkerInfo("w", 1) != 1


def test_hash_and_dict_key() -> None:
    assert hash(WorkerInfo("w", 1)) == hash(WorkerInfo("w", 1))
    table = {WorkerInfo("w", 1): "first", WorkerInfo("v", 2): "second"}
    assert table[WorkerInfo("w", 1)] == "first"
    assert table[WorkerInfo("v", 2)] == "second"
    assert len({WorkerInfo("w", 1), WorkerInfo("w", 1), WorkerInfo("w", 2)}) == 2


def test_ordering_by_id_then_name() -> None:
    infos = [WorkerInfo("c", 2), WorkerInfo("b", 0), WorkerInfo("z", 1), WorkerInfo("a", 1)]
    assert [(i.id, i.name) for i in sorted(infos)] == [(0, "b"), (1, "a"), (1, "z"), (2, "c")]
    assert WorkerInfo("x", 0) < WorkerInfo("a", 1)
    assert WorkerInfo("b", 5) > WorkerInfo("a", 5)


def test_ordering_against_other_types_raises_type_error() -> None:
    with pytest.raises(TypeError):
        _ = WorkerInfo("w", 1) < 1  # type: ignore[operator]


def test_immutable() -> None:
    info = WorkerInfo("w", 1)
    with pytest.raises(AttributeError):
        info.name = "v"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        info.id = 2  # type: ignore[misc]
    with pytest.raises(AttributeError):
        info._id = 2  # type: ignore[misc]
    with pytest.raises(AttributeError):
        info.extra = 1  # type: ignore[attr-defined]
    assert (info.name, info.id) == ("w", 1)


def test_constructor_coerces_types() -> None:
    info = WorkerInfo("w", True)  # type: ignore[arg-type]
    assert info.id == 1 and type(info.id) is int


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trip(protocol: int) -> None:
    info = WorkerInfo("worker:7", 7)
    copied = pickle.loads(pickle.dumps(info, protocol=protocol))
    assert copied == info
    assert type(copied) is WorkerInfo
    assert hash(copied) == hash(info)


def test_copy_round_trip() -> None:
    info = WorkerInfo("w", 4)
    assert copy.copy(info) == info
    assert copy.deepcopy(info) == info


def test_repr_matches_torch() -> None:
    assert repr(WorkerInfo("w", 1)) == "WorkerInfo(id=1, name=w)"
    assert str(WorkerInfo("ps-0", 12)) == "WorkerInfo(id=12, name=ps-0)"


# ---------------------------------------------------------------------------- worker names


@pytest.mark.parametrize(
    "name",
    ["w", "worker0", "Trainer_1", "ps-2", "job:rank:3", "0", "_", "a" * (MAX_NAME_LENGTH - 1)],
)
def test_valid_names(name: str) -> None:
    assert validate_worker_name(name) == name


def test_max_name_length_is_torchs() -> None:
    assert MAX_NAME_LENGTH == 128


@pytest.mark.parametrize("name", ["", "a" * MAX_NAME_LENGTH, "a" * 500])
def test_length_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="characters"):
        validate_worker_name(name)


@pytest.mark.parametrize(
    "name", ["has space", " w", "w\n", "tab\there", "a/b", "a.b", "naïve", "w@host", "a,b"]
)
def test_bad_characters_rejected(name: str) -> None:
    with pytest.raises(ValueError, match="may only contain"):
        validate_worker_name(name)


@pytest.mark.parametrize("name", [None, 1, b"worker", ["w"]])
def test_non_str_rejected(name: object) -> None:
    with pytest.raises(TypeError, match="str"):
        validate_worker_name(name)


# torch's test_invalid_names: WorkerInfo itself refuses an invalid name, with RuntimeError.
@pytest.mark.parametrize(
    ("name", "torch_phrase"),
    [("abc*", "Worker name must match"), (" ", "Worker name must match"),
     ("", "must be non-empty"), ("a" * 500, "shorter than 128")],
)
def test_worker_info_refuses_invalid_names_as_torch_does(name: str, torch_phrase: str) -> None:
    with pytest.raises(RuntimeError, match=torch_phrase) as raised:
        WorkerInfo(name, 0)
    assert isinstance(raised.value, InvalidWorkerNameError)
    assert isinstance(raised.value, ValueError)


def test_worker_info_accepts_the_longest_valid_name() -> None:
    name = "a" * (MAX_NAME_LENGTH - 1)
    assert WorkerInfo(name, 0).name == name
