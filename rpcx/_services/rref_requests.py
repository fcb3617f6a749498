"""The owner's side of RRef requests, and what the creator and holders send it.

``REMOTE_CALL`` runs a function and keeps its result under the new RRef's id;
``RREF_FETCH`` answers with the value once it exists; ``RREF_CALL`` runs a method of the
value (a proxy call: ``rref.rpc_sync().m()``); ``RREF_FORKS``, ``RREF_DELETE`` and
``RREF_CONFIRM`` are the lifetime protocol's bookkeeping, handled in arrival order
(:mod:`rpcx._services.rref_protocol` says why). The user's type is :class:`rpcx.RRef`.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import torch

from rpcx._core import context as _context
from rpcx._core.service_host import Deferred, ServiceHost, describe_callable
from rpcx._services.calls import run_user_function
from rpcx._services.rref_fork import RRefId
from rpcx._services.rref_protocol import RRefService
from rpcx.functions import async_execution, is_async_execution
from rpcx.futures import wait
from rpcx.messages import MessageKind
from rpcx.worker import WorkerInfo

__all__ = ["SERVICE", "install", "invoke_on_owner", "service"]

SERVICE = "rref"
"""The key of the RRef service in an agent's ``services``."""


def service(agent: ServiceHost) -> RRefService:
    """The RRef service of ``agent``."""
    svc: RRefService = agent.services[SERVICE]
    return svc


@async_execution
def invoke_on_owner(
    rref_id: RRefId, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.futures.Future[Any]:
    """Runs on the owner: call ``value.name(*args, **kwargs)`` once the value exists."""
    result: torch.futures.Future[Any] = torch.futures.Future()

    def run(value_future: torch.futures.Future[Any]) -> None:
        try:
            method = getattr(value_future.wait(), name)
            out = method(*args, **kwargs)
        except BaseException as exc:
            result.set_exception(exc)
            return
        if is_async_execution(method):
            out.add_done_callback(lambda f: _forward(f, result))
        else:
            result.set_result(out)

    agent = _context.current_agent()
    # The method may run later, on the thread that makes the value: in this request's
    # context all the same (its distributed autograd context above all: as on torch,
    # whose owner runs it in the request, what it sends must be recorded there).
    request_context = contextvars.copy_context()
    service(agent).slot(rref_id).add_done_callback(lambda f: request_context.run(run, f))
    return result


def _handle_rref_call(agent: ServiceHost) -> Callable[[WorkerInfo, Any], Any]:
    svc = service(agent)

    def handle(caller: WorkerInfo, payload: Any) -> Any:
        rref_id, name, args, kwargs = payload
        slot = svc.slot(rref_id)
        if not slot.done():  # remote() has not made the value yet: run once it has
            return Deferred(invoke_on_owner(rref_id, name, args, kwargs))
        # The common case, without a future: the value exists (or failed), run it now.
        return run_user_function(getattr(wait(slot), name), args, kwargs)

    return handle


def _forward(source: torch.futures.Future[Any], target: torch.futures.Future[Any]) -> None:
    try:
        target.set_result(source.wait())
    except BaseException as exc:
        target.set_exception(exc)


def _handle_remote_call(agent: ServiceHost) -> Callable[[WorkerInfo, Any], Any]:
    svc = service(agent)

    def handle(caller: WorkerInfo, payload: Any) -> Any:
        rref_id, fork, func, args, kwargs = payload
        slot = svc.begin_creation(rref_id, fork, caller.id)
        try:
            out = func(*args, **kwargs)
        except BaseException as exc:
            slot.set_exception(exc)
            raise
        if not is_async_execution(func):
            slot.set_result(out)
            return None
        if not isinstance(out, torch._C.Future):
            error = TypeError(
                f"@async_execution function {describe_callable(func)} must return a "
                f"torch.futures.Future, but returned {type(out).__name__}"
            )
            slot.set_exception(error)
            raise error
        ack: torch.futures.Future[Any] = torch.futures.Future()

        def settle(done: torch.futures.Future[Any]) -> None:
            try:
                value = done.wait()
            except BaseException as exc:
                slot.set_exception(exc)
                ack.set_exception(exc)
            else:
                slot.set_result(value)
                ack.set_result(None)

        out.add_done_callback(settle)
        return Deferred(ack)

    return handle


def _remote_call_undecodable(
    agent: ServiceHost,
) -> Callable[[WorkerInfo, Any, BaseException], None]:
    svc = service(agent)

    def settle(caller: WorkerInfo, payload: Any, error: BaseException) -> None:
        # The function or an argument did not unpickle here: the value will never exist.
        # Record that, so fetches and proxies fail with the reason instead of waiting.
        rref_id, fork = payload[0], payload[1]
        slot = svc.begin_creation(rref_id, fork, caller.id)
        if not slot.done():
            slot.set_exception(error)

    return settle


def _handle_fetch(agent: ServiceHost) -> Callable[[WorkerInfo, Any], Any]:
    svc = service(agent)

    def handle(caller: WorkerInfo, rref_id: Any) -> Any:
        return Deferred(svc.slot(rref_id))

    return handle


def _handle_forks(agent: ServiceHost) -> Callable[[WorkerInfo, Any], Any]:
    svc = service(agent)

    def handle(caller: WorkerInfo, forks: Any) -> None:
        svc.add_forks(forks, caller.id)

    return handle


def _handle_delete(agent: ServiceHost) -> Callable[[WorkerInfo, Any], Any]:
    svc = service(agent)

    def handle(caller: WorkerInfo, forks: Any) -> None:
        svc.remove_forks(forks)

    return handle


def _handle_confirm(agent: ServiceHost) -> Callable[[WorkerInfo, Any], Any]:
    svc = service(agent)

    def handle(caller: WorkerInfo, forks: Any) -> None:
        svc.confirm(forks)

    return handle


def install(agent: ServiceHost) -> None:
    """Give ``agent`` its RRef service and serve RRef requests."""
    svc = RRefService(agent)
    agent.services[SERVICE] = svc
    agent.register_handler(
        MessageKind.REMOTE_CALL, _handle_remote_call(agent),
        on_decode_error=_remote_call_undecodable(agent),
    )
    # A fetch needs no ordering: the fetching RRef stays alive until the reply. Reference
    # bookkeeping is handled in arrival order (see rpcx._services.rref_protocol).
    agent.register_handler(MessageKind.RREF_FETCH, _handle_fetch(agent))
    agent.register_handler(MessageKind.RREF_CALL, _handle_rref_call(agent))
    agent.register_handler(MessageKind.RREF_FORKS, _handle_forks(agent), in_order=True)
    agent.register_handler(MessageKind.RREF_DELETE, _handle_delete(agent), in_order=True)
    agent.register_handler(MessageKind.RREF_CONFIRM, _handle_confirm(agent), in_order=True)
    agent.on_drain.append(svc.flush)
    agent.note_sources.append(svc.deletions)
    agent.on_peer_lost.append(svc.drop_rank)
    agent.on_rank_reused.append(svc.rank_reused)
    agent.on_close.append(svc.close)
