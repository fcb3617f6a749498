"""The errors rpcx raises, and how remote exceptions travel back to the caller.

Every rpcx error derives from :class:`RpcError`, itself a :class:`RuntimeError`, because
torch.distributed.rpc raises ``RuntimeError`` and programs written for it catch that.
"""

from __future__ import annotations

import contextlib
import enum
import pickle
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "CLOSED_CONNECTION",
    "AuthenticationError",
    "BackendNotFoundError",
    "InvalidWorkerNameError",
    "LostCause",
    "PeerLostError",
    "ProtocolError",
    "RemoteException",
    "RemoteTraceback",
    "RpcError",
    "RpcNotInitializedError",
    "RpcShutdownError",
    "RpcTimeoutError",
    "SerializationError",
    "UnknownWorkerError",
    "lost_reason",
    "use_exception_pickling",
    "without_cpp_locations",
]


class RpcError(RuntimeError):
    """Base class of every error rpcx raises itself."""


class RpcNotInitializedError(RpcError):
    """An RPC API was used on a thread or process where ``init_rpc`` has not run."""


class RpcShutdownError(RpcError):
    """The local worker has shut down (or is shutting down) and cannot make this call."""


class RpcTimeoutError(RpcError, TimeoutError):
    """A call did not complete within its timeout. The message names the call and worker."""


class UnknownWorkerError(RpcError, ValueError):
    """The destination is not a worker of this RPC world."""


class InvalidWorkerNameError(RpcError, ValueError):
    """A worker name breaks torch's rule: 1 to 127 letters, digits, ``_``, ``-``, ``:``.

    A ``RuntimeError`` (as torch raises for ``WorkerInfo("abc*", 0)``) and a ``ValueError``.
    """


class LostCause(enum.Enum):
    """Why a peer is gone, as its transport reports it (``TransportContext.peer_lost``)."""

    DEPARTED = "departed"
    """It said goodbye: it shut down on purpose."""
    CONNECTION_LOST = "connection lost"
    """The connection broke; its process probably died."""
    UNRESPONSIVE = "unresponsive"
    """Silent past ``heartbeat_timeout``."""
    PROTOCOL_ERROR = "protocol error"
    """It sent what is no valid frame, or failed authentication."""


# What a transport's ``detail`` usually is when a peer's process went away.
CLOSED_CONNECTION = "closed its connection (its process probably exited or crashed)"


def lost_reason(cause: LostCause, detail: str = "") -> str:
    """How a lost peer is described: the end of "worker 'name' (rank N) ...".

    Transports report ``peer_lost(rank, cause, detail)``; this writes the one sentence
    every backend's errors share, e.g. ``"has shut down"`` or
    ``"is unreachable: protocol error: <detail>"``. A departure's ``detail`` replaces
    "has shut down" (the agent's words for a peer that left without calling shutdown).
    """
    if cause is LostCause.DEPARTED:
        return detail or "has shut down"
    if cause is LostCause.UNRESPONSIVE:
        return f"is unresponsive: {detail}" if detail else "is unresponsive"
    if cause is LostCause.PROTOCOL_ERROR:
        return f"is unreachable: protocol error: {detail or 'an invalid frame'}"
    return f"is unreachable: {detail or CLOSED_CONNECTION}"


class PeerLostError(RpcError, ConnectionError):
    """The destination worker died, left, or became unreachable.

    ``cause`` says which (a :class:`LostCause`), where rpcx knows it.
    """

    def __init__(self, *args: object, cause: LostCause | None = None) -> None:
        super().__init__(*args)
        self.cause = cause


class ProtocolError(RpcError, ValueError):
    """A peer sent bytes that are no frame of the transport's format (a bug, or hostile
    input). Transports raise it from their decoders, before allocating or copying by the
    sizes it announced, and report that peer lost with the reason ``protocol error: ...``.
    """


class AuthenticationError(RpcError, PermissionError):
    """A worker or a value did not prove it holds this world's key (``RPCX_AUTH_KEY``).

    Raised by ``init_rpc`` when a rendezvous value from some rank is not sealed with this
    worker's key (that rank holds another key, or is no worker at all); the message names
    the rank.
    """


class SerializationError(RpcError, pickle.PicklingError):
    """A call's function, arguments or result could not be pickled or unpickled."""


class BackendNotFoundError(RpcError, ValueError):
    """No installed backend has the requested name. The message lists the installed ones."""


class RemoteTraceback(Exception):
    """Carries the text of a traceback printed on another worker.

    rpcx sets it as ``__cause__`` of a re-raised remote exception so that the printed
    traceback shows where the error really happened.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


class RemoteException(RpcError):
    """A remote exception whose original type could not be rebuilt on the caller.

    It keeps everything the original carried as text: ``exc_type`` (the qualified name of
    the original class), ``remote_message``, ``worker`` and ``remote_traceback``.
    """

    def __init__(self, exc_type: str, remote_message: str, worker: str, remote_traceback: str):
        super().__init__(f"{exc_type}: {remote_message} (raised on worker {worker!r})")
        self.exc_type = exc_type
        self.remote_message = remote_message
        self.worker = worker
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (self.exc_type, self.remote_message, self.worker, self.remote_traceback),
        )


@dataclass(frozen=True)
class RemoteErrorInfo:
    """What a worker sends back when a call raised: enough to rebuild or describe it."""

    exc_type: str
    message: str
    traceback: str
    worker: str
    pickled: bytes | None

    @classmethod
    def capture(cls, exc: BaseException, worker: str) -> RemoteErrorInfo:
        """Describe ``exc``, raised on ``worker``, for the trip back to the caller."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(_qualified_name(type(exc)), str(exc), tb, worker,
                   _exception_pickling.dumps(exc))

    def rebuild(self, call: str) -> BaseException:
        """The exception to raise at the caller: the original type if it can be rebuilt."""
        exc: BaseException | None = None
        candidate = _exception_pickling.loads(self.pickled)
        if candidate is not None and str(candidate) == self.message:
            exc = candidate
        if exc is None:
            exc = RemoteException(self.exc_type, self.message, self.worker, self.traceback)
        exc.__cause__ = RemoteTraceback(self.traceback)
        _add_note(exc, f"raised on worker {self.worker!r} while running {call}")
        return exc


class _ExceptionPickling:
    """How :class:`RemoteErrorInfo` pickles an exception on its own, and reads it back.

    Only the codec pickles, and it sits above this module: :mod:`rpcx._wire.codec`
    installs its two functions here when it loads (:func:`use_exception_pickling`), so
    this module imports nothing of rpcx. Until then an error travels by description.
    """

    __slots__ = ("dumps", "loads")

    def __init__(self) -> None:
        self.dumps: Callable[[BaseException], bytes | None] = lambda exc: None
        self.loads: Callable[[bytes | None], BaseException | None] = lambda data: None


_exception_pickling = _ExceptionPickling()


def use_exception_pickling(
    dumps: Callable[[BaseException], bytes | None],
    loads: Callable[[bytes | None], BaseException | None],
) -> None:
    """Called by the codec as it loads: ``dumps(exc)`` pickles an exception on its own
    (``None`` if it cannot be pickled), ``loads(data)`` rebuilds it (``None`` if it
    cannot be rebuilt here)."""
    _exception_pickling.dumps = dumps
    _exception_pickling.loads = loads


def _qualified_name(cls: type) -> str:
    module = getattr(cls, "__module__", None)
    if module in (None, "builtins"):
        return cls.__qualname__
    return f"{module}.{cls.__qualname__}"


def _add_note(exc: BaseException, note: str) -> None:
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:  # 3.10 has no add_note; keep the note where 3.11+ tooling looks for it
        notes = list(getattr(exc, "__notes__", []))
        notes.append(note)
        with contextlib.suppress(AttributeError):
            exc.__notes__ = notes  # type: ignore[attr-defined]


# torch's C++ errors name their source: "[../gloo/transport.cc:12] ..." (c10) or
# "... (this error originated at tensorpipe/core/pipe_impl.cc:356)" (TensorPipe).
_CPP_LOCATION = re.compile(
    r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*|\s*\(this error originated at [^)]*\)"
)


def without_cpp_locations(text: str) -> str:
    """``text`` (a torch/C++ error message) without its C++ source locations.

    Transports use it for the reasons they give ``peer_lost``: users read those, and
    a file and line inside gloo or TensorPipe tells them nothing.
    """
    return _CPP_LOCATION.sub("", text).strip()
