"""Remote references: :class:`RRef`, the type users hold, and ``remote()``.

An RRef names a value that lives on one worker, its *owner*. Other workers hold RRefs to
it, pass them around in calls, fetch copies with ``to_here()`` and run its methods on the
owner through the proxies. The owner keeps the value while any RRef to it exists
anywhere; :mod:`rpcx._services.rref_protocol` explains how (forks, announcements, deletions).

Requests (all through the agent, so they time out and fail like any call; the owner's
side is :mod:`rpcx._services.rref_requests`):

* ``REMOTE_CALL (id, fork, func, args, kwargs)``: the owner runs ``func`` and keeps the
  result under ``id``; the reply (``None`` or the error) tells the creator it is done.
* ``RREF_FETCH id``: the owner replies with the value once it exists.
* ``RREF_FORKS`` / ``RREF_DELETE`` / ``RREF_CONFIRM``: reference bookkeeping.
* ``RREF_CALL (id, name, args, kwargs)``: a proxy call, ``value.name(*args, **kwargs)``
  on the owner, run once the value exists.

Proxy calls (``rref.rpc_sync().m()``) send only the id: the caller's RRef stays alive
(the pending call holds it) until the reply, so the owner need not register a fork.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from rpcx._core import context as _context
from rpcx._core.service_host import CallLabel, ServiceHost, describe_callable
from rpcx._services.rref_fork import ForkId, ForkState, RRefId
from rpcx._services.rref_requests import SERVICE, install, invoke_on_owner, service
from rpcx._util.pool import blocking
from rpcx._wire.codec import (
    EncodeContext,
    ReduceError,
    current_decode_context,
    register_extension,
)
from rpcx.errors import RpcError, RpcShutdownError, RpcTimeoutError
from rpcx.futures import RpcFuture, add_internal_callback, wait, wait_done
from rpcx.messages import MessageKind
from rpcx.worker import WorkerInfo

__all__ = ["RRef", "create_remote", "install", "service"]

T = TypeVar("T")
_CONFIRM_WAIT = 60.0  # bound on waiting for an owner's confirmation when calls have none

log = logging.getLogger("rpcx.rref")


class RRef(Generic[T]):
    """A reference to a value owned by one worker; see torch.distributed.rpc.RRef.

    ``RRef(value)`` wraps a local value: this worker becomes its owner. RRefs returned by
    :func:`rpcx.remote` or received in a call refer to values elsewhere. The value lives
    as long as any RRef to it exists on any worker.
    """

    _agent: ServiceHost
    _fork_state: ForkState
    _created: RpcFuture[Any] | None

    def __init__(self, value: T, type_hint: type | None = None) -> None:
        agent = _context.current_agent()
        rref_id, fork = service(agent).create_local(value)
        self._bind(agent, rref_id, agent.info, fork, None, confirmed=True)
        service(agent).register_object(self._fork_state)

    @classmethod
    def _make(
        cls,
        agent: ServiceHost,
        rref_id: RRefId,
        owner: WorkerInfo,
        fork: ForkId,
        created: RpcFuture[Any] | None,
        confirmed: bool,
    ) -> RRef[Any]:
        rref: RRef[Any] = cls.__new__(cls)
        rref._bind(agent, rref_id, owner, fork, created, confirmed)
        if service(agent).register_object(rref._fork_state):
            rref._fork_state.confirm()
        return rref

    def _bind(
        self,
        agent: ServiceHost,
        rref_id: RRefId,
        owner: WorkerInfo,
        fork: ForkId,
        created: RpcFuture[Any] | None,
        confirmed: bool,
    ) -> None:
        self._agent = agent
        self._fork_state = ForkState(rref_id, owner, fork, confirmed)
        self._created = created  # the remote() call that creates the value, if we made it
        if not confirmed and created is not None:
            add_internal_callback(created, self._on_created)

    def __del__(self) -> None:
        try:
            svc = self._agent.services.get(SERVICE)
            state = self._fork_state
            if svc is not None:
                svc.schedule_delete(state.owner, state.rref_id, state.fork)
        except Exception:  # interpreter shutdown, half-built object: nothing to release
            pass

    @property
    def _id(self) -> RRefId:
        return self._fork_state.rref_id

    @property
    def _owner(self) -> WorkerInfo:
        return self._fork_state.owner

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
        """True once the owner is known to have registered this reference."""
        return self._fork_state.confirmed

    def _wait_confirmed(self, timeout: float) -> bool:
        """Block until confirmed (for tests and debugging); False after ``timeout``."""
        return self._fork_state.wait(timeout)

    def _await_confirmation(self) -> None:
        """Before a request that carried this RRef runs: wait for the owner's word.

        As in torch, a function receiving an RRef that a third worker forked runs once
        the owner has confirmed it, so ``confirmed_by_owner()`` is true inside it. The
        owner was told before the request left, so the wait is about one message. It is
        bounded (the default RPC timeout) and ends at once if the owner is lost; the
        call then runs with the RRef unconfirmed.
        """
        if self._fork_state.settled:
            return
        bound = self._agent.timeout_for(None) or _CONFIRM_WAIT
        with blocking():
            confirmed = self._fork_state.wait_settled(bound)
        if not confirmed:
            log.warning("%s: %r not confirmed by its owner within %g s; running the call "
                        "that carried it anyway", self._agent.name, self, bound)

    def _on_created(self, created: torch.futures.Future[Any]) -> None:
        if not _failed(created):
            self._fork_state.confirm()

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self.is_owner() else "UserRRef"
        return f"{kind}(id={self._id}, owner={self._owner.name!r})"

    # ---------------------------------------------------------------------- values

    def local_value(self) -> T:
        """The value itself. Only the owner can call this."""
        self._check_usable("local_value")
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
        self._check_usable("to_here")
        self._raise_if_creation_failed()
        bound = self._agent.timeout_for(timeout)
        try:
            value: T = _first_failure_or(self._created, self._fetch(timeout)).wait()
        except RpcTimeoutError:
            self._raise_if_creation_failed()  # remote()'s own timeout names the call
            raise  # this to_here's timeout: it is not extended by waiting for remote()
        except BaseException:
            # The owner may report a failed remote() before its reply reaches us; wait
            # for that reply (within this to_here's timeout) so its error, naming the
            # call, is the one raised, now and on every later use of this RRef.
            if self._created is not None and not self._created.done():
                wait_done(self._created, bound)
            self._raise_if_creation_failed()
            raise
        self._fork_state.confirm()  # the owner answered for this reference
        return value

    def _fetch(self, timeout: float) -> RpcFuture[Any]:
        return self._agent.request(
            self._owner,
            MessageKind.RREF_FETCH,
            self._id,
            timeout=self._agent.timeout_for(timeout),
            label=CallLabel("to_here", self, repr),
        )

    def _value_future(self) -> torch.futures.Future[Any]:
        return service(self._agent).slot(self._id)

    def _raise_if_creation_failed(self) -> None:
        created = self._created
        if created is not None and created.done() and _failed(created):
            created.wait()  # raises the remote() error, which names the call and worker

    def _check_usable(self, what: str) -> None:
        if not self._agent.is_running:
            raise RpcShutdownError(
                f"{what}() on {self!r}: worker {self._agent.name!r} has shut down"
            )

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

    def _get_profiling_future(self) -> torch.futures.Future[Any]:
        """torch's name for the future of the ``remote()`` call that made this RRef: its
        profiler span has ended once it completes (a completed future for other RRefs)."""
        if self._created is not None:
            return self._created
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(None)
        return done

    def _get_future(self) -> torch.futures.Future[Any]:
        """The future of the ``remote()`` call that created this RRef (as torch's)."""
        if self._created is not None:
            return self._created
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(None)
        return done

    def _get_type(self, timeout: float = -1.0, blocking: bool = True) -> type:
        """The type of the value (fetched from the owner if needed), as torch's."""
        if self.is_owner():
            return type(self.local_value())
        return type(self.to_here(timeout))

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run backward from this RRef's value (a scalar tensor).

        With a distributed autograd context id, the distributed pass starts on the owner
        and the gradients land in that context on every worker that took part. Without
        one (``-1``), a local ``value.backward()`` runs, which only the owner can do.
        """
        if dist_autograd_ctx_id == -1:
            if not self.is_owner():
                raise RuntimeError(
                    "User RRefs require 'dist_autograd_ctx_id' to be specified: "
                    "RRef.backward() without a context id runs a local backward pass, so it "
                    f"must be called on the owner {self._owner.name!r}; pass "
                    "dist_autograd_ctx_id to run a distributed pass from here"
                )
            root = _tensor_for_backward(self.local_value())
            torch.autograd.backward([root], retain_graph=retain_graph)
            return
        self._check_usable("backward")
        self._raise_if_creation_failed()
        future = self._agent.request(
            self._owner, MessageKind.CALL,
            (_backward_on_owner, (self, dist_autograd_ctx_id, retain_graph), {}),
            timeout=self._agent.timeout_for(None), label=CallLabel("RRef.backward", self, repr),
        )
        wait(future)

    def __reduce__(self) -> Any:
        raise RpcError("an RRef can only be pickled by rpcx while it is sent in a call")


def _backward_on_owner(rref: RRef[Any], context_id: int, retain_graph: bool) -> None:
    from rpcx import autograd  # the autograd service sits beside this one

    root = _tensor_for_backward(rref.local_value())
    autograd.backward(context_id, [root], retain_graph=retain_graph)


def _tensor_for_backward(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(
            f"RRef should contain a tensor for .backward(), but it holds a "
            f"{type(value).__qualname__}"
        )
    return value


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

    def __getattr__(self, name: str) -> _ProxyMethod:
        return _ProxyMethod(self._rref, self._api, self._timeout, name)


class _ProxyMethod:
    """``rref.rpc_sync().name``: calling it runs ``name`` on the owner's value.

    An object rather than a closure so that it pickles: torch programs pass it as the
    function of another call (the RPC tutorial's agent runs
    ``rpc_async(ob_rref.owner(), ob_rref.rpc_sync().run_episode, args=...)``), and the
    worker that receives it calls the owner from there, as torch's proxy does.
    """

    __slots__ = ("api", "name", "rref", "timeout")

    def __init__(self, rref: RRef[Any], api: str, timeout: float, name: str) -> None:
        self.rref = rref
        self.api = api
        self.timeout = timeout
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rref, api, timeout, name = self.rref, self.api, self.timeout, self.name
        rref._check_usable(f"{api} proxy")
        rref._raise_if_creation_failed()
        agent = rref._agent
        describe = _method_describer(name)
        call_args = (rref._id, name, args, kwargs)
        if api == "remote":
            return create_remote(agent, rref._owner, invoke_on_owner, call_args, {},
                                 timeout, target=rref, describe_target=describe)
        future = agent.request(
            rref._owner, MessageKind.RREF_CALL, call_args,
            timeout=agent.timeout_for(timeout), label=CallLabel(api, rref, describe),
        )
        return future.wait() if api == "rpc_sync" else future

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ProxyMethod, (self.rref, self.api, self.timeout, self.name))

    def __repr__(self) -> str:
        return f"<{self.api} proxy method {self.name!r} of {self.rref!r}>"


def _method_describer(name: str) -> Callable[[Any], str]:
    return lambda rref: f"{rref!r}.{name}"


def create_remote(
    agent: ServiceHost,
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
    svc = service(agent)
    rref_id, fork = svc.new_id(), svc.new_id()
    created = agent.request(
        dst,
        MessageKind.REMOTE_CALL,
        (rref_id, fork, func, args, kwargs),
        timeout=agent.timeout_for(timeout),
        label=CallLabel("remote", func if target is None else target, describe_target),
    )
    return RRef._make(agent, rref_id, dst, fork, created, confirmed=dst.id == agent.rank)


# -------------------------------------------------------------------------- codec


def _reduce_rref(rref: RRef[Any], ctx: EncodeContext) -> Any:
    agent = rref._agent
    if not agent.is_running:
        raise ReduceError(RpcShutdownError(
            f"cannot send {rref!r}: worker {agent.name!r} has shut down"
        ))
    created = rref._created
    if created is not None and created.done() and _failed(created):
        try:
            created.wait()
        except BaseException as exc:  # the remote() failure, naming its call and worker
            raise ReduceError(exc) from None
    svc = service(agent)
    fork = svc.new_id()
    holder = ctx.peer  # (the hook must not refer to ctx, which holds the hook)
    if holder == rref._owner.id and holder != agent.rank:
        # Sent to its owner: the announcement rides in the frame itself and is handled
        # in order as it arrives, before anything sent later (a deletion of ``rref``'s
        # own fork, say), so ``rref`` need only live until the frame is sent.
        ctx.notes.append((MessageKind.RREF_FORKS, [(rref._id, fork, holder, rref._owner.name)]))
        ctx.keep_alive.append(rref)
    else:
        # Announce the fork before the frame leaves, holding ``rref`` (so its own fork)
        # alive until then; see rpcx._services.rref_protocol for why that order makes early frees
        # impossible.
        ctx.before_send.append(lambda: svc.announce(rref, fork, holder))
    return (
        _rebuild_rref,
        (rref._id, rref._owner.id, rref._owner.name, fork, rref._owner.id == agent.rank),
    )


def _rebuild_rref(
    rref_id: RRefId, owner_rank: int, owner_name: str, fork: ForkId, from_owner: bool
) -> RRef[Any]:
    ctx = current_decode_context()
    agent: ServiceHost = ctx.agent
    confirmed = from_owner or owner_rank == agent.rank
    owner = agent.workers[owner_rank] if 0 <= owner_rank < agent.world_size else None
    if owner is None or owner.name != owner_name:
        owner = WorkerInfo(owner_name, owner_rank)
    rref = RRef._make(agent, (rref_id[0], rref_id[1]), owner, (fork[0], fork[1]), None,
                      confirmed)
    if not rref._fork_state.settled:  # forked by a third worker: the owner confirms
        if ctx.before_serve is None:
            ctx.before_serve = []
        ctx.before_serve.append(rref._await_confirmation)
    return rref


register_extension(RRef, _reduce_rref)
