"""Unit tests for rpcx.errors: the error hierarchy and remote exceptions.

A remote failure is captured on the worker as a RemoteErrorInfo and rebuilt at the
caller: as the original type when it unpickles faithfully, else as RemoteException; in
both cases with the remote traceback as ``__cause__`` and a note naming worker and call.
"""

from __future__ import annotations

import pickle
import sys

import pytest

import rpcx
from rpcx import errors
from rpcx.errors import (
    AuthenticationError,
    BackendNotFoundError,
    InvalidWorkerNameError,
    PeerLostError,
    ProtocolError,
    RemoteErrorInfo,
    RemoteException,
    RemoteTraceback,
    RpcError,
    RpcNotInitializedError,
    RpcShutdownError,
    RpcTimeoutError,
    SerializationError,
    UnknownWorkerError,
)


class TwoArgError(Exception):
    """Unpickling calls ``TwoArgError(message)``, which fails: it cannot be rebuilt."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")
        self.code = code


class CustomError(ValueError):
    """A user exception that pickles fine."""


class Unpicklable(Exception):
    """Carries state pickle refuses (a lambda)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.callback = lambda: None


def remote_helper_that_fails(exc: BaseException) -> None:
    raise exc


def captured(exc: BaseException, worker: str = "worker1") -> RemoteErrorInfo:
    try:
        remote_helper_that_fails(exc)
    except BaseException as raised:
        return RemoteErrorInfo.capture(raised, worker)
    raise AssertionError("unreachable")


def notes(exc: BaseException) -> list[str]:
    return list(getattr(exc, "__notes__", []))


# ------------------------------------------------------------------------------ hierarchy


ALL_ERRORS = [
    AuthenticationError,
    RpcError,
    RpcNotInitializedError,
    RpcShutdownError,
    RpcTimeoutError,
    UnknownWorkerError,
    PeerLostError,
    ProtocolError,
    SerializationError,
    BackendNotFoundError,
    InvalidWorkerNameError,
    RemoteException,
]


@pytest.mark.parametrize("cls", ALL_ERRORS)
def test_every_rpcx_error_is_a_runtime_error(cls: type[Exception]) -> None:
    assert issubclass(cls, RpcError)
    assert issubclass(cls, RuntimeError)


def test_every_exported_error_class_is_covered() -> None:
    exported = {
        getattr(errors, name)
        for name in errors.__all__
        if isinstance(getattr(errors, name), type) and issubclass(getattr(errors, name), RpcError)
    }
    assert exported == set(ALL_ERRORS)


def test_timeout_error_is_builtin_timeout_error() -> None:
    exc = RpcTimeoutError("call timed out")
    assert isinstance(exc, RuntimeError)
    assert isinstance(exc, TimeoutError)
    with pytest.raises(TimeoutError):
        raise exc


def test_mixed_in_builtin_bases() -> None:
    assert issubclass(UnknownWorkerError, ValueError)
    assert issubclass(PeerLostError, ConnectionError)
    assert issubclass(ProtocolError, ValueError)
    assert issubclass(SerializationError, pickle.PicklingError)
    assert issubclass(BackendNotFoundError, ValueError)
    assert issubclass(InvalidWorkerNameError, ValueError)


def test_errors_are_exported_from_the_package() -> None:
    for cls in [*ALL_ERRORS, RemoteTraceback]:
        assert getattr(rpcx, cls.__name__) is cls


# ------------------------------------------------------------------------------- capture


def test_capture_describes_the_exception() -> None:
    info = captured(ValueError("bad value"), worker="w7")
    assert info.exc_type == "ValueError"
    assert info.message == "bad value"
    assert info.worker == "w7"
    assert info.pickled is not None
    assert "remote_helper_that_fails" in info.traceback
    assert "ValueError: bad value" in info.traceback


def test_capture_qualifies_non_builtin_types() -> None:
    info = captured(CustomError("x"))
    assert info.exc_type == f"{CustomError.__module__}.CustomError"


def test_capture_survives_unpicklable_exception() -> None:
    info = captured(Unpicklable("has a lambda"))
    assert info.pickled is None
    assert info.message == "has a lambda"


def test_remote_error_info_is_picklable() -> None:
    info = captured(KeyError("k"))
    assert pickle.loads(pickle.dumps(info)) == info


# ------------------------------------------------------------------------------- rebuild


@pytest.mark.parametrize(
    "exc",
    [ValueError("bad value"), KeyError("missing"), CustomError("custom"), OSError(2, "gone")],
)
def test_rebuildable_exception_keeps_type_and_message(exc: BaseException) -> None:
    info = captured(exc)
    rebuilt = info.rebuild("rpc_sync(mod.fn)")
    assert type(rebuilt) is type(exc)
    assert str(rebuilt) == str(exc)
    assert rebuilt.args == exc.args


def test_rebuilt_exception_has_remote_traceback_cause() -> None:
    info = captured(ValueError("bad value"))
    rebuilt = info.rebuild("rpc_sync(mod.fn)")
    cause = rebuilt.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert cause.text == info.traceback
    assert "remote_helper_that_fails" in cause.text
    assert str(cause).startswith("\n")


def test_rebuilt_exception_has_note_naming_worker_and_call() -> None:
    rebuilt = captured(ValueError("bad value"), worker="trainer3").rebuild("rpc_async(f)")
    assert len(notes(rebuilt)) == 1
    note = notes(rebuilt)[0]
    assert "'trainer3'" in note
    assert "rpc_async(f)" in note


@pytest.mark.skipif(sys.version_info < (3, 11), reason="add_note is 3.11+")
def test_note_is_printed_with_the_traceback() -> None:
    import traceback

    rebuilt = captured(ValueError("bad"), worker="w2").rebuild("rpc_sync(g)")
    text = "".join(traceback.format_exception(rebuilt))
    assert "raised on worker 'w2' while running rpc_sync(g)" in text
    assert "remote_helper_that_fails" in text


def test_each_rebuild_is_a_fresh_exception() -> None:
    info = captured(ValueError("bad value"))
    first, second = info.rebuild("call_a"), info.rebuild("call_b")
    assert first is not second
    assert len(notes(first)) == 1 and "call_a" in notes(first)[0]
    assert len(notes(second)) == 1 and "call_b" in notes(second)[0]


def test_unrebuildable_exception_becomes_remote_exception() -> None:
    info = captured(TwoArgError(7, "disk full"), worker="ps0")
    assert info.pickled is not None  # pickling works; unpickling cannot call __init__
    rebuilt = info.rebuild("rpc_sync(save)")
    assert type(rebuilt) is RemoteException
    assert rebuilt.exc_type == f"{TwoArgError.__module__}.TwoArgError"
    assert rebuilt.remote_message == "code 7: disk full"
    assert rebuilt.worker == "ps0"
    assert rebuilt.remote_traceback == info.traceback
    assert "remote_helper_that_fails" in rebuilt.remote_traceback
    assert "TwoArgError: code 7: disk full" in str(rebuilt)
    assert "'ps0'" in str(rebuilt)
    assert isinstance(rebuilt.__cause__, RemoteTraceback)
    assert any("rpc_sync(save)" in n and "'ps0'" in n for n in notes(rebuilt))


def test_unpicklable_exception_becomes_remote_exception() -> None:
    rebuilt = captured(Unpicklable("has a lambda")).rebuild("call")
    assert type(rebuilt) is RemoteException
    assert rebuilt.remote_message == "has a lambda"
    assert rebuilt.exc_type.endswith("Unpicklable")


def test_exception_whose_message_changes_becomes_remote_exception() -> None:
    class_info = captured(ValueError("original"))
    tampered = RemoteErrorInfo(
        class_info.exc_type,
        "a different message",
        class_info.traceback,
        class_info.worker,
        class_info.pickled,
    )
    rebuilt = tampered.rebuild("call")
    assert type(rebuilt) is RemoteException
    assert rebuilt.remote_message == "a different message"


def test_missing_class_at_the_caller_becomes_remote_exception() -> None:
    info = captured(CustomError("custom"))
    assert info.pickled is not None
    missing = info.pickled.replace(b"CustomError", b"CustomErrox")  # same length
    with pytest.raises(AttributeError, match="CustomErrox"):
        pickle.loads(missing)
    rebuilt = RemoteErrorInfo(
        info.exc_type, info.message, info.traceback, info.worker, missing
    ).rebuild("call")
    assert type(rebuilt) is RemoteException
    assert rebuilt.exc_type == info.exc_type


# ------------------------------------------------------------------------ RemoteException


def test_remote_exception_pickle_round_trip() -> None:
    exc = RemoteException("mod.Err", "it broke", "w1", "Traceback ...\nmod.Err: it broke\n")
    copied = pickle.loads(pickle.dumps(exc))
    assert type(copied) is RemoteException
    assert copied.exc_type == "mod.Err"
    assert copied.remote_message == "it broke"
    assert copied.worker == "w1"
    assert copied.remote_traceback == exc.remote_traceback
    assert str(copied) == str(exc)


def test_remote_exception_captured_again_keeps_its_fields() -> None:
    # A RemoteException raised on a middle worker of a nested call travels on.
    inner = RemoteException("mod.Err", "it broke", "w2", "tb")
    rebuilt = captured(inner, worker="w1").rebuild("rpc_sync(relay)")
    assert type(rebuilt) is RemoteException
    assert rebuilt.exc_type == "mod.Err"
    assert rebuilt.worker == "w2"


def test_remote_traceback_str_starts_on_a_new_line() -> None:
    tb = RemoteTraceback("Traceback (most recent call last):\n  ...")
    assert tb.text.startswith("Traceback")
    assert str(tb) == "\nTraceback (most recent call last):\n  ..."
    assert isinstance(tb, Exception) and not isinstance(tb, RpcError)
