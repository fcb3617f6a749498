"""The future type rpcx returns: a ``torch.futures.Future`` that knows about the pool.

It is a real ``torch.futures.Future``, so ``then``, ``add_done_callback``, ``collect_all``
and ``wait_all`` work unchanged. The one difference: waiting on it from a request-pool
thread tells the pool that the thread is blocked, so the pool can add a thread and nested
calls cannot exhaust it.
"""

from __future__ import annotations

import contextvars
import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import torch

from rpcx._util.pool import blocking
from rpcx.errors import RpcShutdownError

__all__ = [
    "RpcFuture",
    "add_internal_callback",
    "all_done",
    "settle_inline",
    "wait",
    "wait_all",
    "wait_done",
]

T = TypeVar("T")
S = TypeVar("S")


class RpcFuture(torch.futures.Future[T]):
    """``torch.futures.Future`` returned by ``rpc_async`` and friends.

    rpcx completes these futures on a thread of its own completion lane, never on a
    transport's receiving thread or the timer thread, so callbacks (``then``,
    ``add_done_callback``, those ``collect_all`` attaches) may block, even on another
    call to the same worker. The one shortcut: a future that a thread is already
    waiting on and that has no Python callbacks is completed where its reply arrives.

    Callbacks run in a copy of the registering thread's context variables, as asyncio
    runs its callbacks: the current worker and distributed autograd context carry over,
    so a call made from a callback is recorded in the context it was set up in.
    """

    has_callbacks = False  # a user callback is attached: complete on the completion lane
    has_waiter = False  # a thread waits on it
    has_internal = False  # rpcx's own non-blocking callbacks are attached

    def then(self, callback: Callable[[torch.futures.Future[T]], S]) -> RpcFuture[S]:
        """Like ``torch.futures.Future.then``, returning an :class:`RpcFuture`.

        Waiting on the returned future from a request thread lets the pool grow, as
        waiting on this one does. A callback that is not callable is a ``TypeError``
        here, as in torch, not later on the thread that completes the future.
        """
        _check_callable("then", callback)
        self.has_callbacks = True
        result: RpcFuture[S] = RpcFuture()
        context = contextvars.copy_context()

        def run(_: Any) -> None:
            try:
                result.set_result(context.run(callback, self))
            except BaseException as exc:
                result.set_exception(exc)  # type: ignore[arg-type]

        torch._C.Future.add_done_callback(self, _off_the_settling_thread(run))
        return result

    def add_done_callback(self, callback: Callable[[torch.futures.Future[T]], None]) -> None:
        """Like ``torch.futures.Future.add_done_callback``."""
        _check_callable("add_done_callback", callback)
        self.has_callbacks = True
        context = contextvars.copy_context()
        super().add_done_callback(
            _off_the_settling_thread(lambda future: context.run(callback, future))
        )

    def wait(self) -> T:
        """Block until the value is ready and return it, or raise the call's error.

        The error raised is a copy of the one the future holds (same type, message,
        notes and cause): see :func:`_raise_detached`.
        """
        self.has_waiter = True
        try:
            if self.done():
                return super().wait()
            with blocking():
                return super().wait()
        except BaseException as exc:
            _raise_detached(exc)

    def value(self) -> T:
        """The value of a completed future, or a copy of its error."""
        try:
            return super().value()
        except BaseException as exc:
            _raise_detached(exc)


class _Settling(threading.local):
    # Set while the agent completes a future on a thread that must not run user code
    # (a transport's receiving thread, the timer): where such callbacks go instead.
    lane: Callable[..., None] | None = None


_settling = _Settling()


def settle_inline(
    future: torch.futures.Future[Any],
    value: Any,
    exception: BaseException | None,
    lane: Callable[..., None],
) -> None:
    """Complete ``future`` here, sending any user callback on it to ``lane`` instead.

    The agent completes a future on its receiving thread only when no user callback is
    attached, but one can be attached between that check and the completion: such a
    callback notices, at the moment it runs, that it must not run here, and goes to
    ``lane`` (``lane(fn, arg)``; it may raise ``RpcShutdownError``, then it runs here).
    """
    outer, _settling.lane = _settling.lane, lane
    try:
        if exception is None:
            future.set_result(value)
        else:
            future.set_exception(exception)
    finally:
        _settling.lane = outer


def _off_the_settling_thread(callback: Callable[[Any], None]) -> Callable[[Any], None]:
    def run(future: Any) -> None:
        lane = _settling.lane
        if lane is not None:
            try:
                lane(callback, future)
                return
            except RpcShutdownError:
                pass  # no lane any more: run it here
        callback(future)

    return run


def _check_callable(method: str, callback: object) -> None:
    # torch's pybind binding refuses a non-callable with this wording; rpcx wraps the
    # callback in a closure, so it has to check itself.
    if not callable(callback):
        raise TypeError(
            f"{method}(): incompatible function arguments: the callback must be callable, "
            f"got {type(callback).__name__}"
        )


def _raise_detached(exc: BaseException) -> NoReturn:
    """Raise a copy of an error held by a future, never the held object itself.

    A torch future keeps its error in C++, out of sight of Python's garbage collector.
    Raising that object attaches the frames it passes through (with their locals: the
    future, RRefs, whole models) to it, and raising it inside an ``except`` block links
    it to the exception being handled: reference cycles through C++ that are never
    collected. So the held error's traceback and context are cleared and a copy raised.
    """
    exc.__traceback__ = None
    exc.__context__ = None
    try:
        detached = copy.copy(exc)
    except Exception:  # an exception that cannot be copied: raise it as it is
        raise exc from exc.__cause__
    notes = getattr(exc, "__notes__", None)
    if notes is not None:
        detached.__notes__ = list(notes)  # type: ignore[attr-defined]
    raise detached from exc.__cause__


def add_internal_callback(
    future: torch._C.Future[Any], callback: Callable[[Any], None]
) -> None:
    """Attach a callback of rpcx's own (non-blocking), leaving ``has_callbacks`` alone.

    A future with only such callbacks may be completed on a transport's receiving
    thread, so these callbacks must never block, send, or run user code.
    """
    if isinstance(future, RpcFuture):
        future.has_internal = True
    torch._C.Future.add_done_callback(future, callback)


def wait(future: torch.futures.Future[Any]) -> Any:
    """Wait on any torch future, telling the pool when this is a pool thread.

    Errors are raised as copies, as by :meth:`RpcFuture.wait`.
    """
    try:
        if future.done():
            return future.wait()
        with blocking():
            return future.wait()
    except BaseException as exc:
        _raise_detached(exc)


def wait_done(future: torch.futures.Future[Any], timeout: float | None) -> bool:
    """Wait until ``future`` completes or ``timeout`` seconds pass; True if it completed.

    Raises nothing about the outcome (read it with ``value()``); tells the pool when
    this is a pool thread, as :func:`wait` does.
    """
    if future.done():
        return True
    done = threading.Event()
    add_internal_callback(future, lambda _: done.set())
    with blocking():
        return done.wait(timeout)


def wait_all(futures: Sequence[torch.futures.Future[Any]]) -> list[Any]:
    """Every future's value, in order; once all have finished, raise the first error.

    Waiting for all before raising matters: a caller that raises early would leave
    calls running that touch state it is about to give up (an optimizer step, say).
    """
    results, errors = [], []
    for future in futures:
        try:
            results.append(wait(future))
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    return results


def all_done(futures: Sequence[torch.futures.Future[Any]]) -> torch.futures.Future[None]:
    """A future that completes when all of ``futures`` have, failing with the first error
    (for handlers that reply later: ``Deferred(all_done(...))``)."""

    def check(done: torch.futures.Future[list[torch.futures.Future[Any]]]) -> None:
        for future in done.value():
            future.value()  # raises that future's error

    return torch.futures.collect_all(list(futures)).then(check)
