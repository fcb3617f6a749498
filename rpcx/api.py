"""The public call API, with torch.distributed.rpc's names, arguments and behaviour."""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from rpcx import hosts, rref
from rpcx._core import context as _context
from rpcx._core import joining
from rpcx._core.agent import RpcAgent
from rpcx._core.service_host import ServiceHost
from rpcx._services import calls
from rpcx._services.calls import (  # (the public API's, defined with the call service)
    rpc_async,
    rpc_sync,
)
from rpcx._util import cpp_log as _cpp_log
from rpcx._wire import auth
from rpcx._wire.keyed import keyed
from rpcx._world import enrollment
from rpcx._world.membership_events import MembershipChange
from rpcx.autograd import service as autograd_service
from rpcx.errors import RpcError, RpcShutdownError
from rpcx.messages import LEAVING_AT_EXIT
from rpcx.options import RpcBackendOptions, as_backend_options, as_rpcx_options
from rpcx.registry import BackendSpec, resolve_backend
from rpcx.tracing import session as trace_session
from rpcx.worker import WorkerInfo, validate_worker_name

__all__ = [
    "UNSET_RPC_TIMEOUT",
    "debug_info",
    "get_rpc_timeout",
    "get_worker_info",
    "get_worker_infos",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]

log = logging.getLogger("rpcx")

T = TypeVar("T")
UNSET_RPC_TIMEOUT = calls.UNSET_RPC_TIMEOUT
"""A call's ``timeout`` when not given: the worker's default (``rpc_timeout``) applies."""
_atexit_lock = threading.Lock()
_atexit_registered = False
_exposure_warned = False  # the no-authentication warning is given once per process
# How each in-process worker joined: its in-process store is released at its shutdown.
_joined: weakref.WeakKeyDictionary[ServiceHost, joining.Joined] = weakref.WeakKeyDictionary()


def is_available() -> bool:
    """True: rpcx works wherever torch.distributed does."""
    import torch.distributed

    return bool(torch.distributed.is_available())


def init_rpc(
    name: str,
    backend: object = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: object = None,
) -> None:
    """Join the RPC world as worker ``name``; returns once every worker has joined.

    Args:
        name: unique worker name (letters, digits, ``_``, ``-``, ``:``; under 128 chars).
        backend: backend name (``"auto"``, ``"gloo"``, ``"loopback"``, a plugin's name) or a
            ``BackendType``; ``None`` picks the backend ``rpcx.spawn`` was given, else
            ``$RPCX_BACKEND``, else the default (``auto``).
        rank: this worker's rank; ``-1`` reads ``$RANK`` with ``env://``.
        world_size: number of workers; ``None`` reads ``$WORLD_SIZE`` with ``env://``,
            and without it joins a *dynamic world*: workers join (and may leave, with
            ``shutdown()``) one at a time, on every multi-process backend; see
            docs/guide/dynamic-worlds.md.
        rpc_backend_options: any options object; defaults to the backend's own type.
            ``init_method`` and ``rpc_timeout`` (also used as the bound on waiting for
            the other workers to join) apply to every backend. torch's own
            ``TensorPipeRpcBackendOptions`` and ``RpcBackendOptions`` are read into
            rpcx's (:func:`rpcx.options.as_rpcx_options`); options of another type
            than the backend's are copied into the backend's, the fields both have kept
            (:func:`rpcx.options.as_backend_options`).
    """
    validate_worker_name(name)
    spec = resolve_backend(backend, _context.spawn_backend.get())
    _check_not_initialized(name, spec)
    options = _options_for(spec, rpc_backend_options)
    key = auth.resolve_key(options)
    certificates = enrollment.resolve_certificates(options)
    if key is None and certificates is None:
        _warn_if_exposed(name, options.init_method, spec)
    _cpp_log.hold_back()  # (c10d's warnings, from the rendezvous on; see _cpp_log)
    try:
        _join(name, spec, options, rank, world_size, key, certificates)
    except BaseException:
        _cpp_log.let_through()
        raise


def _join(name: str, spec: BackendSpec, options: RpcBackendOptions, rank: int,
          world_size: int | None, key: bytes | None,
          certificates: enrollment.Certificates | None) -> None:
    """The rest of :func:`init_rpc`: join the world, start the worker, bind it here."""
    world = joining.join(name, spec, options, rank, world_size, key,
                         spawn_world=_context.spawn_world.get(), certificates=certificates)
    try:
        agent = RpcAgent(
            rank=world.rank,
            workers=world.workers,
            store=world.store,
            transport=(spec.factory() if world.guard is None
                       else keyed(spec.factory(), world.guard, world.admit_keys)),
            backend=spec.name,
            options=world.options,
            init_method=world.options.init_method,
            routes=world.routes,
            guard=world.guard,
            connection_auth=world.connection_auth,
            dynamic=world.dynamic,
        )
    except BaseException:
        world.leave()  # (the roster entry, the membership token, the in-process store)
        raise
    try:
        calls.install(agent)
        rref.install(agent)
        autograd_service.install(agent)
        agent.start()
        # Recording starts before the world is ready, so that each worker's first calls
        # find their callee recording too.
        trace_dir = world.options.trace_dir or os.environ.get("RPCX_TRACE")
        session = (trace_session.begin_session(trace_dir, agent=agent, sample=False)
                   if trace_dir else None)
        if world.dynamic is None:
            agent.barrier("ready", world.options.rpc_timeout or None)
            agent.watch_peers(world.options.rpc_timeout or None)
        # (a dynamic worker is ready once connected: every member admitted it)
    except BaseException:
        # Do not leave threads, connections, the roster or the in-process store behind.
        trace_session.discard_session(agent)
        with contextlib.suppress(Exception):
            agent.shutdown(graceful=False)
        world.leave()
        raise
    world.settle()
    _context.register(agent)
    if spec.capabilities.in_process:
        _context.bind_agent(agent)
        _joined[agent] = world  # shutdown() releases its in-process store
    else:
        _context.bind_agent(None)  # drop a stale in-process binding of this thread
        _context.set_process_agent(agent)
        _register_atexit()
    if session is not None:
        session.sample_clock()  # (now that every worker serves: the first sample)
    if world.dynamic is None:
        log.info("worker %r (rank %d of %d) joined on backend %r", name, world.rank,
                 world.world_size, spec.name)
    else:
        log.info("worker %r (rank %d) joined a dynamic world of %d on backend %r", name,
                 world.rank, len(agent.members()), spec.name)


def _options_for(spec: BackendSpec, given: object) -> RpcBackendOptions:
    """The options ``init_rpc`` runs with: ``given`` (validated) as the backend's own
    options type, or that type's defaults."""
    if given is None:
        options = spec.options_type()
    else:
        options = as_rpcx_options(given)
        options.validate()
        options = as_backend_options(options, spec.options_type)
    options.validate()
    return options


def _check_not_initialized(name: str, spec: BackendSpec) -> None:
    bound = _context.thread_agent()
    if bound is not None and bound.is_running:
        raise RpcError(
            f"init_rpc({name!r}): this thread is already worker {bound.name!r}; "
            "call rpcx.shutdown() first"
        )
    process_agent = _context.process_agent()
    if not spec.capabilities.in_process and process_agent is not None and process_agent.is_running:
        raise RpcError(
            f"init_rpc({name!r}): this process is already worker {process_agent.name!r}; "
            "call rpcx.shutdown() first"
        )


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Leave the RPC world.

    Graceful (the default): wait until this worker's own calls have finished and every
    other live worker has called ``shutdown`` too, then stop. A dead worker does not make
    this hang: it is skipped with a warning. ``timeout`` bounds the wait in seconds;
    ``0`` waits as long as peers are alive (as torch does), logging progress every 30 s.

    Non-graceful: fail this worker's pending calls and stop at once; peers see it leave.

    Calling it again once the worker has shut down does nothing. Raises
    ``RpcNotInitializedError`` only if this thread or process never started a worker.
    """
    try:
        agent = _context.current_agent()
    except RpcShutdownError as exc:
        log.debug("shutdown() again: %s", exc)  # already shut down: nothing to do
        return
    session = trace_session.session_of(agent)
    if session is not None:
        session.closing()
        if graceful and agent.is_running:
            session.sample_clock()  # (the last sample, while the world is still up)
    shut = agent.shutdown(graceful=graceful, timeout=timeout if timeout and timeout > 0 else None)
    trace_session.end_session(agent, sample=False)  # (its file, if it traced)
    if not shut:
        return
    world = _joined.pop(agent, None)
    if world is not None:
        world.leave()
    _cpp_log.let_through()
    # The thread stays bound to the (now shut down) worker, so later calls say so.
    log.info("worker %r shut down", agent.name)


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The ``WorkerInfo`` of ``worker_name``, or of this worker when omitted."""
    agent = _context.current_agent()
    if worker_name is None:
        return agent.info
    return agent.resolve(worker_name)


def get_worker_infos() -> list[WorkerInfo]:
    """Every worker of the world, in rank order (in a dynamic world: those in it now)."""
    return _context.current_agent().members()


def on_membership_change(callback: Callable[[MembershipChange], object]) -> Callable[[], None]:
    """Call ``callback(change)`` whenever a worker joins this worker's world, leaves it,
    or is lost; returns the function that stops the calls.

    ``change`` is a :class:`MembershipChange` (``kind``: ``"joined"``, ``"left"`` or
    ``"lost"``; the ``worker``; the ``reason``; the ``members`` after the change). The
    callbacks run one at a time, in the order the changes happened, on a thread of
    rpcx's with this worker bound: they may make calls. They stop when this worker
    shuts down. Changes before the call are not replayed: read
    :func:`get_worker_infos` after registering for the starting point.
    """
    return _context.current_agent().on_membership_change(callback)


def debug_info() -> dict[str, Any]:
    """What this worker holds and waits for, to find leaks and stuck calls.

    Keys: ``worker``, ``rank``, ``backend``, ``pending_calls`` (calls this worker made
    that have not completed), ``request_threads``, ``lost_peers`` (name: reason),
    ``lost_causes`` (name: the :class:`~rpcx.LostCause` value, e.g. ``"departed"``),
    ``unresponsive_peers`` (names of peers silent past ``heartbeat_timeout`` now), and
    ``rrefs``: ``owned`` (entries in the owner table), ``owned_values`` (those whose value
    exists), ``references_to_owned`` (references registered for them, on any worker),
    ``user_rrefs`` / ``owner_rrefs`` (live RRef objects here for values elsewhere / here),
    ``pending_forks`` and ``pending_deletes`` (reference bookkeeping not yet acknowledged);
    ``parked_confirmations`` (confirmations that arrived before their RRef, bounded);
    ``autograd``: ``contexts`` (distributed autograd contexts alive here),
    ``releasing`` (context releases this worker started that peers have not yet
    confirmed) and ``passes`` (local backward passes run here so far);
    ``authenticated`` (whether the world runs with a key), ``encrypted_peers`` (how many
    peers this worker encrypts its frames with: ``encrypt``) and ``refused_frames``
    (frames dropped because they failed authentication); ``resent_frames`` (copies of bookkeeping
    requests sent again because no answer came, on a transport that may lose frames);
    ``bytes_in_flight`` (peer name: bytes of calls to it not answered yet, where any) and
    ``calls_held_back`` (calls that had to wait for ``max_bytes_in_flight``);
    ``connected_peers`` (peers this worker has a connection to: all of them, unless the
    backend connects pairs on demand).
    Call it on another worker with ``rpcx.rpc_sync(name, rpcx.debug_info)``.
    """
    agent = _context.current_agent()
    return {
        "worker": agent.name,
        "rank": agent.rank,
        "backend": agent.backend,
        **agent.stats(),
        "rrefs": rref.service(agent).stats(),
        "autograd": autograd_service.service(agent).stats(),
    }


def get_rpc_timeout() -> float:
    """This worker's default call timeout in seconds (``0`` means none)."""
    return _context.current_agent().rpc_timeout


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Change this worker's default call timeout (torch has the same private helper)."""
    if rpc_timeout < 0:
        raise ValueError(f"rpc_timeout must be >= 0, got {rpc_timeout}")
    _context.current_agent().rpc_timeout = float(rpc_timeout)


def remote(
    to: str | int | WorkerInfo,
    func: Any,
    args: tuple[Any, ...] | list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> rref.RRef[Any]:
    """Run ``func`` on ``to`` and return at once an :class:`RRef` to the result.

    The value stays on ``to`` (its owner). Errors, including a timeout, surface on the
    RRef's next use (``to_here``, a proxy call).
    """
    agent = _context.current_agent()
    calls.check_callable(func)
    return rref.create_remote(
        agent, agent.resolve(to), func, tuple(args or ()), dict(kwargs or {}), timeout
    )


def _exposed_address(init_method: str, spec: BackendSpec) -> str | None:
    """The address beyond loopback a world set up across a network listens on: the
    local address towards a ``tcp://`` or ``env://`` rendezvous host that is not a
    loopback one; ``None`` otherwise.

    A ``file://`` world (what ``rpcx.launch`` and ``rpcx.spawn`` use on one host) is
    not reported, although gloo, zmq and tensorpipe then listen on the address the
    host name resolves to: docs/security.md says so.
    """
    if spec.capabilities.in_process:
        return None
    address = hosts.address_towards(init_method)
    if address is None or ipaddress.ip_address(address.split("%", 1)[0]).is_loopback:
        return None
    return address


def _warn_if_exposed(name: str, init_method: str, spec: BackendSpec) -> None:
    global _exposure_warned
    address = _exposed_address(init_method, spec)
    if address is None or _exposure_warned:
        return
    _exposure_warned = True
    log.warning(
        "worker %r runs without authentication: any process that can reach %s can "
        "make it run code, as with torch.distributed.rpc. Set %s to a shared secret on "
        "every worker (docs/security.md).", name, address, auth.AUTH_KEY_ENV)


def _shutdown_at_exit() -> None:
    agent = _context.process_agent()
    if agent is not None and agent.is_running:
        log.warning(
            "worker %r exits without rpcx.shutdown(); leaving without waiting for peers",
            agent.name,
        )
        agent.say_leaving(LEAVING_AT_EXIT)  # (peers say so, not "has shut down")
        agent.shutdown(graceful=False)
        trace_session.end_session(agent, sample=False)  # (a trace is most wanted then)


def _register_atexit() -> None:
    global _atexit_registered
    with _atexit_lock:
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True
