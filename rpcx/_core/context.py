"""Which agent is "the current worker" for the calling thread, and whether the thread is
delivering a frame.

Multi-process backends have one agent per process. The loopback backend runs several
workers as threads of one process, so each worker's threads carry their agent in a
context variable; lookups fall back to the process-wide agent.

A thread that delivers a frame (a transport's receiving thread, inside the call path)
must never send or wait: what it would send goes out from the pool. :class:`receiving`
marks that role, and binds the agent the frame is for, for a ``with`` block.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

from rpcx._core.service_host import ServiceHost as RpcAgent  # (what callers may use of it)
from rpcx.errors import RpcNotInitializedError, RpcShutdownError

__all__ = [
    "bind_agent",
    "bind_thread_agent",
    "bound_to",
    "current_agent",
    "forget",
    "maybe_current_agent",
    "process_agent",
    "receiving",
    "receiving_thread",
    "register",
    "set_process_agent",
    "thread_agent",
    "unbind_thread_agent",
]

_thread_agent: contextvars.ContextVar[RpcAgent | None] = contextvars.ContextVar(
    "rpcx_agent", default=None
)
# Set by rpcx.spawn for the threads it starts: the backend and in-process world to join.
spawn_backend: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "rpcx_spawn_backend", default=None
)
spawn_world: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "rpcx_spawn_world", default=None
)

_lock = threading.Lock()
_process_agent: RpcAgent | None = None
_last_process_agent: RpcAgent | None = None
_running: list[RpcAgent] = []  # every running agent of this process, in start order


def bind_agent(agent: RpcAgent | None) -> None:
    """Make ``agent`` the current worker of the calling thread (``None`` unbinds)."""
    _thread_agent.set(agent)


def thread_agent() -> RpcAgent | None:
    """The agent bound to the calling thread, running or shut down; ``None`` if none is."""
    return _thread_agent.get()


def process_agent() -> RpcAgent | None:
    """The process-wide agent, running or shut down; ``None`` if there is none."""
    return _process_agent


def bind_thread_agent(agent: RpcAgent | None) -> contextvars.Token[RpcAgent | None]:
    """Bind ``agent`` to the calling thread until :func:`unbind_thread_agent` is given
    the returned token (what :func:`bound_to` does, without a context manager)."""
    return _thread_agent.set(agent)


def unbind_thread_agent(token: contextvars.Token[RpcAgent | None]) -> None:
    """Restore the calling thread's binding from before :func:`bind_thread_agent`."""
    _thread_agent.reset(token)


@contextlib.contextmanager
def bound_to(agent: RpcAgent | None) -> Iterator[None]:
    """Run the ``with`` block as worker ``agent`` on this thread, then restore the
    thread's previous binding."""
    token = _thread_agent.set(agent)
    try:
        yield
    finally:
        _thread_agent.reset(token)


def set_process_agent(agent: RpcAgent | None) -> None:
    """Make ``agent`` the process-wide worker (``None`` clears it)."""
    global _process_agent, _last_process_agent
    with _lock:
        if _process_agent is not None:
            _last_process_agent = _process_agent
        _process_agent = agent


def register(agent: RpcAgent) -> None:
    """Note that ``agent`` is running in this process."""
    with _lock:
        _running.append(agent)


def forget(agent: RpcAgent) -> None:
    """Note that ``agent`` has shut down."""
    global _process_agent, _last_process_agent
    with _lock:
        if agent in _running:
            _running.remove(agent)
        if _process_agent is agent:
            _process_agent, _last_process_agent = None, agent


def running_agents() -> list[RpcAgent]:
    """Every running agent of this process."""
    with _lock:
        return list(_running)


def maybe_current_agent() -> RpcAgent | None:
    """The running agent of the calling thread, or ``None``.

    A thread bound to no worker uses the process-wide agent, or else the only running
    agent of the process (a one-worker loopback world used from helper threads).
    """
    agent = _thread_agent.get()
    if agent is not None:  # a thread bound to a worker stays that worker, even shut down
        return agent if agent.is_running else None
    process_agent = _process_agent
    if process_agent is not None and process_agent.is_running:
        return process_agent
    running = _running
    if len(running) == 1:
        return running[0]
    return None


def current_agent() -> RpcAgent:
    """The running agent of the calling thread; raises a clear error if there is none."""
    agent = maybe_current_agent()
    if agent is not None:
        return agent
    stale = _thread_agent.get() or _process_agent or _last_process_agent
    if stale is not None:
        raise RpcShutdownError(
            f"RPC on worker {stale.name!r} has shut down; call rpcx.init_rpc(...) to start again"
        )
    if len(_running) > 1:
        raise RpcNotInitializedError(
            "this thread belongs to none of the "
            f"{len(_running)} in-process workers; run it from a worker's thread, or copy "
            "the worker's context into it (contextvars.copy_context().run)"
        )
    raise RpcNotInitializedError(
        "RPC is not initialized on this thread or process: call rpcx.init_rpc(...) first"
    )


class _ReceivingThread(threading.local):
    delivering = False  # True while this thread delivers a frame (a transport's thread)


receiving_thread = _ReceivingThread()
"""``receiving_thread.delivering``: whether the calling thread is delivering a frame."""


class receiving:
    """The calling thread delivers a frame for the ``with`` block: it must not send or
    wait; with ``agent``, it also runs as that worker (callbacks it runs see it).

    A class rather than a generator: the call path enters it once per reply delivered.
    """

    __slots__ = ("_agent", "_token", "_was")

    def __init__(self, agent: RpcAgent | None = None) -> None:
        self._agent = agent
        self._token: contextvars.Token[RpcAgent | None] | None = None
        self._was = False

    def __enter__(self) -> None:
        if self._agent is not None:
            self._token = _thread_agent.set(self._agent)
        self._was, receiving_thread.delivering = receiving_thread.delivering, True

    def __exit__(self, *exc: object) -> None:
        receiving_thread.delivering = self._was
        if self._token is not None:
            _thread_agent.reset(self._token)
