"""The tensorpipe backend: rpcx frames over torch's TensorPipe agent.

TensorPipe is reachable from Python only through torch's own RPC agent, so each worker
starts one ``TensorPipeAgent`` (built directly, on rpcx's rendezvous store, with the
device maps rpcx already checked: no numpy, no second exchange) and moves frames as
torch RPC calls to :func:`_receive`. A frame's tensors are real arguments of that
call, never pickled bytes, so TensorPipe moves CUDA memory device to device along the
device maps and uses its shared-memory and TCP channels for CPU memory.

One rpcx call costs one TensorPipe round trip: a request frame travels as a torch call
whose *reply* carries the rpcx response frame (the receiving side holds the call open
as an ``async_execution`` future until the agent sends the response). Torch then
routes the response's tensors along the inverse device map, as rpcx's codec expects.
Frames that are not requests (one-way messages) travel as calls answered with ``None``.

torch runs incoming calls on a thread pool, and replies complete on whichever thread,
so arrival order is not send order. Each frame carries a per-(sender, receiver)
sequence number, responses included, and the receiver delivers strictly in that order
(the transport contract; the RRef protocol depends on it).

TensorPipe notices a dead peer only on a pipe with a call outstanding, so each worker
keeps one *watch* call open to every peer, which the peer answers only when it leaves.
A watch that fails means the peer died; one answered with a goodbye means it left. The
goodbye carries a sequence number like any frame, so it is delivered after everything
the peer sent before it. A worker that gets a goodbye it did not expect answers with
its own, so a peer that leaves alone is not left waiting.

torch's agent is stopped without its ``join()``: that barrier keys the store with a
process-wide counter that never resets, so a second world in one process would wait on
keys nobody writes. The price is a C++ warning per pipe a peer closes first at
shutdown (``TORCH_CPP_LOG_LEVEL=ERROR`` hides them).

One agent per process: torch keeps its RPC agent in a process-wide slot, so a process
that uses this backend cannot use ``torch.distributed.rpc`` itself at the same time.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from typing import Any, ClassVar

import torch
import torch.distributed.autograd
import torch.distributed.rpc.api
import torch.distributed.rpc.functions
import torch.distributed.rpc.options
from torch.distributed.rpc._utils import (
    _update_group_membership as torch_update_group_membership,
)

from rpcx.errors import (
    LostCause,
    PeerLostError,
    ProtocolError,
    RpcError,
    lost_reason,
)
from rpcx.hookspecs import hookimpl
from rpcx.hosts import address_towards, interface_with
from rpcx.options import DEFAULT_NUM_WORKER_THREADS, TensorPipeRpcBackendOptions
from rpcx.torch_originals import original
from rpcx.transport import Capabilities, Frame, TransportContext
from rpcx.transport_kit import copy_of, describe, environment_variable, unreachable

__all__ = ["TensorPipeTransport"]

log = logging.getLogger("rpcx.backends.tensorpipe")

# torch's RPC, from the modules that define it: rpcx.use_for_torch() points the names
# of torch.distributed.rpc (the package) at rpcx's, and this transport must keep
# reaching torch's own. (Untyped: the agent slot, the autograd container.)
torch_rpc_api: Any = torch.distributed.rpc.api
torch_autograd: Any = torch.distributed.autograd
_TorchOptions = torch.distributed.rpc.options.TensorPipeRpcBackendOptions
_torch_async_execution = torch.distributed.rpc.functions.async_execution

_GOODBYE = Frame(b"")  # the frame a watch is answered with when its peer leaves
_active_lock = threading.Lock()
_active: TensorPipeTransport | None = None  # this process's transport (torch allows one)


class _Inbox:
    """Frames from one peer, re-ordered by sequence number before delivery."""

    __slots__ = ("delivering", "ended", "lock", "next", "waiting")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next = 0
        self.waiting: dict[int, Frame] = {}
        self.delivering = False
        self.ended = False  # the peer said goodbye or died: nothing more is delivered


_IFNAME_ENV = "TP_SOCKET_IFNAME"


def _interface_for_agent(ctx: TransportContext) -> contextlib.AbstractContextManager[None]:
    """While torch's agent is built, point TensorPipe at the interface the rendezvous
    traffic uses, unless ``$TP_SOCKET_IFNAME`` already names one.

    Left alone, TensorPipe listens on the address this host's name resolves to, which on
    many machines is 127.0.0.1 or an interface the other hosts cannot reach: workers on
    other hosts then never connect. gloo and zmq bind :func:`rpcx.hosts.address_towards`;
    TensorPipe takes an interface name, which it reads from the environment only when the
    agent is built and starts listening. The variable is removed again after, so that
    processes this one starts, and a later world towards another host, do not inherit it.
    """
    interface = None
    if not os.environ.get(_IFNAME_ENV):
        address = address_towards(ctx.init_method)
        interface = interface_with(address) if address else None
        if interface is None:
            log.debug("no interface found for %s; TensorPipe picks its own address", address)
        else:
            log.info("%s: TensorPipe listens on %s (%s), the interface towards the "
                     "rendezvous; set %s to choose another", ctx.names[ctx.rank], interface,
                     address, _IFNAME_ENV)
    return environment_variable(_IFNAME_ENV, interface)


class TensorPipeTransport:
    """Frames as torch TensorPipe calls; responses ride in the calls' replies."""

    # torch's agent owns the listener: it unpickles what arrives before rpcx sees it, and
    # one malformed message there ends the process (std::terminate, "Error reading nop
    # object"), key or no key. docs/security.md says so.
    capabilities: ClassVar[Capabilities] = Capabilities(
        multi_process=True, multi_host=True, cuda_direct=True, refuses_strangers=False,
        dynamic=True, reuses_ranks=False,
    )

    def __init__(self) -> None:
        self._ctx: TransportContext | None = None
        self._agent: Any = None
        self._agent_set = False  # torch's current agent is ours (we set it)
        self._lock = threading.Lock()
        self._send_seq: dict[int, itertools.count[int]] = {}
        self._inboxes: dict[int, _Inbox] = {}
        # (peer, request id) -> the torch future that answers that peer's call.
        self._replies: dict[tuple[int, int], torch.futures.Future[Any]] = {}
        self._gone: dict[int, tuple[str, LostCause]] = {}  # lost peers: why, and the cause
        self._closed = False  # torch's agent is being stopped: ignore what still arrives
        # Watches: the peers' open watch calls here (answered when this worker leaves),
        # and the peers whose goodbye has not arrived yet.
        self._watches: dict[int, torch.futures.Future[Any]] = {}
        self._goodbye_sent: set[int] = set()
        self._goodbye_owed: set[int] = set()  # said before the peer's watch arrived
        self._watched_by: set[int] = set()  # peers whose watch has arrived
        self._awaiting_goodbye: set[int] = set()
        self._all_gone = threading.Condition(self._lock)  # watch and goodbye changes
        # Per peer: devices torch's agent maps for calls to it, and for replies to it.
        self._call_devices: dict[int, set[torch.device]] = {}
        self._reply_devices: dict[int, set[torch.device]] = {}
        self._reply_future_devices: list[torch.device] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, ctx: TransportContext) -> None:
        """Start torch's TensorPipe agent for this process on the rpcx store."""
        global _active
        from torch._C._distributed_rpc import TensorPipeAgent

        with _active_lock:
            if _active is not None or original(torch_rpc_api, "_is_current_rpc_agent_set")():
                raise RpcError(
                    "the tensorpipe backend needs torch's RPC agent, and this process "
                    "already has one (torch.distributed.rpc, or another rpcx worker on "
                    "tensorpipe): run one such worker per process"
                )
            _active = self
        self._ctx = ctx
        routes = ctx.routes
        names = ctx.names
        members = self._members = [rank for rank in range(len(names))
                                   if rank != ctx.rank and not ctx.vacant(rank)]
        for rank in members:
            self._send_seq[rank] = itertools.count()
            self._inboxes[rank] = _Inbox()
        device_maps: dict[str, dict[torch.device, torch.device]] = {}
        reverse_maps: dict[str, dict[torch.device, torch.device]] = {}
        devices: list[torch.device] = []
        if routes is not None:
            # (Calls to oneself never reach the transport.)
            # CPU entries stay with rpcx (CPU tensors always arrive on the CPU): torch
            # would apply them to CPU tensors.
            for rank, mapping in routes.outgoing.items():
                cuda = {k: v for k, v in mapping.items() if k.type != "cpu"}
                if rank != ctx.rank and cuda:
                    device_maps[names[rank]] = cuda
                    self._call_devices[rank] = set(cuda)
            for rank, mapping in routes.incoming.items():
                cuda = {k: v for k, v in mapping.items() if k.type != "cpu"}
                if rank != ctx.rank and cuda:
                    reverse_maps[names[rank]] = cuda  # {here: there}, as torch's
                    self._reply_devices[rank] = set(cuda)
            devices = list(routes.devices)
        # A reply future carries CUDA tensors only if it is told their devices
        # (torch refuses set_result otherwise); CPU needs no entry.
        self._reply_future_devices = [d for d in devices if d.type != "cpu"] or None
        source = ctx.options
        options = _TorchOptions(
            num_worker_threads=max(
                4, getattr(source, "num_worker_threads", DEFAULT_NUM_WORKER_THREADS)
            ),
            rpc_timeout=0,  # rpcx keeps the time of every call itself
            init_method="env://",  # unused: the agent is handed its store
            device_maps=device_maps,  # type: ignore[arg-type]
            devices=devices,  # type: ignore[arg-type]
            _transports=getattr(source, "_transports", None),
            _channels=getattr(source, "_channels", None),
        )
        try:
            # torch's request handler insists on its autograd container, which rpcx
            # never uses otherwise; it keeps the first worker id it was given.
            try:
                torch_autograd._init(ctx.rank)
            except RuntimeError as exc:
                log.debug("torch autograd container already initialized: %s", exc)
            if torch.cuda.is_available() and devices:
                torch.cuda.init()  # type: ignore[no-untyped-call]
            dynamic = ctx.admit is not None
            with _interface_for_agent(ctx):
                # (world size None: torch's dynamic group, which workers join and leave)
                self._agent = TensorPipeAgent(
                    ctx.store, names[ctx.rank], ctx.rank,
                    None if dynamic else ctx.world_size, options, reverse_maps, devices,
                )
                # torch's _init_rpc_states, but asking torch's own "is an agent set?":
                # under rpcx.use_for_torch() the api module's answers for rpcx's workers.
                if not dynamic:
                    torch_rpc_api._ALL_WORKER_NAMES = set(names)
                if not original(torch_rpc_api, "_is_current_rpc_agent_set")():
                    torch_rpc_api._set_and_start_rpc_agent(self._agent)  # (it listens)
                    self._agent_set = True
            if dynamic:
                # As torch's init_rpc does for a dynamic group: every member's agent
                # learns of this one (rpcx's membership token is held meanwhile).
                me = self._agent.get_worker_info()
                bound = getattr(source, "rpc_timeout", 0.0) or 0  # (0: none, as asked)
                for rank in members:
                    torch_rpc_api.rpc_sync(names[rank], torch_update_group_membership,
                                           args=(me, [], {}, True), timeout=bound)
            for rank in members:
                self._watch(rank)
            self._wait_for_watches(getattr(source, "rpc_timeout", 0.0) or None)
        except BaseException:
            self._release_slot()
            raise

    def _wait_for_watches(self, timeout: float | None) -> None:
        # Every pipe of the world is opened here, while nobody can crash mid-call: the
        # watches open one each way between every two workers, and torch reuses them.
        # (A peer that dies while one of this worker's listeners is still accepting its
        # connection breaks every pipe of that listener, so none may be left pending.)
        ctx = self._ctx
        assert ctx is not None
        expected = len(self._members)
        with self._lock:
            if not self._all_gone.wait_for(lambda: len(self._watched_by) >= expected, timeout):
                missing = [ctx.names[r] for r in self._members if r not in self._watched_by]
                raise RpcError(
                    f"worker {ctx.names[ctx.rank]!r}: TensorPipe connections from "
                    f"{', '.join(missing)} did not arrive within {timeout} s (rpc_timeout)"
                )

    def _watch(self, rank: int) -> None:
        ctx = self._ctx
        assert ctx is not None
        with self._lock:
            self._awaiting_goodbye.add(rank)
        future = torch_rpc_api.rpc_async(ctx.names[rank], _open_watch, args=(ctx.rank,), timeout=0)
        future.add_done_callback(lambda done: self._on_reply(rank, done))

    def close(self, timeout: float) -> None:
        """Answer every watch with a goodbye, wait for the peers' own, stop torch's agent."""
        ctx = self._ctx
        if ctx is None:
            return
        me = ctx.names[ctx.rank]
        with self._lock:  # (the workers still here, before the goodbyes mark them gone)
            staying = [rank for rank in self._inboxes if rank not in self._gone]
        for rank in list(self._inboxes):
            self._say_goodbye(rank)
        with self._lock:
            if not self._all_gone.wait_for(lambda: not self._awaiting_goodbye, timeout):
                log.warning("%s: no goodbye from %s within %.1f s; leaving anyway", me,
                            ", ".join(ctx.names[r] for r in sorted(self._awaiting_goodbye)),
                            timeout)
            open_replies, self._replies = list(self._replies.values()), {}
        for future in open_replies:  # requests this worker will never answer
            if not future.done():
                future.set_result(None)
        if ctx.admit is not None and self._agent is not None:
            self._leave_torch_group(staying, timeout)
        self._closed = True  # watches failing from here on are not peers dying
        try:
            if self._agent is not None:
                self._agent.shutdown()
        except Exception as exc:
            log.warning("%s: torch's TensorPipe agent did not stop cleanly: %s", me, exc)
        finally:
            if self._agent_set:  # (torch asserts on resetting an agent never set)
                torch_rpc_api._reset_current_rpc_agent()
                self._agent_set = False
            self._release_slot()

    def _leave_torch_group(self, staying: list[int], timeout: float) -> None:
        """A dynamic world: tell torch's agent of every worker ``staying`` that this one
        leaves (as torch's shutdown of a dynamic group does), each call bounded by
        ``timeout``. After the goodbyes: torch's agent there then forgets this one."""
        ctx = self._ctx
        assert ctx is not None and self._agent is not None
        agent = self._agent
        me = agent.get_worker_info()
        deadline = time.monotonic() + timeout  # (one bound for the whole leave)
        for rank in staying:
            try:
                torch_rpc_api.rpc_sync(ctx.names[rank], torch_update_group_membership,
                                       args=(me, [], {}, False),
                                       timeout=max(deadline - time.monotonic(), 0.1))
            except Exception as exc:  # it left too, or died: nothing to tell it
                log.debug("%s: telling %s it leaves: %s", self._me(), ctx.names[rank], exc)
        # torch's agent leaves its group: it strikes its name off the store (a later
        # worker may take the rank) once its own calls are done. It has no bound of its
        # own (a peer that never answers a watch would hold it): it gets one here.
        leaving = threading.Thread(target=agent.join, args=(True,), daemon=True,
                                   name=f"rpcx-{self._me()}-tensorpipe-leave")
        leaving.start()
        leaving.join(max(deadline - time.monotonic(), 0.1))
        if leaving.is_alive():
            log.warning("%s: torch's TensorPipe agent did not leave its group within "
                        "%.1f s; its rank stays taken in the store", self._me(), timeout)

    def _say_goodbye(self, rank: int) -> None:
        """Answer ``rank``'s watch: this worker sends it nothing more."""
        with self._lock:
            if rank in self._goodbye_sent:
                return
            watch = self._watches.pop(rank, None)
            if watch is None:  # its watch has not arrived yet: answer it when it does
                self._goodbye_owed.add(rank)
                return
            self._goodbye_owed.discard(rank)
            self._goodbye_sent.add(rank)
            seq = next(self._send_seq[rank])  # after every frame sent to it
        if not watch.done():
            watch.set_result((seq, _GOODBYE.header, []))

    def _me(self) -> str:
        ctx = self._ctx
        return ctx.names[ctx.rank] if ctx is not None else "?"

    def _release_slot(self) -> None:
        global _active
        with _active_lock:
            if _active is self:
                _active = None

    # ---------------------------------------------------------------------- sending

    def send(self, dst: int, frame: Frame) -> None:
        """Send ``frame``: as the reply to ``dst``'s open call if it answers one."""
        lost = self._gone.get(dst)
        if lost is not None:  # (the words its lost calls got)
            raise PeerLostError(lost[0], cause=lost[1])
        if self._closed or dst in self._goodbye_sent:
            raise PeerLostError(f"cannot be reached: worker {self._me()!r} has shut down")
        reply = None
        if frame.reply_to:
            with self._lock:
                reply = self._replies.pop((dst, frame.reply_to), None)
        mapped = (self._reply_devices if reply is not None else self._call_devices).get(dst)
        try:
            buffers = self._staged(frame.buffers, mapped, frame.owned)
        except BaseException:
            if reply is not None:  # not answered: closing answers it with nothing
                with self._lock:
                    self._replies[(dst, frame.reply_to)] = reply
            raise
        # Only now the sequence number: one taken and never sent would hold up every
        # later frame to ``dst``.
        seq = next(self._send_seq[dst])
        if reply is not None:
            try:
                reply.set_result((seq, frame.header, buffers))
            except Exception as exc:  # the number is spent: the pair cannot go on
                self._lose(dst, LostCause.CONNECTION_LOST, _detail(exc))
                raise PeerLostError(_describe(exc)) from exc
            return
        self._call(dst, seq, frame.header, buffers, frame.request_id)

    def _call(
        self, dst: int, seq: int, header: bytes, buffers: list[torch.Tensor], request_id: int
    ) -> Any:
        ctx = self._ctx
        assert ctx is not None
        try:
            future = torch_rpc_api.rpc_async(
                ctx.names[dst], _receive,
                args=(ctx.rank, seq, header, buffers, request_id), timeout=0,
            )
        except Exception as exc:
            if self._closed:
                raise PeerLostError(f"cannot be reached: worker {self._me()!r} has shut down"
                                    ) from exc
            reason = _describe(exc)
            # its sequence is broken: treat it as gone
            self._lose(dst, LostCause.CONNECTION_LOST, _detail(exc))
            raise PeerLostError(reason) from exc
        future.add_done_callback(lambda done: self._on_reply(dst, done))
        return future

    @staticmethod
    def _staged(
        buffers: list[torch.Tensor],
        mapped: set[torch.device] | None,
        owned: frozenset[int] = frozenset(),
    ) -> list[torch.Tensor]:
        # torch writes the tensors some time after rpc_async returns, and the caller may
        # change them as soon as send returns: send private copies, except of buffers the
        # codec made for this frame alone (``owned``). Device memory that torch's maps do
        # not route (a gradient on its way back, say) goes through the host; rpcx's codec
        # puts it on its device at the receiver.
        def routed(b: torch.Tensor) -> bool:
            return b.device.type == "cpu" or (mapped is not None and b.device in mapped)

        private = Frame(b"", buffers, owned=owned).private_buffers(
            lambda b: copy_of(b) if routed(b) else b.cpu())
        return [b if routed(b) else b.cpu() for b in private]

    # -------------------------------------------------------------------- receiving

    def _on_reply(self, dst: int, done: torch.futures.Future[Any]) -> None:
        try:
            value = done.value()
        except Exception as exc:
            if not self._closed:
                self._lose(dst, LostCause.CONNECTION_LOST, _detail(exc))
            return
        if value is not None:
            seq, header, buffers = value
            _wait_for_arrival(buffers)
            self._arrive(dst, seq, Frame(header, list(buffers)))

    def _incoming(
        self, src: int, seq: int, header: bytes, buffers: list[torch.Tensor], request_id: int
    ) -> torch.futures.Future[Any]:
        reply: torch.futures.Future[Any] = torch.futures.Future(
            devices=self._reply_future_devices  # type: ignore[arg-type]
        )
        with self._lock:
            if request_id and src not in self._goodbye_sent:
                self._replies[(src, request_id)] = reply
            else:
                reply.set_result(None)
        _wait_for_arrival(buffers)
        self._arrive(src, seq, Frame(header, list(buffers)))
        return reply

    def _incoming_watch(self, src: int) -> torch.futures.Future[Any]:
        watch: torch.futures.Future[Any] = torch.futures.Future()
        ctx = self._ctx
        if ctx is not None and ctx.admit is not None and (
                src not in self._inboxes or src in self._gone):  # a newcomer's first call
            self._admit(src)
        with self._lock:
            self._watches[src] = watch
            self._watched_by.add(src)
            self._all_gone.notify_all()
            owed = src in self._goodbye_owed
        if owed:
            self._say_goodbye(src)
        return watch

    def _admit(self, src: int) -> None:
        """A worker joined this dynamic world at ``src`` (its first call here is its
        watch, after torch's agent learnt of it): enter it, and watch it in turn; its
        ``init_rpc`` returns once every member's watch has reached it."""
        ctx = self._ctx
        assert ctx is not None and ctx.admit is not None
        with self._lock:
            if src in self._inboxes and src not in self._gone:
                return
            self._gone.pop(src, None)  # (a rank taken again: a new worker)
            for gone in (self._goodbye_sent, self._goodbye_owed, self._watched_by):
                gone.discard(src)
            self._send_seq[src] = itertools.count()
            self._inboxes[src] = _Inbox()
        try:
            ctx.admit(src)
        except BaseException:  # refused: the next call from the rank is a newcomer's again
            with self._lock:
                self._inboxes.pop(src, None)
            raise
        self._watch(src)

    def _arrive(self, src: int, seq: int, frame: Frame) -> None:
        ctx = self._ctx
        inbox = self._inboxes.get(src)
        if ctx is None or inbox is None:
            return
        with inbox.lock:
            if inbox.ended or self._closed:
                return
            inbox.waiting[seq] = frame
            if inbox.delivering:
                return  # the thread delivering for this peer will pick it up
            inbox.delivering = True
        # This thread now delivers for ``src`` until nothing in order is left. Finding
        # nothing and giving up the role must happen under one acquisition of the lock:
        # a frame that arrives in between would otherwise see ``delivering`` still set,
        # leave itself to this thread, and never be delivered.
        try:
            while True:
                with inbox.lock:
                    ready = inbox.waiting.pop(inbox.next, None)
                    if ready is None or inbox.ended:
                        inbox.delivering = False
                        return
                    inbox.next += 1
                if ready.header == _GOODBYE.header:
                    # ends the inbox: the loop stops
                    self._lose(src, LostCause.DEPARTED)
                    continue
                try:
                    ctx.deliver(src, ready)
                except ProtocolError as exc:  # refused (authentication): nothing more
                    self._lose(src, LostCause.PROTOCOL_ERROR, str(exc))
                except Exception:
                    log.exception("%s: delivering a frame from rank %d failed",
                                  ctx.names[ctx.rank], src)
        except BaseException:
            with inbox.lock:  # not delivering any more: a later arrival takes over
                inbox.delivering = False
            raise

    def _lose(self, rank: int, cause: LostCause = LostCause.CONNECTION_LOST,
              detail: str = "") -> None:
        """``rank`` left or died: nothing more comes from it, answer what it waits for."""
        ctx = self._ctx
        inbox = self._inboxes.get(rank)
        if inbox is not None:
            with inbox.lock:  # frames after a goodbye, or held behind a gap, are dropped
                inbox.ended = True
                inbox.waiting.clear()
        with self._lock:
            if ctx is None or rank in self._gone:
                return
            self._gone[rank] = (lost_reason(cause, detail), cause)
            self._awaiting_goodbye.discard(rank)
            self._all_gone.notify_all()
            answers = [self._replies.pop(key) for key in list(self._replies) if key[0] == rank]
        for future in answers:
            if not future.done():
                future.set_result(None)
        self._say_goodbye(rank)  # a peer that leaves alone gets an answer at once
        ctx.peer_lost(rank, cause, detail)


@_torch_async_execution  # type: ignore[untyped-decorator]
def _open_watch(src: int) -> torch.futures.Future[Any]:
    """Runs in torch's agent: ``src`` watches this worker; answered when it leaves."""
    transport = _active
    if transport is None:
        raise RpcError("rpcx's tensorpipe transport is not running in this process")
    return transport._incoming_watch(src)


@_torch_async_execution  # type: ignore[untyped-decorator]
def _receive(
    src: int, seq: int, header: bytes, buffers: list[torch.Tensor], request_id: int
) -> torch.futures.Future[Any]:
    """Runs in torch's agent for every frame that arrives; answers with the reply frame."""
    transport = _active
    if transport is None:
        raise RpcError("rpcx's tensorpipe transport is not running in this process")
    return transport._incoming(src, seq, header, buffers, request_id)


def _wait_for_arrival(buffers: list[torch.Tensor]) -> None:
    """Block until CUDA buffers that just arrived are readable from any stream.

    torch makes them ready on the streams current on this thread (its receive streams,
    or the streams a reply callback runs on). rpcx decodes and uses them on other
    threads and streams, so wait here; CPU buffers need nothing.
    """
    for device in {b.device for b in buffers if b.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


def _detail(exc: BaseException) -> str:
    """What torch's error says: its first line, C++ source locations removed."""
    return describe(exc)


def _describe(exc: BaseException) -> str:
    """A ``PeerLostError``'s reason from torch's error (``"is unreachable: <detail>"``)."""
    return unreachable(_detail(exc))


@hookimpl
def rpcx_register_backends(register: Any) -> None:
    """Register the tensorpipe backend."""
    register(
        "tensorpipe",
        TensorPipeTransport,
        description="torch's TensorPipe agent: CUDA device to device along device maps",
        options_type=TensorPipeRpcBackendOptions,
    )
