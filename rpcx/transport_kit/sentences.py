"""What a transport says when a peer is lost: the sentences of the ``PeerLostError`` its
``send`` raises, and the ``(cause, detail)`` a receive loop reports.

A transport reports a lost peer as ``ctx.peer_lost(rank, cause, detail)`` and rpcx
writes the sentence (:func:`rpcx.errors.lost_reason`); these are the few a transport
still writes itself. Public and stable for plugin authors; :mod:`rpcx.transport_kit`
re-exports them.
"""

from __future__ import annotations

from rpcx.errors import (
    CLOSED_CONNECTION,
    LostCause,
    PeerLostError,
    ProtocolError,
    lost_reason,
    without_cpp_locations,
)

__all__ = ["CLOSED_CONNECTION", "SHUT_DOWN", "classify", "describe", "lost_error",
           "lost_reason", "unreachable", "without_cpp_locations"]

SHUT_DOWN = "has shut down"
"""What ``send`` raises (in a ``PeerLostError``) for a peer that said goodbye, or after
this worker said its own: the end of "worker 'x' (rank N) has shut down"."""


def unreachable(detail: str) -> str:
    """``"is unreachable: <detail>"``: ``send``'s ``PeerLostError`` for a broken link."""
    return lost_reason(LostCause.CONNECTION_LOST, detail)


def describe(exc: BaseException) -> str:
    """What went wrong, in a few words: an ``OSError``'s ``strerror``, otherwise the
    message's first line without C++ source locations (torch and gloo add them)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    lines = str(exc).strip().splitlines()
    text = without_cpp_locations(lines[0]) if lines else ""
    return text or type(exc).__name__


def lost_error(exc: BaseException) -> PeerLostError:
    """The ``PeerLostError`` a ``send`` raises when writing failed with ``exc``."""
    if isinstance(exc, PeerLostError):
        return exc
    return PeerLostError(unreachable(describe(exc)), cause=LostCause.CONNECTION_LOST)


def classify(exc: BaseException) -> tuple[LostCause, str]:
    """``(cause, detail)`` for ``peer_lost`` from what ended a receive loop.

    End of file or a reset: the peer's process went away (``CLOSED_CONNECTION``).
    Another ``OSError``: the connection broke (its type and message). A
    :class:`~rpcx.errors.ProtocolError`, or any other exception reading a frame: the
    peer sent what is no frame (``PROTOCOL_ERROR``).
    """
    if isinstance(exc, EOFError | ConnectionResetError):
        return LostCause.CONNECTION_LOST, CLOSED_CONNECTION
    if isinstance(exc, ProtocolError):
        return LostCause.PROTOCOL_ERROR, str(exc)
    if isinstance(exc, OSError):
        return LostCause.CONNECTION_LOST, f"{type(exc).__name__}: {exc}"
    return LostCause.PROTOCOL_ERROR, f"{type(exc).__name__}: {exc}"
