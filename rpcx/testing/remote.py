"""Functions and classes the conformance suite runs on other workers.

They live in the package so every worker process can import them.
"""

from __future__ import annotations

import os
import pickle
import select
import threading
from typing import Any

import torch

import rpcx
from rpcx.errors import UnknownWorkerError
from rpcx.functions import async_execution


def _torch_async_execution(fn: Any) -> Any:
    """torch's ``@rpc.functions.async_execution`` (``fn`` unchanged without torch RPC)."""
    try:
        from torch.distributed.rpc import functions as torch_functions
    except ImportError:  # a torch build without its RPC package
        return fn
    return torch_functions.async_execution(fn)  # type: ignore[no-untyped-call]

# ------------------------------------------------------------------------------ plain


def add(a: Any, b: Any) -> Any:
    """``a + b``."""
    return a + b


def echo(value: Any) -> Any:
    """Return the argument unchanged."""
    return value


def echo_kwargs(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Return positional and keyword arguments."""
    return args, kwargs


def worker_name() -> str:
    """The name of the worker this runs on."""
    return rpcx.get_worker_info().name


_events_lock = threading.Lock()
_events: dict[str, threading.Event] = {}


def _event(key: str) -> threading.Event:
    with _events_lock:
        return _events.setdefault(key, threading.Event())


def wait_for_event(key: str, timeout: float) -> bool:
    """Block on a plain ``threading.Event`` (a wait rpcx cannot see) until
    :func:`set_event` sets ``key`` or ``timeout`` passes; whether it was set."""
    return _event(key).wait(timeout)


def set_event(key: str) -> str:
    """Set the event ``key`` that :func:`wait_for_event` blocks on; returns this worker."""
    _event(key).set()
    return rpcx.get_worker_info().name


def spin(seconds: float) -> float:
    """Busy-loop in Python for ``seconds`` (a long handler that never waits)."""
    import time

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return seconds


def mutate_and_return(tensor: torch.Tensor) -> torch.Tensor:
    """Add 1 in place to the received tensor and return it."""
    tensor.add_(1)
    return tensor


def tensor_sum(tensor: torch.Tensor) -> float:
    """The sum of a received tensor."""
    return float(tensor.sum())


def same_object(a: Any, b: Any) -> bool:
    """Whether the two arguments arrived as one object."""
    return a is b


def describe_tensor(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bool, str]:
    """dtype, shape, requires_grad and Python type of a received tensor."""
    return str(tensor.dtype), tuple(tensor.shape), tensor.requires_grad, type(tensor).__name__


def active_threads() -> int:
    """Number of threads alive on this worker."""
    return threading.active_count()


class Static:
    """Holds a static method for calls by qualified name."""

    @staticmethod
    def triple(x: Any) -> Any:
        """``3 * x``."""
        return 3 * x

    @staticmethod
    @async_execution
    def async_triple(x: Any) -> torch.futures.Future[Any]:
        """``3 * x``, from an already completed future."""
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(3 * x)
        return future


# ---------------------------------------------------------------------------- nesting


def chain(path: list[str], value: int) -> tuple[int, list[str]]:
    """Call the next worker of ``path`` with ``value + 1``; return the value and the route."""
    me = rpcx.get_worker_info().name
    if not path:
        return value, [me]
    result, route = rpcx.rpc_sync(path[0], chain, args=(path[1:], value + 1))
    return result, [me, *route]


def ping_pong(depth: int, a: str, b: str) -> int:
    """Bounce between workers ``a`` and ``b`` ``depth`` times, each hop blocking on the next."""
    if depth == 0:
        return 0
    me = rpcx.get_worker_info().name
    other = b if me == a else a
    return 1 + int(rpcx.rpc_sync(other, ping_pong, args=(depth - 1, a, b)))


@async_execution
def async_add_via(to: str, a: Any, b: Any) -> torch.futures.Future[Any]:
    """``a + b + 1``: adds on ``to`` without holding a thread here while waiting."""
    return rpcx.rpc_async(to, add, args=(a, b)).then(lambda fut: fut.wait() + 1)


def _torch_async_add_via(to: str, a: Any, b: Any) -> torch.futures.Future[Any]:
    return rpcx.rpc_async(to, add, args=(a, b)).then(lambda fut: fut.wait() + 1)


# The same, decorated with torch's own decorator (as unported programs do).
torch_async_add_via = _torch_async_execution(_torch_async_add_via)
torch_async_add_via.__qualname__ = torch_async_add_via.__name__ = "torch_async_add_via"


@async_execution
def async_returns_wrong_type() -> Any:
    """Breaks the @async_execution contract."""
    return 42


# ----------------------------------------------------------------------- blocking calls

_gates: dict[str, threading.Event] = {}
_gates_lock = threading.Lock()


def _gate(key: str) -> threading.Event:
    with _gates_lock:
        return _gates.setdefault(key, threading.Event())


def wait_for_release(key: str, bound: float = 30.0) -> bool:
    """Block until :func:`release` is called with ``key`` (at most ``bound`` seconds)."""
    return _gate(key).wait(bound)


def release(key: str) -> None:
    """Let every :func:`wait_for_release` with ``key`` return."""
    _gate(key).set()


def gated_numel(key: str, tensor: torch.Tensor) -> int:
    """Count an arrival in tally ``key`` and, in tally ``key + "/peak"``, the most calls
    of ``key`` held here at once; wait for :func:`release` of ``key``; return the
    tensor's element count."""
    with _tallies_changed:
        _tallies[key] = _tallies.get(key, 0) + 1
        live = _tallies[key] - _tallies.get(f"{key}/left", 0)
        _tallies[f"{key}/peak"] = max(_tallies.get(f"{key}/peak", 0), live)
        _tallies_changed.notify_all()
    try:
        wait_for_release(key)
        return tensor.numel()
    finally:
        tally(f"{key}/left")


class SlowToPickle:
    """A value whose pickling (sending it anywhere) waits for :func:`release` of ``key``."""

    def __init__(self, key: str, bound: float = 30.0) -> None:
        self.key = key
        self.bound = bound

    def __reduce__(self) -> Any:
        wait_for_release(self.key, self.bound)
        return (SlowToPickle, (self.key, self.bound))


# ---------------------------------------------------------------------------- errors


class CustomError(Exception):
    """An exception type every worker can import, so it can be rebuilt."""


class UnrebuildableError(Exception):
    """Its ``__init__`` takes two arguments, so pickle cannot recreate it from ``args``."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(f"{what}: {detail}")


def raise_value_error(message: str) -> None:
    """Raise ``ValueError(message)``."""
    raise ValueError(message)


def raise_custom(message: str) -> None:
    """Raise :class:`CustomError`."""
    raise CustomError(message)


def raise_unrebuildable() -> None:
    """Raise an exception the caller cannot rebuild."""
    raise UnrebuildableError("broken", "cannot be rebuilt")


def unpicklable_result() -> Any:
    """Return something pickle refuses."""
    return threading.Lock()


class UnloadableOnCallee:
    """Pickles as a reference to a module that no worker has, like a missing function."""

    def __reduce__(self) -> Any:
        return (__import__, ("rpcx_testing_module_that_does_not_exist",))

    def __call__(self) -> None:  # callable, so the API accepts it
        """Never runs: unpickling fails first."""


def _refuse_to_rebuild() -> None:
    raise RuntimeError("refuses to be rebuilt on the callee")


class FailsToRebuild:
    """Pickles fine but raises while being unpickled, like a broken ``__setstate__``."""

    def __reduce__(self) -> Any:
        return (_refuse_to_rebuild, ())


class Gate:
    """A one-shot signal that works across processes: a named pipe, opened by a write.

    Tests use it to hold a worker at a chosen point (say, inside an unpickler) until the
    caller has done what must happen first, instead of hoping the timing works out.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        os.mkfifo(path)
        # Hold a read end so the write below never blocks and its byte stays buffered
        # for a waiter that opens the pipe later.
        self._keep = os.open(path, os.O_RDONLY | os.O_NONBLOCK)

    def open(self) -> None:
        """Let every present and future waiter through."""
        fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)

    def close(self) -> None:
        """Release the pipe (waiters still blocked time out)."""
        os.close(self._keep)
        os.unlink(self.path)


def wait_for_gate(path: str, timeout: float) -> bool:
    """Block until the :class:`Gate` at ``path`` opens; False if ``timeout`` ran out."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
        return bool(readable)
    finally:
        os.close(fd)


def _refuse_to_rebuild_after(gate_path: str) -> None:
    if not wait_for_gate(gate_path, 60.0):
        raise RuntimeError("the test never opened the gate")
    _refuse_to_rebuild()


class FailsToRebuildAfterGate:
    """Like :class:`FailsToRebuild`, but the unpickler first waits for a :class:`Gate`."""

    def __init__(self, gate: Gate) -> None:
        self.gate_path = gate.path

    def __reduce__(self) -> Any:
        return (_refuse_to_rebuild_after, (self.gate_path,))


def device_and_double(tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Where the argument arrived, and twice it (on that device)."""
    return str(tensor.device), tensor * 2


def cuda_ones(size: int, index: int) -> torch.Tensor:
    """``torch.ones(size)`` made on ``cuda:index`` of this worker."""
    return torch.ones(size, device=torch.device("cuda", index))


# ------------------------------------------------------------------------------ RRefs


class Counter:
    """A stateful object to hold behind an RRef."""

    def __init__(self, start: int = 0) -> None:
        self.count = start

    def increment(self, by: int = 1) -> int:
        """Add ``by``; return the new count."""
        self.count += by
        return self.count

    def value(self) -> int:
        """The current count."""
        return self.count

    def _torch_async_double(self) -> torch.futures.Future[int]:
        return rpcx.rpc_async(rpcx.get_worker_info(), add, args=(self.count, self.count))

    torch_async_double = _torch_async_execution(_torch_async_double)

    @async_execution
    def async_double(self) -> torch.futures.Future[int]:
        """``2 * count``, through a future."""
        future: torch.futures.Future[int] = torch.futures.Future()
        future.set_result(2 * self.count)
        return future

    def fail(self) -> None:
        """Raise ``KeyError``."""
        raise KeyError("counter failure")

    def wait_for_release(self, key: str, bound: float = 30.0) -> bool:
        """Block like :func:`wait_for_release` (a method that takes its time)."""
        return wait_for_release(key, bound)


def make_rref(value: Any) -> rpcx.RRef[Any]:
    """Create an RRef owned by this worker and return it to the caller."""
    return rpcx.RRef(value)


def rref_to_here_error(rref: rpcx.RRef[Any], timeout: float) -> str:
    """``to_here`` that is expected to fail: the error's type name and message."""
    try:
        rref.to_here(timeout=timeout)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def rref_to_here(rref: rpcx.RRef[Any]) -> Any:
    """Fetch the RRef's value on this worker."""
    return rref.to_here()


def rref_info(rref: rpcx.RRef[Any]) -> tuple[str, bool]:
    """Owner name and whether this worker owns it."""
    return rref.owner_name(), rref.is_owner()


def call_with(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on this worker (``fn`` came over the wire, a proxy method say)."""
    return fn(*args)


def call_and_wait(fn: Any, *args: Any) -> Any:
    """``fn(*args).wait()`` on this worker: for callables that return a future."""
    return fn(*args).wait()


def rref_increment(rref: rpcx.RRef[Counter], by: int) -> int:
    """Increment a remote Counter from this worker through the proxy."""
    return int(rref.rpc_sync().increment(by))


def rref_local_value(rref: rpcx.RRef[Any]) -> Any:
    """Call local_value() here (fails unless this worker owns the RRef)."""
    return rref.local_value()


# --------------------------------------------------------------------------- failures


def call_error(to: str, fn: Any, *args: Any) -> tuple[str, str] | None:
    """Call ``fn(*args)`` on ``to`` from this worker: ``None`` if it succeeds, else the
    error's type name and message."""
    try:
        rpcx.rpc_sync(to, fn, args=args)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def call_all(names: list[str], gate: str | None = None, timeout: float = 30.0) -> int:
    """Call every worker of ``names`` but this one at once (after :func:`set_event` of
    ``gate``, if given); how many answered correctly."""
    if gate is not None and not _event(gate).wait(timeout):
        raise TimeoutError(f"gate {gate!r} not opened within {timeout:g} s")
    me = rpcx.get_worker_info().name
    others = [name for name in names if name != me]
    futures = [rpcx.rpc_async(name, add, args=(i, 1), timeout=timeout)
               for i, name in enumerate(others)]
    return sum(future.wait() == i + 1 for i, future in enumerate(futures))


def connected_peers() -> int:
    """How many peers this worker has a connection to (``debug_info``)."""
    return int(rpcx.debug_info()["connected_peers"])


def pairings() -> dict[str, int]:
    """An on-demand socket mesh's counts: connections this worker ``dialed`` and
    ``admitted``, and dials it ``refused`` because its own won."""
    return dict(_context_agent()._transport.pairings)


def thread_names() -> list[str]:
    """The names of this process's live threads."""
    import threading

    return [thread.name for thread in threading.enumerate()]


def crash_process(code: int = 3) -> None:
    """End this worker's process at once, as a crash would (no shutdown, no cleanup)."""
    import os

    os._exit(code)


# ---------------------------------------------------------------------- RRef lifetime


class Tracked:
    """A value whose live instances are counted per worker, to see when owners free it."""

    live = 0
    _lock = threading.RLock()  # __del__ may run inside __init__'s critical section

    def __init__(self, payload: Any = None) -> None:
        self.payload = payload
        with Tracked._lock:
            Tracked.live += 1

    def __del__(self) -> None:
        with Tracked._lock:
            Tracked.live -= 1

    def __reduce__(self) -> Any:
        return (Tracked, (self.payload,))  # copies are counted too

    def get(self) -> Any:
        """The payload."""
        return self.payload


def tracked_live() -> int:
    """How many Tracked values exist on this worker (after collecting garbage)."""
    import gc

    gc.collect()
    return Tracked.live


def rref_settle() -> dict[str, int]:
    """Collect garbage, send pending RRef deletions, wait for them; return the counts."""
    from rpcx import rref

    agent = _context_agent()
    rref.service(agent).flush()
    return rref.service(agent).stats()


def autograd_settle(timeout: float = 30.0) -> int:
    """Wait (``timeout`` seconds at most) until the context releases this worker started
    or passed on have reached every peer; how many peers were asked."""
    import rpcx.autograd as dist_autograd

    return dist_autograd._wait_released(timeout)


def _context_agent() -> Any:
    from rpcx._core import context as _context

    return _context.current_agent()


_held: dict[str, Any] = {}


def hold(key: str, value: Any) -> None:
    """Keep ``value`` (an RRef, say) alive on this worker under ``key``."""
    _held[key] = value


def drop(key: str) -> None:
    """Forget what :func:`hold` kept."""
    _held.pop(key, None)


def held_to_here(key: str) -> Any:
    """``to_here()`` of the RRef held under ``key``."""
    return _held[key].to_here()


def forward(rref: rpcx.RRef[Any], path: list[str], expected: Any) -> list[str]:
    """Check the value here, then pass the RRef on along ``path``; return the route."""
    me = rpcx.get_worker_info().name
    value = rref.to_here()
    if value != expected:
        raise AssertionError(f"{me}: expected {expected!r}, got {value!r}")
    if not path:
        return [me]
    return [me, *rpcx.rpc_sync(path[0], forward, args=(rref, path[1:], expected))]


def wait_confirmed(rref: rpcx.RRef[Any], timeout: float = 30.0) -> bool:
    """Whether the owner confirms this worker's reference within ``timeout``."""
    return rref._wait_confirmed(timeout)


def wrap_in_rref(value: Any) -> rpcx.RRef[Any]:
    """An RRef owned here whose value is ``value`` (an RRef makes an RRef of RRefs)."""
    return rpcx.RRef(value)


def unwrap_twice(outer: rpcx.RRef[Any]) -> Any:
    """``outer.to_here().to_here()``: the value behind an RRef of RRefs."""
    return outer.to_here().to_here()


def fan_out_and_check(rref: rpcx.RRef[Any], workers: list[str], expected: Any) -> int:
    """Fork ``rref`` to every worker at once; each checks the value. Returns the count."""
    futures = [rpcx.rpc_async(w, forward, args=(rref, [], expected)) for w in workers]
    return len([f.wait() for f in futures])


def stress_hop(rref: rpcx.RRef[Any], expected: int, hops: list[str]) -> int:
    """One step of the stress test: verify, maybe create a new value, pass on, drop."""
    value = rref.to_here()
    if value != expected:
        raise AssertionError(f"premature or wrong value: {value!r} != {expected!r}")
    if not hops:
        return 1
    # Hand the RRef on asynchronously and drop ours at once: the fork is in flight.
    future = rpcx.rpc_async(hops[0], stress_hop, args=(rref, expected, hops[1:]))
    del rref
    return 1 + int(future.wait())


def wait_confirmed_held(key: str, timeout: float = 30.0) -> bool:
    """:func:`wait_confirmed` for the RRef held under ``key``."""
    return bool(_held[key]._wait_confirmed(timeout))


def forward_held(key: str, path: list[str], expected: Any) -> list[str]:
    """:func:`forward` for the RRef held under ``key``."""
    return forward(_held[key], path, expected)


class Holder:
    """Holds one value; two Holders holding RRefs to each other form a cycle.

    With a ``marker`` path, the Holder appends a :func:`lifecycle_phase` line to that
    file when it is freed, so a test can see that (and when) its owner let it go, even
    after a worker process has exited.
    """

    def __init__(self, marker: str | None = None) -> None:
        self.value: Any = None
        self.marker = marker

    def __del__(self) -> None:
        if self.marker is not None:
            append_line(self.marker, lifecycle_phase())

    def set(self, value: Any) -> None:
        """Keep ``value``."""
        self.value = value


def append_line(path: str, line: str) -> None:
    """Append one line to ``path`` in a single write (safe across processes)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def lifecycle_phase() -> str:
    """Where this thread's worker is in its life: ``running`` (serving, or draining in
    a graceful shutdown), ``closed`` (shut down: shutdown releases what is left),
    ``exiting`` (the interpreter is finalizing) or ``unbound`` (no worker here)."""
    import sys

    from rpcx._core import context as _context

    if sys.is_finalizing():
        return "exiting"
    agent = _context.thread_agent() or _context.process_agent()
    if agent is None:
        return "unbound"
    return "running" if agent.is_running else "closed"


class Marked:
    """A value that records (with :func:`append_line`) the phase in which it was freed."""

    def __init__(self, marker: str, label: str) -> None:
        self.marker = marker
        self.label = label

    def __del__(self) -> None:
        append_line(self.marker, f"{self.label} {lifecycle_phase()}")


# ------------------------------------------------------------------ optimizer probes

_probe_cond = threading.Condition()
_probe_entered: dict[str, int] = {}
_probe_active: dict[str, int] = {}
_probe_overlaps: dict[str, int] = {}


class OverlapProbeSGD(torch.optim.SGD):
    """SGD whose ``step`` waits (bounded) for a second step under the same ``probe``
    key to begin, and counts steps that overlapped.

    A worker that serializes optimizer steps never lets the second one in while the
    first waits (it costs one ``join_wait``); one that does not lets both run at once,
    with one context's gradients lent to ``.grad`` while the other steps.
    """

    def __init__(self, params: Any, lr: float, *, probe: str, join_wait: float = 1.0) -> None:
        super().__init__(params, lr=lr)
        self.probe = probe
        self.join_wait = join_wait

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One SGD step, after letting a concurrent step catch up."""
        key = self.probe
        with _probe_cond:
            _probe_entered[key] = _probe_entered.get(key, 0) + 1
            _probe_active[key] = _probe_active.get(key, 0) + 1
            if _probe_active[key] > 1:
                _probe_overlaps[key] = _probe_overlaps.get(key, 0) + 1
            _probe_cond.notify_all()
            _probe_cond.wait_for(lambda: _probe_entered[key] >= 2, self.join_wait)
        try:
            return super().step(closure)
        finally:
            with _probe_cond:
                _probe_active[key] -= 1


def probe_overlaps(key: str) -> tuple[int, int]:
    """(steps entered, steps that overlapped another) for an :class:`OverlapProbeSGD` key."""
    with _probe_cond:
        return _probe_entered.get(key, 0), _probe_overlaps.get(key, 0)


# ------------------------------------------------------------------ autograd helpers


def send_gradient(context_id: int, to: str, backward: tuple[int, int], tag: int, index: int,
                  grad: torch.Tensor) -> None:
    """From this worker, deliver ``grad`` for tensor ``index`` of ``to``'s send ``tag``
    in ``context_id``, as backward pass ``backward`` (driver rank, number) would here
    (without running ``to``'s pass)."""
    from rpcx.autograd.service import service
    from rpcx.futures import wait

    agent = _context_agent()
    svc = service(agent)
    context = svc.get(context_id)
    wait(svc.rounds._deliver(context, context.share(backward), agent.resolve(to).id,
                      [(tag, index, grad)]))


# --------------------------------------------------------------------------- failures


def wait_until_lost(name: str, timeout: float) -> dict[str, str]:
    """Wait (at most ``timeout``) until this worker knows ``name`` is gone and has
    reacted (failed calls, services' hooks); return ``debug_info()["lost_peers"]``."""
    agent = _context_agent()
    try:
        rank = agent.resolve(name).id
    except UnknownWorkerError:  # (a dynamic world forgets a lost worker's name once
        pass  # the loss is handled: there is nothing left to wait for)
    else:
        agent.wait_lost(rank, timeout)
    found: dict[str, str] = rpcx.debug_info()["lost_peers"]
    return found


def not_a_module() -> int:
    """A "module class" for RemoteModule that builds something else."""
    return 7


# --------------------------------------------------------------------------- hostile
# A worker that misbehaves on purpose, through its own agent and transport: what a buggy
# or compromised peer could send.


def forge_reply(to_rank: int, request_id: int, value: Any) -> None:
    """Send ``value`` to ``to_rank`` as the answer to its request ``request_id``,
    although that request went to another worker."""
    from rpcx._wire.codec import EncodeContext, encode
    from rpcx.messages import MessageKind

    agent = _context_agent()
    ctx = EncodeContext(to_rank, agent=agent, routes=agent.routes, response=True)
    frame = encode(MessageKind.RESULT, request_id, value, ctx)
    frame.reply_to = request_id
    agent.send_frame(to_rank, frame)


def send_noted_frame(to_rank: int, kind: int, payload: Any, notes: bytes) -> None:
    """Send ``to_rank`` a one-way frame of ``kind`` whose notes are the raw bytes
    ``notes`` (a pickle of the sender's choosing)."""
    from rpcx._wire import codec
    from rpcx.transport import Frame

    agent = _context_agent()
    ctx = codec.EncodeContext(to_rank, agent=agent, routes=agent.routes)
    plain = codec.encode(kind & codec._KIND_MASK, 0, payload, ctx)
    body = plain.header[codec._ENVELOPE.size :]
    header = b"".join((codec._ENVELOPE.pack(kind | codec._NOTED, 0),
                       codec._NOTES_LEN.pack(len(notes)), notes, body))
    agent.send_frame(to_rank, Frame(header, plain.buffers))


def send_code_as(to_rank: int, kind: int, marker: str) -> None:
    """Send ``to_rank`` a one-way frame of ``kind`` whose payload sets the environment
    variable ``marker`` when unpickled (built here: as an argument of this call, it would
    have run on this worker)."""
    send_noted_frame(to_rank, kind, SetsEnvironmentWhenUnpickled(marker), pickle.dumps([]))


class SetsEnvironmentWhenUnpickled:
    """Unpickling this sets ``os.environ[name] = "yes"`` (a stand-in for any code)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"import os; os.environ[{self.name!r}] = 'yes'",))


def environment_has(name: str) -> bool:
    """Whether this worker's process has the environment variable ``name``."""
    return name in os.environ


def send_unauthenticated_call(to_rank: int, how: str, marker: str) -> None:
    """Send ``to_rank``, straight through the transport, a call of
    :func:`tally` (``marker``) whose MAC is ``"bad"`` (one bit flipped),
    ``"missing"`` (an unsealed frame, as a stray socket would send), ``"replayed"``
    (a genuine frame, sent twice), or ``"reordered"`` (a genuine frame held back and
    sent after a later one, a call of :func:`tally` with ``marker + "_later"``)."""
    from rpcx._wire import codec
    from rpcx.messages import MessageKind
    from rpcx.transport import Frame

    agent = _context_agent()
    guard = agent.guard
    assert guard is not None, "this world runs without a key"
    ctx = codec.EncodeContext(to_rank, agent=agent, routes=agent.routes)
    frame = codec.encode(MessageKind.CALL, 0, (tally, (marker,), {}), ctx)
    transport = agent._transport.inner  # (past the world key's seal: the test seals)
    if how == "missing":
        transport.send(to_rank, frame)
        return
    if how == "reordered":
        _send_reordered(agent, guard, transport, to_rank, frame, lambda: codec.encode(
            MessageKind.CALL, 0, (tally, (marker + "_later",), {}), ctx))
        return
    sealed = guard.seal(to_rank, frame)
    if how == "bad":
        header = bytearray(sealed.header)
        header[-1] ^= 1
        transport.send(to_rank, Frame(bytes(header), sealed.buffers))
    elif how == "replayed":
        transport.send(to_rank, Frame(sealed.header, sealed.buffers))
        transport.send(to_rank, Frame(sealed.header, sealed.buffers))
    else:
        raise ValueError(f"unknown way to break a MAC: {how!r}")


def _send_reordered(agent: Any, guard: Any, transport: Any, to_rank: int, held: Any,
                    later: Any) -> None:
    """Seal ``held`` as a frame whose send returned at once, then a frame of ``later()``
    sealed after it (one whose number says ``held`` comes first: sealed again, a new
    frame each time, while the worker's own sends, a heartbeat, are under way), and send
    the later one first: ``held`` arrives reordered."""
    import struct

    from rpcx._wire.auth import _LAG_BITS, _LAG_NONE

    sealed, token = guard.sealing(to_rank, held)
    guard.sent(to_rank, token)
    first_seq = token[1]
    pause = threading.Event()
    for _ in range(500):
        after = guard.seal(to_rank, later())
        (number,) = struct.unpack_from("<Q", after.header)
        lag = number & _LAG_NONE
        if lag != _LAG_NONE and (number >> _LAG_BITS) - lag > first_seq:
            transport.send(to_rank, after)
            transport.send(to_rank, sealed)
            return
        pause.wait(0.01)  # (a send of the worker's own is under way: let it end)
    raise RuntimeError(f"{agent.name}: frames to rank {to_rank} stayed under way for 5 s")


def send_altered_encrypted_call(to_rank: int, how: str, marker: str) -> None:
    """Send ``to_rank``, straight through the transport, an encrypted call of
    :func:`tally` (``marker``) with a tensor of 64 KiB beside its header, altered:
    ``"tensor"`` (one bit of the tensor's ciphertext flipped; the tensor is 6 MiB then,
    which a receiver decrypts in place where its transport allows), ``"header"`` (one bit of
    the header's ciphertext flipped) or ``"plain"`` (the frame as the codec wrote it,
    unencrypted) or ``"reordered"`` (a genuine frame held back and sent after a later
    one, a call of :func:`tally` with ``marker + "_later"``)."""
    import torch

    from rpcx._wire import codec
    from rpcx.messages import MessageKind
    from rpcx.transport import Frame

    agent = _context_agent()
    guard = agent.guard
    assert getattr(guard, "encrypted", None), "this world runs unencrypted"
    ctx = codec.EncodeContext(to_rank, agent=agent, routes=agent.routes)
    riding = torch.ones((6 << 20) // 4 if how == "tensor" else 1 << 14)
    frame = codec.encode(MessageKind.CALL, 0, (tally, (marker, riding), {}), ctx)
    assert frame.buffers, "the tensor went in the header"
    transport = agent._transport.inner  # (past the cipher: the test encrypts)
    if how == "plain":
        transport.send(to_rank, frame)
        return
    if how == "reordered":
        _send_reordered(agent, guard, transport, to_rank, frame, lambda: codec.encode(
            MessageKind.CALL, 0, (tally, (marker + "_later", torch.ones(1 << 14)), {}),
            ctx))
        return
    sealed = guard.seal(to_rank, frame)
    if how == "tensor":
        sealed.buffers[0][len(sealed.buffers[0]) // 2] ^= 4
        transport.send(to_rank, sealed)
    elif how == "header":
        header = bytearray(sealed.header)
        header[-20] ^= 1
        transport.send(to_rank, Frame(bytes(header), sealed.buffers))
    else:
        raise ValueError(f"unknown way to alter an encrypted frame: {how!r}")


def owned_rref_entries() -> list[str]:
    """The first entries of this worker's RRef owner table, one line each (creator,
    created or not, holders, early deletions): what a leak report names."""
    from rpcx._services import rref_requests

    entries: list[str] = rref_requests.service(_context_agent()).describe_owned()
    return entries


def cipher_counts() -> tuple[int, int]:
    """This worker's cipher: how many buffers it decrypted in place, and how many of
    its encrypted send buffers it used again."""
    guard = _context_agent().guard
    assert getattr(guard, "encrypted", None), "this world runs unencrypted"
    return guard.decrypted_in_place, guard.send_buffers.reused


_wire_seen: list[tuple[int, bytes]] = []


def spy_on_the_wire() -> None:
    """Record every byte this worker's transport is handed to send from now on (headers
    and buffers, after the world key's seal or cipher, with the rank each went to), for
    :func:`wire_has`. Forgets what was recorded before (workers of one process share the
    record)."""
    import torch

    from rpcx._util.memory import memory_of

    _wire_seen.clear()
    agent = _context_agent()
    transport = agent._transport.inner
    original = transport.send

    def send(dst: int, frame: Any) -> None:
        _wire_seen.append((dst, bytes(frame.header)))
        for buffer in frame.buffers:
            flat = buffer.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
            _wire_seen.append((dst, bytes(memory_of(flat)) if flat.numel() else b""))
        original(dst, frame)

    transport.send = send


def wire_has(pattern: bytes, to: int | None = None) -> tuple[int, bool]:
    """How many parts :func:`spy_on_the_wire` recorded (those sent to rank ``to``, if
    given), and whether ``pattern`` is in one of them."""
    parts = [data for dst, data in _wire_seen if to is None or dst == to]
    return len(parts), any(pattern in part for part in parts)


def process_id() -> int:
    """This worker's process id."""
    return os.getpid()


_tallies: dict[str, int] = {}
_tallies_lock = threading.Lock()
_tallies_changed = threading.Condition(_tallies_lock)


def tally(key: str, *riding: Any) -> int:
    """Add one to this process's tally ``key`` (thread-safe); return it. (``riding``:
    what a test sends beside it, a tensor, ignored.)"""
    with _tallies_changed:
        _tallies[key] = _tallies.get(key, 0) + 1
        _tallies_changed.notify_all()
        return _tallies[key]


def wait_for_tally(key: str, at_least: int, bound: float = 30.0) -> int:
    """Wait (at most ``bound`` seconds) until tally ``key`` reaches ``at_least``; return it."""
    with _tallies_changed:
        _tallies_changed.wait_for(lambda: _tallies.get(key, 0) >= at_least, bound)
        return _tallies.get(key, 0)


def tally_of(key: str) -> int:
    """This process's tally ``key``."""
    with _tallies_lock:
        return _tallies.get(key, 0)


# ------------------------------------------------------------- answers held back

_held_answers: dict[str, torch.futures.Future[Any]] = {}
_sent: list[Any] = []  # what fire() and fire_remote() made, kept so nothing collects it


@async_execution
def answer_later(key: str) -> torch.futures.Future[Any]:
    """Answer when :func:`answer_with_rref` is called here with ``key`` (the call's reply
    is encoded inside that call)."""
    future: torch.futures.Future[Any] = torch.futures.Future()
    _held_answers[key] = future
    _event(f"{key}/held").set()
    return future


def answer_with_rref(key: str, bound: float = 30.0) -> None:
    """Answer :func:`answer_later` ``key`` with an RRef this worker owns (once that call
    has arrived, at most ``bound`` seconds from now)."""
    if not _event(f"{key}/held").wait(bound):
        raise TimeoutError(f"answer_later({key!r}) did not arrive within {bound:g} s")
    _held_answers.pop(key).set_result(rpcx.RRef(Counter(1)))


def fire(to: str, fn: Any, *args: Any) -> None:
    """``rpc_async(to, fn, args)`` from this worker, not waiting for the answer."""
    _sent.append(rpcx.rpc_async(to, fn, args=args))


def fire_remote(to: str, fn: Any, *args: Any) -> None:
    """``remote(to, fn, args)`` from this worker, keeping the RRef here."""
    _sent.append(rpcx.remote(to, fn, args=args))


def wait_lost(rank: int, bound: float = 30.0) -> bool:
    """Wait (at most ``bound`` seconds) until this worker has seen ``rank`` gone."""
    return bool(_context_agent().wait_lost(rank, bound))


class MadeOnRelease:
    """A value whose constructor waits for :func:`release` of ``key``: ``remote()`` of it
    leaves the RRef's value to come later."""

    def __init__(self, key: str, bound: float = 30.0) -> None:
        wait_for_release(key, bound)

    def times_on(self, peer: str, x: torch.Tensor, factor: float) -> torch.Tensor:
        """``x * factor``, computed on ``peer`` (a call from this method)."""
        out: torch.Tensor = rpcx.rpc_sync(peer, torch.mul, args=(x, factor))
        return out
