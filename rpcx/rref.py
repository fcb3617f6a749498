"""Remote references: :class:`RRef`, ``remote()`` and the owner's value table.

Each RRef names a value living on one worker, its *owner*. The owner keeps values in a
table keyed by a world-unique id ``(creator rank, counter)``. Other workers hold *user*
RRefs and fetch copies with ``to_here()`` or run methods on the owner through the proxies.

Protocol (all requests go through the agent, so they time out and fail like any call):

* ``REMOTE_CALL (id, func, args, kwargs)``: the owner runs ``func`` and stores the result
  under ``id``; the reply (``None`` or the error) tells the creator the owner has it.
* ``RREF_FETCH id``: the owner replies with the value once it exists. A fetch may arrive
  before the creating call (from another worker, or racing on the owner's pool), so the
  table hands out a placeholder future that the creating call later completes.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from rpcx import _context
from rpcx.agent import Deferred, RpcAgent, describe_callable
from rpcx.errors import RpcError
from rpcx.functions import async_execution, is_async_execution
from rpcx.futures import RpcFuture, add_internal_callback, wait
from rpcx.messages import MessageKind
from rpcx.serialization import EncodeContext, current_decode_context, register_extension
from rpcx.worker import WorkerInfo

__all__ = ["RRef", "create_remote", "install"]

T = TypeVar("T")
RRefId = tuple[int, int]
_SERVICE = "rref"


class _OwnerTable:
    """Values this worker owns, by RRef id."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._counter = itertools.count(1)
        self._lock = threading.Lock()
        self.values: dict[RRefId, torch.futures.Future[Any]] = {}

    def new_id(self) -> RRefId:
        return (self._rank, next(self._counter))

    def slot(self, rref_id: RRefId) -> torch.futures.Future[Any]:
        """The value future for ``rref_id``, created empty if it does not exist yet."""
        with self._lock:
            future = self.values.get(rref_id)
            if future is None:
                future = self.values[rref_id] = torch.futures.Future()
            return future


def _table(agent: RpcAgent) -> _OwnerTable:
    table: _OwnerTable = agent.services[_SERVICE]
    return table


class RRef(Generic[T]):
    """A reference to a value owned by one worker; see torch.distributed.rpc.RRef.

    ``RRef(value)`` wraps a local value: this worker becomes its owner. RRefs returned by
    :func:`rpcx.remote` or received in a call refer to values elsewhere.
    """

    _agent: RpcAgent
    _id: RRefId
    _owner: WorkerInfo
    _created: RpcFuture[Any] | None

    def __init__(self, value: T, type_hint: type | None = None) -> None:
        agent = _context.current_agent()
        rref_id = _table(agent).new_id()
        _table(agent).slot(rref_id).set_result(value)
        self._bind(agent, rref_id, agent.info, None)

    @classmethod
    def _make(
        cls, agent: RpcAgent, rref_id: RRefId, owner: WorkerInfo, created: RpcFuture[Any] | None
    ) -> RRef[Any]:
        rref: RRef[Any] = cls.__new__(cls)
        rref._bind(agent, rref_id, owner, created)
        return rref

    def _bind(
        self, agent: RpcAgent, rref_id: RRefId, owner: WorkerInfo, created: RpcFuture[Any] | None
    ) -> None:
        self._agent = agent
        self._id = rref_id
        self._owner = owner
        self._created = created  # the remote() call that creates the value, if we made it
        self._confirmed = False  # set once a fetch succeeded: the owner has the value

    # ------------------------------------------------------------------- identity

    def is_owner(self) -> bool:
        """True on the worker that holds the value."""
        return self._owner.id == self._agent.rank

    def owner(self) -> WorkerInfo:
        """The owner's ``WorkerInfo``."""
        return self._owner

    def owner_name(self) -> str:
        """The owner's name."""
        return self._owner.name

    def confirmed_by_owner(self) -> bool:
        """True once the owner is known to hold this reference's value slot."""
        if self.is_owner():
            return True
        if self._confirmed:
            return True
        created = self._created
        return created is not None and created.done() and not _failed(created)

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{kind}(id={self._id}, owner={self._owner.name!r})"

    # ---------------------------------------------------------------------- values

    def local_value(self) -> T:
        """The value itself. Only the owner can call this."""
        if not self.is_owner():
            raise RpcError(
                f"local_value() called on worker {self._agent.name!r}, but this RRef is "
                f"owned by {self._owner.name!r}; use to_here() to fetch a copy"
            )
        value: T = wait(self._value_future())
        return value

    def to_here(self, timeout: float = -1.0) -> T:
        """Fetch a copy of the value (the value itself on the owner)."""
        if self.is_owner():
            return self.local_value()
        self._raise_if_creation_failed()
        value: T = _first_failure_or(self._created, self._fetch(timeout)).wait()
        self._confirmed = True
        return value

    def _fetch(self, timeout: float) -> RpcFuture[Any]:
        return self._agent.request(
            self._owner,
            MessageKind.RREF_FETCH,
            self._id,
            timeout=self._agent.timeout_for(timeout),
            api="to_here",
            target=self,
            describe_target=repr,
        )

    def _value_future(self) -> torch.futures.Future[Any]:
        return _table(self._agent).slot(self._id)

    def _raise_if_creation_failed(self) -> None:
        created = self._created
        if created is not None and created.done() and _failed(created):
            created.wait()  # raises the remote() error, which names the call and worker

    # --------------------------------------------------------------------- proxies

    def rpc_sync(self, timeout: float = -1.0) -> Any:
        """Proxy: ``rref.rpc_sync().method(*args)`` runs ``value.method`` on the owner."""
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = -1.0) -> Any:
        """Proxy: ``rref.rpc_async().method(*args)`` returns a future of the result."""
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = -1.0) -> Any:
        """Proxy: ``rref.remote().method(*args)`` returns an RRef to the result."""
        return _Proxy(self, "remote", timeout)

    def __reduce__(self) -> Any:
        raise RpcError("an RRef can only be pickled by rpcx while it is sent in a call")


def _first_failure_or(
    guard: torch.futures.Future[Any] | None, main: RpcFuture[Any]
) -> RpcFuture[Any]:
    """``main``'s outcome, unless ``guard`` (the creating call) fails first."""
    if guard is None or guard.done():
        return main
    result: RpcFuture[Any] = RpcFuture()
    lock = threading.Lock()

    def settle(done: torch.futures.Future[Any], from_guard: bool) -> None:
        try:
            value = done.wait()
        except BaseException as exc:
            with lock:
                if not result.done():
                    result.set_exception(exc)
            return
        if not from_guard:
            with lock:
                if not result.done():
                    result.set_result(value)

    add_internal_callback(guard, lambda f: settle(f, True))
    add_internal_callback(main, lambda f: settle(f, False))
    return result


def _failed(future: torch.futures.Future[Any]) -> bool:
    try:
        future.value()
    except BaseException:
        return True
    return False


class _Proxy:
    """What ``rref.rpc_sync()`` / ``rpc_async()`` / ``remote()`` return."""

    def __init__(self, rref: RRef[Any], api: str, timeout: float) -> None:
        self._rref = rref
        self._api = api
        self._timeout = timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        rref, api, timeout = self._rref, self._api, self._timeout

        def invoke(*args: Any, **kwargs: Any) -> Any:
            rref._raise_if_creation_failed()
            agent = rref._agent
            payload: tuple[Any, ...] = (_invoke_on_owner, (rref, name, args, kwargs), {})
            describe = _method_describer(name)
            if api == "remote":
                return create_remote(agent, rref._owner, _invoke_on_owner,
                                     (rref, name, args, kwargs), {}, timeout,
                                     target=rref, describe_target=describe)
            future = agent.request(
                rref._owner, MessageKind.CALL, payload,
                timeout=agent.timeout_for(timeout), api=api, target=rref,
                describe_target=describe,
            )
            return future.wait() if api == "rpc_sync" else future

        return invoke


def _method_describer(name: str) -> Callable[[Any], str]:
    return lambda rref: f"{rref!r}.{name}"


@async_execution
def _invoke_on_owner(
    rref: RRef[Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
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

    rref._value_future().add_done_callback(run)
    return result


def _forward(source: torch.futures.Future[Any], target: torch.futures.Future[Any]) -> None:
    try:
        target.set_result(source.wait())
    except BaseException as exc:
        target.set_exception(exc)


def create_remote(
    agent: RpcAgent,
    dst: WorkerInfo,
    func: Any,
    args: Any,
    kwargs: Any,
    timeout: float,
    *,
    target: Any = None,
    describe_target: Callable[[Any], str] = describe_callable,
) -> RRef[Any]:
    """Run ``func`` on ``dst`` and return an RRef to the result, owned by ``dst``."""
    rref_id = _table(agent).new_id()
    created = agent.request(
        dst,
        MessageKind.REMOTE_CALL,
        (rref_id, func, args, kwargs),
        timeout=agent.timeout_for(timeout),
        api="remote",
        target=func if target is None else target,
        describe_target=describe_target,
    )
    return RRef._make(agent, rref_id, dst, created)


def _handle_remote_call(agent: RpcAgent) -> Callable[[WorkerInfo, Any], Any]:
    def handle(caller: WorkerInfo, payload: Any) -> Any:
        rref_id, func, args, kwargs = payload
        slot = _table(agent).slot(rref_id)
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


def _handle_fetch(agent: RpcAgent) -> Callable[[WorkerInfo, Any], Any]:
    def handle(caller: WorkerInfo, rref_id: Any) -> Any:
        return Deferred(_table(agent).slot(tuple(rref_id)))

    return handle


def _reduce_rref(rref: RRef[Any], ctx: EncodeContext) -> Any:
    return (_rebuild_rref, (rref._id, rref._owner.id, rref._owner.name))


def _rebuild_rref(rref_id: RRefId, owner_rank: int, owner_name: str) -> RRef[Any]:
    agent: RpcAgent = current_decode_context().agent
    return RRef._make(agent, (rref_id[0], rref_id[1]), WorkerInfo(owner_name, owner_rank), None)


register_extension(RRef, _reduce_rref)


def install(agent: RpcAgent) -> None:
    """Give ``agent`` an owner table and serve RRef requests."""
    agent.services[_SERVICE] = _OwnerTable(agent.rank)
    agent.register_handler(MessageKind.REMOTE_CALL, _handle_remote_call(agent))
    agent.register_handler(MessageKind.RREF_FETCH, _handle_fetch(agent))
