"""What a transport's ``start`` uses: its own options type, the bound on connecting
(``rpc_timeout``) and its error, a library call run within that bound, and an
environment variable set for a block (for libraries that read the environment).

Public and stable for plugin authors; :mod:`rpcx.transport_kit` re-exports them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from rpcx._util.environ import environment_variable
from rpcx.errors import RpcTimeoutError
from rpcx.options import RpcBackendOptions, converted_options
from rpcx.transport import TransportContext

__all__ = ["connect_limit", "connect_timeout", "environment_variable", "options_as",
           "run_bounded", "wait_connected"]

OptionsT = TypeVar("OptionsT", bound=RpcBackendOptions)


def options_as(ctx: TransportContext, cls: type[OptionsT]) -> OptionsT:
    """``ctx.options`` as the transport's own options type ``cls``.

    rpcx hands each transport options of its registered ``options_type`` (``init_rpc``
    converts them once); any other options object (a test's, torch's) becomes a ``cls``
    with the fields the two share and the defaults of the rest.
    """
    options = ctx.options
    if isinstance(options, cls):
        return options
    return converted_options(options, cls)


def connect_limit(ctx: TransportContext) -> float | None:
    """How long connecting to the mesh may take: ``rpc_timeout`` (``None``: no bound)."""
    return ctx.options.rpc_timeout or None


def connect_timeout(ctx: TransportContext, what: str,
                    hint: str = "a peer probably died after joining the world") -> RpcTimeoutError:
    """The error for a mesh not connected in time::

        init_rpc: worker 'w' (rank 1) could not connect <what> within 30 s
        (rpc_timeout); <hint>
    """
    limit = connect_limit(ctx) or 0.0
    return RpcTimeoutError(
        f"init_rpc: worker {ctx.names[ctx.rank]!r} (rank {ctx.rank}) could not connect "
        f"{what} within {limit:g} s (rpc_timeout); {hint}"
    )


T = TypeVar("T")


def run_bounded(ctx: TransportContext, connect: Callable[[], T], what: str,
                hint: str = "a peer probably died after joining the world") -> T:
    """``connect()`` on a helper thread, waited for at most ``rpc_timeout``.

    For a library call that cannot be given a timeout of its own (gloo's mesh): past
    the bound the thread is abandoned, still blocked, and :func:`connect_timeout`'s
    error is raised. An exception from ``connect`` is raised on the caller's thread.
    """
    done: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(connect())
        except BaseException as exc:  # surfaced on the caller's thread below
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True,
                              name=f"rpcx-{ctx.names[ctx.rank]}-connect")
    thread.start()
    thread.join(connect_limit(ctx))
    if failed:
        raise failed[0]
    if not done:
        raise connect_timeout(ctx, what, hint)
    return done[0]


def wait_connected(ctx: TransportContext, connected: Mapping[str, threading.Event],
                   hint: str = "a peer probably died after joining the world") -> None:
    """Wait, all together at most ``rpc_timeout``, until every event in ``connected``
    is set (one per connection, by what to call it in the error: "'w1' at tcp://...").
    :func:`connect_timeout`'s error names those still not connected."""
    limit = connect_limit(ctx)
    deadline = None if limit is None else time.monotonic() + limit
    for event in connected.values():
        event.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    missing = [what for what, event in connected.items() if not event.is_set()]
    if missing:
        raise connect_timeout(ctx, f"to {', '.join(missing)}", hint)
