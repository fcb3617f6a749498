"""Rendezvous: finding the other workers through a torch.distributed ``Store``.

Multi-process backends use torch's rendezvous (``tcp://``, ``env://``, ``file://``); the
loopback backend uses an in-memory store shared by the threads of one process. rpcx
reaches the store only through :class:`~rpcx._world.store.BoundedStore`: every operation ends
by a deadline rpcx enforces itself, whatever the store or another worker is doing, and
waits poll quietly so they can notice dead peers and report progress.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from torch._C._distributed_c10d import FileStore, HashStore, TCPStore
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.rendezvous import _rendezvous_helper
from torch.distributed.rendezvous import rendezvous as torch_rendezvous

from rpcx._util.timer import remaining
from rpcx._wire.auth import AUTH_KEY_ENV, ValueSeal, is_sealed
from rpcx._world import sealed as _sealed
from rpcx._world import store_dial as _store_dial
from rpcx._world.store import BoundedStore
from rpcx.errors import AuthenticationError, RpcError, RpcTimeoutError

__all__ = [
    "all_gather",
    "barrier",
    "gather_names",
    "in_process_store",
    "join_world",
    "keep_if_file_store",
    "leave",
    "open_session",
    "open_store",
    "prefixed",
    "release_in_process_store",
]

log = logging.getLogger("rpcx.rendezvous")

_REPORT_EVERY = 30.0
PROBE_EVERY = 5.0  # seconds between probes of the workers a barrier still waits for
LEAVE_TIMEOUT = 10.0
# Saying "I left" gets this long even when shutdown's budget is spent: a live store
# answers in milliseconds, and rank 0 waits for the word.
_LEAVE_MOMENT = 0.1
_NO_LIMIT = timedelta(days=7)  # torch stores need a finite timeout; rpcx bounds its own calls

_hub_lock = threading.Lock()
_hub: dict[str, tuple[Any, int]] = {}  # world key -> (HashStore, users)


def open_store(
    init_method: str, rank: int, world_size: int | None, timeout: float | None
) -> BoundedStore:
    """Connect to (or host) the rendezvous store of ``init_method``.

    Rank 0 hosts a ``tcp://`` or ``env://`` store on the address the URL names only
    (torch's own handler listens on every interface, so ``tcp://127.0.0.1:port`` was
    reachable from other hosts), when that address is one of this host's.
    ``world_size`` ``None``: the store of a dynamic world (rank 0 hosts it, nobody waits
    for a count of workers), opened as torch opens one.
    """
    store_timeout = timedelta(seconds=timeout) if timeout else _NO_LIMIT
    of = f"of {world_size}" if world_size is not None else "(a dynamic world)"
    env_missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if init_method == "env://" and env_missing:
        if world_size == 1:
            # A world of one meets nobody: a private store, no address or port needed
            # (``init_rpc("solo", rank=0, world_size=1)`` in a notebook).
            private = HashStore()
            private.set_timeout(store_timeout)
            return BoundedStore(private, "a private in-memory store (a world of one)")
        raise RpcError(
            f"rendezvous at 'env://' for rank {rank} {of}: "
            f"{' and '.join(env_missing)} not set. Set MASTER_ADDR and MASTER_PORT to rank "
            "0's host and a free port (MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 for workers "
            "on this host), or pass init_method='tcp://HOST:PORT'; rpcx.spawn(...) and "
            "`rpcx launch` set them for you, and backend='loopback' needs none"
        )
    try:
        store = (_host_on_named_address(init_method, world_size or -1, store_timeout)
                 if rank == 0 else None)
        connect_timeout = store_timeout
        if store is None and rank != 0:
            # Wait for rank 0's store ourselves: torch's client retries past its timeout
            # (two tries and a pause between) and writes its retries to the terminal.
            connect_timeout = _await_store_host(init_method, rank, of, timeout)
        if store is None:
            # (torch's init_rpc opens a dynamic world's store through the helper too)
            store, _, _ = next(
                _rendezvous_helper(init_method, rank, None, timeout=connect_timeout)
                if world_size is None else
                torch_rendezvous(init_method, rank=rank, world_size=world_size,
                                 timeout=connect_timeout))
    except RpcError:
        raise
    except (RuntimeError, ValueError, OSError) as exc:
        raise RpcError(
            f"rendezvous at {init_method!r} failed for rank {rank} {of}: {exc}"
        ) from exc
    # Blocking store calls that rpcx does not make itself (a transport's address
    # exchange, gloo's process group) are bounded by the join timeout.
    store.set_timeout(store_timeout)
    keep_if_file_store(store)
    named = _named_address(init_method) if rank != 0 else None
    if named is None:
        return BoundedStore(store, _describe(init_method))
    return BoundedStore(store, _describe(init_method),
                        reopen=_store_dial.reopener(*named, store_timeout),
                        stalled=lambda: _store_dial.retransmitting(*named))


def keep_if_file_store(store: Any) -> None:
    """Never destroy ``store`` if it is (a view of) a FileStore; a transport calls this
    for each clone it makes of its store.

    A FileStore's destructor takes the file's lock with no timeout and without letting
    go of the GIL: dropped while a stopped worker holds that lock, it froze this whole
    process. Kept, the file stays when the world ends (torch removes it once every
    worker's store is gone, but asks ``file://`` users to remove it all the same), and
    a world can start on it again.
    """
    while isinstance(store, PrefixStore | _sealed.SealedStore):
        store = (store.inner if isinstance(store, _sealed.SealedStore)
                 else store.underlying_store)
    if isinstance(store, FileStore):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(store))


def _describe(init_method: str) -> str:
    """``init_method`` as errors name the store: env:// with the address it read."""
    if init_method.startswith("env://"):
        return (f"{init_method} ({os.environ.get('MASTER_ADDR', '?')}:"
                f"{os.environ.get('MASTER_PORT', '?')})")
    return init_method


def _host_on_named_address(init_method: str, world_size: int, timeout: timedelta) -> Any:
    """The store rank 0 hosts, listening on the URL's address alone; ``None`` where
    torch's handler must do it (another URL, options in the URL, torchelastic's agent
    store, a name with several addresses, or an address this host cannot bind: then
    torch listens on every interface, as before)."""
    named = _named_address(init_method)
    if named is None:
        return None
    host, port = named
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        if len({info[4][0] for info in found}) != 1:
            return None  # several addresses: workers may reach any of them
        family, kind, proto, _, address = found[0]
        listener = socket.socket(family, kind, proto)
    except OSError:
        return None
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(max(128, world_size))
    except OSError:  # not this host's address, or the port is taken (a store already)
        listener.close()
        return None
    # The store owns the descriptor from here, even when it fails (it closes it then).
    # It does not wait for the workers: join_world does, and names the ranks missing.
    descriptor = listener.detach()
    return TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                    multi_tenant=True, master_listen_fd=descriptor)


def _named_address(init_method: str) -> tuple[str, int] | None:
    """The host and port of the store of a ``tcp://`` URL or of ``env://``'s variables,
    where rpcx handles them itself; ``None`` where torch's handler must (options in the
    URL, torchelastic's agent store, no address)."""
    url = urlparse(init_method)
    if url.scheme == "tcp" and not url.query:
        host, port = url.hostname, url.port
    elif url.scheme == "env" and not url.query and not url.netloc:
        host, port_text = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
        port = int(port_text) if port_text.isdigit() else None
    else:
        return None
    if not host or not port or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    return host, port


def _await_store_host(init_method: str, rank: int, of: str, timeout: float | None) -> timedelta:
    """Wait until rank 0's store at ``init_method``'s address takes connections; return
    the store timeout left for the rest of the rendezvous.

    Raises :class:`~rpcx.errors.RpcTimeoutError` at ``timeout`` naming the address and
    what to check. A URL rpcx leaves to torch returns the whole timeout at once.
    """
    named = _named_address(init_method)
    if named is None:
        return timedelta(seconds=timeout) if timeout else _NO_LIMIT
    host, port = named
    started = time.monotonic()
    deadline = None if not timeout else started + timeout
    while True:
        until = time.monotonic() + _REPORT_EVERY  # (a progress line between dials)
        last = _store_dial.dial_until(host, port,
                                      until if deadline is None else min(deadline, until))
        if last is None:
            break
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise RpcTimeoutError(
                f"rendezvous at {_describe(init_method)} for rank {rank} {of}: no store "
                f"answered at {host}:{port} in {now - started:.1f} s ({last}). Is rank 0 "
                "running, and is that address rank 0's host as every worker can reach it? "
                "Check init_method (or MASTER_ADDR and MASTER_PORT) on every worker, and a "
                "firewall between them")
        log.info("rank %d waiting for the store at %s:%d (rank 0's) after %.0f s", rank,
                 host, port, now - started)
    left = remaining(deadline)
    return timedelta(seconds=max(left, 0.001)) if left is not None else _NO_LIMIT


def in_process_store(key: str) -> BoundedStore:
    """The in-memory store shared by every worker of the in-process world ``key``."""
    with _hub_lock:
        store, users = _hub.get(key, (None, 0))
        if store is None:
            store = HashStore()
            store.set_timeout(_NO_LIMIT)
        _hub[key] = (store, users + 1)
        return BoundedStore(store, f"the in-process store of world {key!r}")


def release_in_process_store(key: str) -> None:
    """Drop one user of an in-process store; the last one frees it."""
    with _hub_lock:
        store, users = _hub.get(key, (None, 0))
        if users <= 1:
            _hub.pop(key, None)
        else:
            _hub[key] = (store, users - 1)


def prefixed(store: BoundedStore, prefix: str, bound: float | None = None) -> Any:
    """The torch store under ``store`` seen through ``prefix/`` (every key starts with
    it), for what needs a real one: a transport's address exchange. Where ``store``
    carries the world key's seal, a :class:`~rpcx._world.sealed.SealedStore`: what goes
    through it is sealed, and a value that is not genuine is waited past (at most
    ``bound`` seconds; ``None``: for good)."""
    view = PrefixStore(prefix + "/", store.raw)
    if store.seal is None:
        return view
    return _sealed.SealedStore(view, store.seal, store.label(prefix + "/"), bound)


def join_world(
    store: BoundedStore, name: str, rank: int, world_size: int, timeout: float | None,
    seal: ValueSeal | None = None,
) -> tuple[BoundedStore, list[str]]:
    """Publish this worker's name, wait for every other, return (session store, names):
    :func:`open_session` then :func:`gather_names`."""
    session = open_session(store, name, rank, world_size, timeout)
    return session, gather_names(session, name, rank, world_size, timeout, seal)


def open_session(store: BoundedStore, name: str, rank: int, world_size: int,
                 timeout: float | None) -> BoundedStore:
    """Claim ``rank`` in the store's current session; that session's store view.

    Each ``init_rpc`` on a store starts a new *session* (its own key prefix), so a world
    can shut down and start again on the same rendezvous address.
    """
    joined = store.add("rpcx/joined", 1, timeout)
    session = store.prefixed(f"rpcx/s{(joined - 1) // world_size}")
    if session.add(f"rank/{rank}", 1, timeout) != 1:
        raise RpcError(f"init_rpc: rank {rank} was claimed twice (worker {name!r} came second)")
    return session


def gather_names(session: BoundedStore, name: str, rank: int, world_size: int,
                 timeout: float | None, seal: ValueSeal | None = None) -> list[str]:
    """Publish this worker's name in ``session``, wait for every other's; the names by
    rank (``RpcError`` if one is used twice). ``seal``: see :func:`all_gather`."""
    gathered = all_gather(
        session, "name", rank, world_size, name.encode(), timeout,
        what=f"init_rpc: worker {name!r} (rank {rank}) waiting for workers to join",
        seal=seal,
    )
    names = [value.decode() for value in gathered]
    seen: dict[str, int] = {}
    for r, other in enumerate(names):
        if other in seen:
            raise RpcError(
                f"init_rpc: worker name {other!r} is used by ranks {seen[other]} and {r}; "
                "names must be unique"
            )
        seen[other] = r
    return names


def all_gather(
    store: BoundedStore,
    tag: str,
    rank: int,
    world_size: int,
    value: bytes,
    timeout: float | None,
    *,
    what: str,
    seal: ValueSeal | None = None,
) -> list[bytes]:
    """Publish ``value`` under ``tag`` and return every rank's value, in rank order.

    ``what`` describes the wait in the error raised when some rank never publishes.
    With a ``seal`` (the world key) values are sealed, and one whose seal is not genuine
    raises :class:`~rpcx.errors.AuthenticationError` naming its rank; without one, a
    sealed value (a rank holding a key) raises it too.
    """
    if seal is not None:
        value = seal.seal(f"{tag}/{rank}", value)
    deadline = None if timeout is None else time.monotonic() + timeout
    _wait_for(
        store,
        [f"{tag}/{r}" for r in range(world_size)],
        deadline,
        is_gone=lambda r: False,
        what=what,
        describe=lambda ranks: "ranks " + ", ".join(map(str, ranks)),
        publish=(f"{tag}/{rank}", value),
    )
    values = store.multi_get([f"{tag}/{r}" for r in range(world_size)], remaining(deadline))
    return [_opened(seal, tag, rank, r, v) for r, v in enumerate(values)]


def _opened(seal: ValueSeal | None, tag: str, me: int, rank: int, value: bytes) -> bytes:
    """``value`` as published by ``rank``, checked against the world key (see all_gather)."""
    if seal is None:
        if is_sealed(value):
            raise AuthenticationError(
                f"init_rpc (rank {me}): authentication failed for rank {rank}: its {tag!r} "
                "value is "
                f"sealed with a key, but this worker has none; set {AUTH_KEY_ENV} (or "
                "the auth_key option) to the world's key on every worker"
            )
        return value
    opened = seal.open(f"{tag}/{rank}", value)
    if opened is None:
        raise AuthenticationError(
            f"init_rpc (rank {me}): authentication failed for rank {rank}: its {tag!r} value "
            "in the rendezvous store is not sealed with this worker's key (that worker was "
            f"started with another {AUTH_KEY_ENV}, or none, or something that is no "
            "worker wrote it)"
        )
    return opened


def barrier(
    store: BoundedStore,
    tag: str,
    rank: int,
    world_size: int,
    *,
    timeout: float | None,
    is_gone: Callable[[int], bool],
    describe: Callable[[list[int]], str],
    waiter: str,
    probe: Callable[[list[int]], None] | None = None,
) -> None:
    """Wait until every rank not known to be gone has called ``barrier`` with ``tag``.

    ``probe(missing)``, if given, runs every :data:`PROBE_EVERY` seconds with the ranks
    not there yet: a chance to find out that one of them is gone (``is_gone``), which a
    worker not connected to it would not otherwise learn."""
    _wait_for(
        store,
        [f"{tag}/{r}" for r in range(world_size)],
        None if timeout is None else time.monotonic() + timeout,
        is_gone=is_gone,
        what=f"worker {waiter!r} waiting at {tag!r} for",
        describe=describe,
        publish=(f"{tag}/{rank}", b"1"),
        probe=probe,
        sealed=True,
    )


def leave(
    store: BoundedStore,
    rank: int,
    world_size: int,
    is_gone: Callable[[int], bool],
    timeout: float = LEAVE_TIMEOUT,
) -> None:
    """Last step of shutdown: rank 0 may host the store, so it waits for the others to go.

    Never raises: a store that is gone or does not answer is logged, and shutdown ends.
    """
    deadline = time.monotonic() + timeout
    try:
        if rank != 0:
            _sealed.publish(store, f"left/{rank}", b"1", max(timeout, _LEAVE_MOMENT))
        else:  # (publishes its own word first)
            _wait_for(
                store,
                [f"left/{r}" for r in range(world_size)],
                deadline,
                is_gone=is_gone,
                what="rank 0 waiting for workers to leave",
                describe=lambda ranks: ", ".join(map(str, ranks)),
                publish=(f"left/{rank}", b"1"),
                sealed=True,
            )
    except Exception as exc:  # the store host may already be gone; nothing left to do
        log.debug("leaving the rendezvous store: %s", exc)


def _wait_for(
    store: BoundedStore,
    keys: list[str],
    deadline: float | None,
    *,
    is_gone: Callable[[int], bool],
    what: str,
    describe: Callable[[list[int]], str],
    publish: tuple[str, bytes] | None = None,
    probe: Callable[[list[int]], None] | None = None,
    sealed: bool = False,
) -> None:
    """Set ``publish`` (a key and its value) if given, then wait until every
    ``keys[rank]`` exists or its rank is gone; keys are per rank. ``deadline``: a
    ``time.monotonic()`` value, ``None`` for none.

    ``sealed``: where the store view carries the world key's seal, ``publish`` is sealed
    and a key counts only once its value is genuine (a stray client's value is ignored,
    logged, and waited past; this worker's own, if overwritten, is published again)."""
    started = time.monotonic()
    next_report = started + _REPORT_EVERY

    def report(missing: list[int]) -> None:
        nonlocal next_report
        if probe is not None and missing:
            probe(missing)
        now = time.monotonic()
        if now >= next_report:
            log.info("%s: still missing %s after %.0f s", what, describe(missing), now - started)
            next_report = now + _REPORT_EVERY

    checked = sealed and store.seal is not None
    try:
        if publish is not None:
            if sealed:
                _sealed.publish(store, *publish, timeout=remaining(deadline))
            else:
                store.set(*publish, timeout=remaining(deadline))
        pause = _FORGED_POLL
        while True:
            missing = store.wait_for(keys, deadline, skip=is_gone, on_poll=report,
                                     report_every=_REPORT_EVERY if probe is None
                                     else PROBE_EVERY)
            if missing or not checked:
                break
            missing = _forged(store, keys, is_gone, deadline, publish)
            if not missing or (deadline is not None and time.monotonic() >= deadline):
                break
            time.sleep(pause)  # (the genuine value is written over the forged one)
            pause = min(pause * 2, _FORGED_POLL_MAX)
    except RpcError as exc:  # the store itself failed or did not answer
        raise type(exc)(f"{what}: {exc}") from exc
    if missing:
        raise RpcTimeoutError(f"{what}: gave up after {time.monotonic() - started:.1f} s; "
                              f"missing: {describe(missing)}")


_FORGED_POLL, _FORGED_POLL_MAX = 0.005, 0.2
_LOOK_MIN = 0.05


def _forged(store: BoundedStore, keys: list[str], is_gone: Callable[[int], bool],
            deadline: float | None, publish: tuple[str, bytes] | None) -> list[int]:
    """The indices of ``keys`` (all there) whose values are not genuine, ranks gone
    aside (each logged once); this worker's own (``publish``) is published again."""
    indices = [i for i in range(len(keys)) if not is_gone(i)]
    if not indices:
        return []
    # (a look at the deadline still gets a moment: the store is slow, not gone)
    bound = None if deadline is None else max(deadline - time.monotonic(), _LOOK_MIN)
    values = _sealed.read(store, [keys[i] for i in indices], bound)
    forged = [i for i, value in zip(indices, values, strict=True) if value is None]
    if publish is not None and publish[0] in (keys[i] for i in forged):
        _sealed.publish(store, *publish, timeout=bound)
    return forged

