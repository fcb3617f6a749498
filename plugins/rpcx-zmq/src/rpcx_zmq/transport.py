"""The zmq transport: frames over ZeroMQ PUSH/PULL sockets, one pair per peer and direction.

Wire format: a frame is one ZeroMQ multipart message (ZeroMQ keeps a message's parts
together and in order): a head part, then one part per buffer larger than
``INLINE_MAX``. The head is ``kind (u8), n (u32)``, then for each of the ``n`` buffers its
element size (u8: the alignment its dtype needs) and its length (i64; -1: it follows as a
part of its own), then the frame's header, then the small buffers' bytes. So a small
frame is one part: one send and one receive, each of which releases the GIL. Kinds:
``DATA`` (a frame) and ``BYE`` (the last message a worker sends a peer). ``LOST`` and
``STOP`` never cross the wire: they are posted to a receive loop through an
``inproc://`` endpoint of its own socket.

Sockets, per peer: a PULL socket (``rx``) bound for that peer alone, read by one receive
loop (a receive lane, so requests are served on the receiving thread); a PUSH socket
(``tx``) connected to the peer's PULL for this worker, written under a per-peer lock, so
frames leave in the order their ``send`` calls took the lock; and a control PUSH (``ctl``)
into ``rx``. A send never waits for room in ``tx``'s queue (``_HWM`` messages): a
message that finds it full, and every later one while any waits, goes to the peer's
writer thread, and the send waits for it until the frame's deadline at most. Same-host
peers connect over ``ipc://`` (a private temp directory), others over TCP.

Tensors: a buffer of ``ZERO_COPY_SEND`` bytes or more is sent from the tensor's memory
(``copy=False``) and ``send`` waits for ZeroMQ's message tracker, which fires once
libzmq has written the bytes to the kernel: the caller may change the tensor after that.
Buffers the codec made for this frame alone (``Frame.owned``) are not waited for; the
message keeps them alive. Smaller buffers are copied (into the head up to
``INLINE_MAX``). On receive, a part of
``ZERO_COPY_RECEIVE`` bytes or more becomes a tensor over ZeroMQ's own message memory
(``torch.frombuffer`` keeps the message alive) when that memory is aligned for the
buffer's dtype. libzmq puts a large message's bytes 40 bytes into a ``malloc`` block, so
8-byte aligned: enough for every dtype but ``complex128``, whose buffers are copied.

Size limit (``max_frame_bytes``): a frame (header plus every buffer) over it is refused by
its total before a byte of it is copied, and the peer reported lost with a protocol
error, as gloo and shm do. ZeroMQ's ``MAXMSGSIZE`` on each ``rx`` also bounds every part
to the limit before ZeroMQ allocates it; a part over it makes ZeroMQ drop the connection
unread without saying why, so that case is reported as a closed connection.

Lost peers: ZeroMQ reconnects silently, so every ``tx`` has a socket monitor, read by one
monitor thread per worker. A peer process that dies closes its connections, and the
monitor sees ``EVENT_DISCONNECTED`` on our connection to it at once; ZeroMQ heartbeats
(``ZMQ_HEARTBEAT_IVL``/``TIMEOUT``) turn a host that vanished without closing anything
into the same event. The monitor marks the peer gone (sends to it fail at once) and posts
``LOST`` to its receive loop, which first delivers what had already arrived, then calls
``peer_lost``. A peer that leaves says ``BYE`` first, so its disconnect is expected.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import itertools
import json
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import zmq
from rpcx.errors import LostCause, PeerLostError, ProtocolError, RpcTimeoutError
from rpcx.options import (
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_MAX_FRAME_BYTES,
)
from rpcx.transport import Capabilities, Frame, TransportContext
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from rpcx_zmq.addresses import host_identity, listen_host
from rpcx_zmq.options import CONNECTION_TIMEOUT_FACTOR

if TYPE_CHECKING:
    from rpcx._lanes import ReceiveLane

__all__ = ["INLINE_MAX", "ZERO_COPY_RECEIVE", "ZERO_COPY_SEND", "ZmqTransport"]

log = logging.getLogger("rpcx.backends.zmq")

# Buffers from this size on are sent from the tensor's memory. Below it a copy is cheaper
# than the tracker's round through pyzmq's garbage-collector thread.
ZERO_COPY_SEND = 256 << 10
# Parts from this size on are delivered as tensors over ZeroMQ's message memory. Smaller
# parts may share one receive buffer with other messages, and a copy costs little.
ZERO_COPY_RECEIVE = 64 << 10
_HWM = 4096  # messages queued per peer and direction before send waits (back-pressure)
_SEND_POLL_S = 0.1  # a send waiting for its tracker rechecks the peer this often
_WRITER_POLL_S = 0.02  # a writer waiting for room in a peer's queue retries this often
_DRAIN_WAIT_MS = 50  # after a loss, how long to wait for frames still on their way
_BYE_TIMEOUT = 10.0  # answering a peer's goodbye from a receive loop
_GRACE_S = 0.5  # close: what receive loops told to STOP get past the deadline
_IPC_PATH_MAX = 100  # sun_path holds 108 bytes on Linux, 104 on macOS

# Buffers up to this size travel inside the head part: one ZeroMQ part (one send, one
# receive, each releasing the GIL) per small frame instead of one per buffer.
INLINE_MAX = 32 << 10

_HEAD = struct.Struct("<BI")  # kind, number of buffers
_DATA, _BYE, _LOST, _STOP = 1, 2, 3, 4
_PLAIN_HEAD = _HEAD.pack(_DATA, 0)
_BYE_MESSAGE = [_HEAD.pack(_BYE, 0)]
_STOP_MESSAGE = [_HEAD.pack(_STOP, 0)]
_LOST_MESSAGE = [_HEAD.pack(_LOST, 0)]
_PART = -1  # a buffer's length in the head when it travels as a part of its own

_LOCAL = "local"  # the user name of a worker's own control sockets
_MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_MONITOR_STOPPED
)
_CRASHED = "its connection closed (its process probably exited or crashed)"

# ZeroMQ contexts whose sockets could not all be closed (a receive loop stuck in user
# code at close). Terminating one would block; collecting it would try to. Kept for good.
_abandoned: list[zmq.Context[Any]] = []
_ids = itertools.count()


class _Queued:
    """A message ZeroMQ's queue to a peer had no room for (or that came while others
    waited), waiting, in order, for the peer's writer thread."""

    __slots__ = ("bye", "done", "error", "parts")

    def __init__(self, parts: list[Any], bye: bool) -> None:
        self.parts = parts  # keeps any zero-copy part's memory alive until sent
        self.bye = bye
        self.done = threading.Event()
        self.error: PeerLostError | None = None

    def finish(self, error: PeerLostError | None = None) -> None:
        self.error = error
        self.done.set()


class _Peer:
    """Everything about one peer: its sockets, locks, goodbye flags and receive lane."""

    __slots__ = (
        "backlog", "bye_received", "bye_sent", "cause", "connected", "ctl", "ctl_lock",
        "draining", "ended", "endpoint", "gone", "lane", "lock", "name", "queued", "rank",
        "reader", "reported", "rx", "started", "stash", "stopping", "tx", "tx_lock",
        "tx_monitor", "writer",
    )

    def __init__(self, rank: int, name: str) -> None:
        self.rank = rank
        self.name = name
        self.rx: zmq.Socket[bytes] | None = None  # owned by whichever thread holds the lane
        self.ctl: zmq.Socket[bytes] | None = None  # posts LOST/STOP into rx; under ctl_lock
        self.tx: zmq.Socket[bytes] | None = None  # under tx_lock
        self.tx_monitor: zmq.Socket[bytes] | None = None  # owned by the monitor thread
        self.endpoint = ""
        self.tx_lock = threading.Lock()
        self.ctl_lock = threading.Lock()
        self.lock = threading.Lock()  # the flags below
        self.reader = threading.Lock()  # held by the thread running the receive loop
        self.stash: Frame | None = None  # received, to be delivered by the lane's holder
        self.bye_sent = False
        self.bye_received = False
        self.gone: str | None = None  # why sends to the peer fail, once it is gone
        self.cause = LostCause.CONNECTION_LOST  # what kind of "gone" that is
        self.reported = False  # peer_lost called (or not to be called)
        self.draining = False  # LOST seen: deliver what is left, then end
        self.started = False  # the receive loop was started
        self.lane: ReceiveLane | None = None
        self.connected = threading.Event()  # our connection to the peer shook hands
        self.ended = threading.Event()  # the receive loop is over: nothing more arrives
        # Messages waiting for room in ZeroMQ's queue, oldest first: while there are any,
        # later ones wait behind them (per-peer order). The writer thread, started the
        # first time one waits, sends them; ``queued`` guards the three and wakes it.
        self.backlog: collections.deque[_Queued] = collections.deque()
        self.queued = threading.Condition()
        self.writer: threading.Thread | None = None
        self.stopping = False  # close(): the writer ends


class ZmqTransport:
    """Moves frames over ZeroMQ: TCP between hosts, IPC within one, zero-copy tensors."""

    capabilities: ClassVar[Capabilities] = Capabilities(multi_process=True, multi_host=True)

    def __init__(self) -> None:
        self._ctx: TransportContext | None = None
        self._zctx: zmq.Context[Any] | None = None
        self._peers: dict[int, _Peer] = {}
        self._ipc_dir: str | None = None
        self._wake: zmq.Socket[bytes] | None = None  # posts to the monitor thread
        self._wake_lock = threading.Lock()
        self._monitor: threading.Thread | None = None
        self._closing = False
        self._closed = False
        self.endpoints: dict[int, str] = {}  # where this worker's tx connect, by peer rank
        self._zap: ThreadAuthenticator | None = None  # checks connections with a world key
        self._max_frame = DEFAULT_MAX_FRAME_BYTES  # options.max_frame_bytes, from start()

    # ------------------------------------------------------------------------ start

    def start(self, ctx: TransportContext) -> None:
        """Bind one socket per peer, publish the endpoints, connect to every peer's."""
        self._ctx = ctx
        options = ctx.options
        self._max_frame = int(getattr(options, "max_frame_bytes", self._max_frame))
        limit = options.rpc_timeout or None
        zctx: zmq.Context[Any] = zmq.Context(io_threads=1)
        self._zctx = zctx
        me = ctx.names[ctx.rank]
        host = listen_host(
            getattr(options, "hostname", None), getattr(options, "interface", None),
            ctx.init_method,
        )
        if getattr(options, "ipc", True):
            self._ipc_dir = _private_dir()
        token = f"{os.getpid()}-{next(_ids)}-{uuid.uuid4().hex[:8]}"
        if ctx.auth is not None:
            self._start_zap(ctx)
        published: dict[str, dict[str, str]] = {}
        for rank in range(ctx.world_size):
            if rank == ctx.rank:
                continue
            peer = self._peers[rank] = _Peer(rank, ctx.names[rank])
            published[str(rank)] = self._bind_rx(peer, host, token)
        # Ready to receive before anyone can find us.
        for peer in self._peers.values():
            name = f"rpcx-{me}-recv-{peer.name}"
            if ctx.receive_lane is not None:
                peer.lane = ctx.receive_lane(
                    name, functools.partial(self._receive_loop, peer.rank)
                )
            peer.started = True
            threading.Thread(
                target=self._receive_loop, args=(peer.rank,), name=name, daemon=True
            ).start()
        ctx.store.set(
            f"zmq/{ctx.rank}", json.dumps({"host": host_identity(), "rx": published})
        )
        for peer in self._peers.values():
            info = json.loads(ctx.store.get(f"zmq/{peer.rank}"))
            peer.endpoint = self._choose_endpoint(info)
            self.endpoints[peer.rank] = peer.endpoint
            self._connect_tx(peer)
        self._wake, wake_rx = _pipe(zctx, f"inproc://rpcx-zmq-{token}-monitor")
        self._monitor = threading.Thread(
            target=self._monitor_loop, args=(wake_rx,), name=f"rpcx-{me}-zmq-monitor",
            daemon=True,
        )
        self._monitor.start()
        self._wait_connected(limit)

    def _start_zap(self, ctx: TransportContext) -> None:
        """With a world key, every connection to one of our PULL sockets must log in as
        the peer it is for (ZeroMQ's PLAIN mechanism, checked by a ZAP handler thread):
        its password is a proof of the key bound to both ranks and this session's
        nonces, so a stray socket is refused before a message of it is read."""
        assert ctx.auth is not None and self._zctx is not None
        self._zap = ThreadAuthenticator(self._zctx, log=logging.getLogger("rpcx_zmq.zap"))
        self._zap.start()
        for rank in range(ctx.world_size):
            if rank != ctx.rank:
                self._zap.configure_plain(_zap_domain(rank), {
                    str(rank): _password(ctx, rank, ctx.rank),
                    _LOCAL: _password(ctx, ctx.rank, ctx.rank),  # our own control socket
                })

    def _bind_rx(self, peer: _Peer, host: str, token: str) -> dict[str, str]:
        """Create and bind the PULL socket for ``peer``; its endpoints for the peer."""
        zctx = self._zctx
        assert zctx is not None and self._ctx is not None
        rx = zctx.socket(zmq.PULL)
        self._tune(rx)
        rx.rcvhwm = _HWM
        # The first line of defence: ZeroMQ never allocates a part larger than the whole
        # frame may be. A part over it makes ZeroMQ drop the connection unread, and tells
        # no one why: the monitors see the same EVENT_DISCONNECTED as when a peer's
        # process exits, so both workers report the other's connection closed, not a
        # protocol error. A frame over max_frame_bytes in parts each within it is
        # refused by its total, as a protocol error (_unpack).
        rx.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        ctx = self._ctx
        if ctx.auth is not None:
            rx.zap_domain = _zap_domain(peer.rank).encode()
            rx.plain_server = True
        if ":" in host:  # an IPv6 address
            rx.ipv6 = True
            host = f"[{host}]"
        rx.bind(f"tcp://{host}:*")
        endpoints = {"tcp": _last_endpoint(rx)}
        if self._ipc_dir is not None:
            endpoints["ipc"] = f"ipc://{self._ipc_dir}/{peer.rank}"
            rx.bind(endpoints["ipc"])
        inproc = f"inproc://rpcx-zmq-{token}-{peer.rank}"
        rx.bind(inproc)
        ctl = zctx.socket(zmq.PUSH)
        ctl.linger = 0
        if ctx.auth is not None:
            ctl.plain_username = _LOCAL.encode()
            ctl.plain_password = _password(ctx, ctx.rank, ctx.rank).encode()
        ctl.connect(inproc)
        peer.rx, peer.ctl = rx, ctl
        return endpoints

    def _choose_endpoint(self, info: dict[str, Any]) -> str:
        """The peer's endpoint for us: IPC when it is on this host and can be reached."""
        ctx = self._ctx
        assert ctx is not None
        endpoints: dict[str, str] = info["rx"][str(ctx.rank)]
        ipc = endpoints.get("ipc")
        if ipc and self._ipc_dir is not None and info["host"] == host_identity():
            path = ipc[len("ipc://"):]
            # Same host, same mount namespace: the path should be there. If it is not (or
            # belongs to another user), TCP still works.
            if os.access(path, os.W_OK):
                return ipc
        return endpoints["tcp"]

    def _connect_tx(self, peer: _Peer) -> None:
        zctx = self._zctx
        assert zctx is not None
        tx = zctx.socket(zmq.PUSH)
        self._tune(tx)
        tx.sndhwm = _HWM
        tx.immediate = True  # queue only on a live connection: a lost peer's sends fail
        tx.sndtimeo = 0  # sends never wait for room: the peer's writer thread does
        if peer.endpoint.startswith("tcp://["):
            tx.ipv6 = True
        ctx = self._ctx
        assert ctx is not None
        if ctx.auth is not None:
            tx.plain_username = str(ctx.rank).encode()
            tx.plain_password = _password(ctx, ctx.rank, peer.rank).encode()
        peer.tx_monitor = tx.get_monitor_socket(_MONITOR_EVENTS)
        tx.connect(peer.endpoint)
        peer.tx = tx

    def _tune(self, sock: zmq.Socket[bytes]) -> None:
        """Options shared by rx and tx: heartbeats, no linger by default."""
        ctx = self._ctx
        assert ctx is not None
        sock.linger = 0
        interval = float(getattr(ctx.options, "heartbeat_interval", DEFAULT_HEARTBEAT_INTERVAL))
        timeout = CONNECTION_TIMEOUT_FACTOR * float(
            getattr(ctx.options, "heartbeat_timeout", DEFAULT_HEARTBEAT_TIMEOUT))
        if interval > 0:
            sock.setsockopt(zmq.HEARTBEAT_IVL, int(interval * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TTL, int(timeout * 1000))

    def _wait_connected(self, limit: float | None) -> None:
        """Wait (at most ``limit`` seconds) until our connection to every peer is up."""
        ctx = self._ctx
        assert ctx is not None
        deadline = None if limit is None else time.monotonic() + limit
        for peer in self._peers.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            peer.connected.wait(left)
        missing = [p for p in self._peers.values() if not p.connected.is_set()]
        if missing:
            names = ", ".join(f"{p.name!r} at {p.endpoint}" for p in missing)
            raise RpcTimeoutError(
                f"init_rpc: worker {ctx.names[ctx.rank]!r} (rank {ctx.rank}) could not "
                f"connect to {names} within {limit:g} s (rpc_timeout); a peer probably "
                "died after joining the world, or its address cannot be reached from "
                "here (set ZmqRpcBackendOptions(hostname=...) or interface=...)"
            )

    # ------------------------------------------------------------------------- send

    def send(self, dst: int, frame: Frame) -> None:
        """Send ``frame`` to ``dst``; returns once every buffer not copied is written."""
        peer = self._peers[dst]
        if peer.gone is not None:
            raise PeerLostError(peer.gone)
        buffers = frame.buffers
        if not buffers:
            self._post(peer, [_PLAIN_HEAD + frame.header], until=frame.deadline)
            return
        n = len(buffers)
        # Each buffer's element size (the alignment its dtype needs at the receiver) and
        # length, or _PART for a buffer that follows as a part of its own.
        sizes = bytearray(n)
        lengths = [0] * n
        inline: list[bytes] = []
        parts: list[Any] = [b""]
        trackers: list[zmq.MessageTracker] = []
        for index, buffer in enumerate(buffers):
            size = sizes[index] = buffer.element_size()
            nbytes = buffer.numel() * size
            if nbytes <= INLINE_MAX:
                lengths[index] = nbytes
                if nbytes:
                    inline.append(ctypes.string_at(buffer.data_ptr(), nbytes))
                continue
            lengths[index] = _PART
            if nbytes < ZERO_COPY_SEND:
                parts.append(ctypes.string_at(buffer.data_ptr(), nbytes))
                continue
            owned = index in frame.owned
            part = zmq.Frame(_memory_of(buffer, nbytes), copy=False, track=not owned)
            parts.append(part)
            if not owned:
                assert part.tracker is not None
                trackers.append(part.tracker)
        parts[0] = b"".join(
            (_HEAD.pack(_DATA, n), sizes, struct.pack(f"<{n}q", *lengths), frame.header,
             *inline)
        )
        if not self._post(peer, parts, until=frame.deadline):
            log.debug("send to rank %d still queued at its deadline", dst)
            return
        if trackers:
            # libzmq sent copies of our frames (sharing the bytes): the tracker fires
            # once every copy is released, ours included.
            del parts, part
            for tracker in trackers:
                if not self._wait_written(peer, tracker, frame.deadline):
                    log.debug("send to rank %d still being written at its deadline", dst)
                    return

    def _post(self, peer: _Peer, parts: list[Any], deadline: float | None = None,
              until: float = 0.0) -> bool:
        """Queue one message to ``peer`` and wait until ZeroMQ has it, or until ``until``
        (a call's deadline; 0: none); False if that came first.

        Never waits for room under the socket's lock: a message ZeroMQ's queue has no
        room for, and any that come while one waits, go to the peer's writer thread, in
        order. So a peer that reads nothing holds no call past its deadline.

        ``deadline`` set: this is our goodbye, which goes out even to a peer already gone
        (it may be answering ours) and gives up at the deadline.
        """
        bye = deadline is not None
        with peer.tx_lock:
            if peer.bye_sent:
                raise PeerLostError(peer.gone or "has shut down")
            if not bye and peer.gone is not None:
                raise PeerLostError(peer.gone)
            tx = peer.tx
            if tx is None:
                raise PeerLostError("cannot be reached: this worker has shut down"
                                    if self._closed else "was never connected")
            sent = not peer.backlog and self._send_now(tx, parts)
            if bye:
                peer.bye_sent = True  # (refuses later frames; the goodbye goes last)
            if sent:
                return True
            queued = self._queue(peer, parts, bye)
        return self._wait_queued(queued, deadline if deadline is not None else until)

    @staticmethod
    def _send_now(tx: zmq.Socket[bytes], parts: list[Any]) -> bool:
        """Hand ``parts`` to ZeroMQ if its queue has room; False if not (call under
        ``tx_lock``)."""
        try:
            tx.send_multipart(parts, copy=False)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            raise PeerLostError(f"is unreachable: {exc}") from None

    def _queue(self, peer: _Peer, parts: list[Any], bye: bool) -> _Queued:
        """Put a message behind those waiting for ``peer``'s writer (under ``tx_lock``)."""
        queued = _Queued(parts, bye)
        with peer.queued:
            peer.backlog.append(queued)
            if peer.writer is None:
                ctx = self._ctx
                assert ctx is not None
                peer.writer = threading.Thread(
                    target=self._write_backlog, args=(peer,), daemon=True,
                    name=f"rpcx-{ctx.names[ctx.rank]}-send-{peer.name}")
                peer.writer.start()
            peer.queued.notify()
        return queued

    @staticmethod
    def _wait_queued(queued: _Queued, until: float) -> bool:
        """Wait for a queued message until ``until`` (0: until sent or failed)."""
        left = None if not until else max(0.0, until - time.monotonic())
        if not queued.done.wait(left):
            if queued.bye:
                raise PeerLostError("is not reading (goodbye not sent)")
            return False  # a peer that reads nothing: the call fails on time
        if queued.error is not None:
            raise queued.error
        return True

    def _write_backlog(self, peer: _Peer) -> None:
        """The writer thread: send ``peer``'s queued messages in order, as its queue
        drains. It looks for room every ``_WRITER_POLL_S`` (ZeroMQ cannot tell another
        thread), holding the socket's lock only to try."""
        while True:
            with peer.queued:
                while not peer.backlog and not peer.stopping:
                    peer.queued.wait()
                if not peer.backlog:
                    return
                queued = peer.backlog[0]
            error: PeerLostError | None = None
            try:
                sent = self._try_queued(peer, queued)
            except PeerLostError as exc:
                sent, error = True, exc  # (done with: it fails)
            if not sent:
                with peer.queued:  # (a new message or close() wakes it early)
                    peer.queued.wait(_WRITER_POLL_S)
                continue
            with peer.queued:
                peer.backlog.popleft()
            queued.finish(error)

    def _try_queued(self, peer: _Peer, queued: _Queued) -> bool:
        """Try to hand the first waiting message to ZeroMQ; ``PeerLostError`` when it
        never will be (the peer is gone, or this worker is leaving)."""
        with peer.tx_lock:
            tx = peer.tx
            if tx is None:
                raise PeerLostError("cannot be reached: this worker has shut down")
            if not queued.bye and peer.gone is not None:
                raise PeerLostError(peer.gone)
            if not queued.bye and self._closing:
                raise PeerLostError("cannot be reached: this worker is shutting down")
            return self._send_now(tx, queued.parts)

    def _wait_written(self, peer: _Peer, tracker: zmq.MessageTracker, deadline: float) -> bool:
        """Wait until libzmq is done with a buffer sent from the caller's memory; False
        if the frame's ``deadline`` (a request's; 0: none) passed first. The message
        keeps the memory alive until ZeroMQ is done with it either way."""
        while True:
            try:
                tracker.wait(_SEND_POLL_S)
                return True
            except zmq.NotDone:
                if deadline and time.monotonic() >= deadline:
                    return False  # a peer that reads nothing: the call fails on time
                if peer.gone is not None:
                    # The message keeps the memory alive until ZeroMQ drops it.
                    raise PeerLostError(peer.gone) from None
                if self._closed:
                    raise PeerLostError("cannot be reached: this worker has shut down"
                                        ) from None

    # ---------------------------------------------------------------------- receive

    def _receive_loop(self, src: int) -> None:
        """Receive and deliver ``src``'s frames, in order, until its goodbye or loss.

        Runs on whichever thread holds the peer's lane: it returns early, leaving the
        loop to that thread, when a request it served moved the role elsewhere.
        """
        peer = self._peers[src]
        if peer.lane is not None:
            peer.lane.enter()
        try:
            self._receive_frames(peer)
        except Exception:  # a bug here must not leave the peer's frames unread silently
            log.exception("receive loop for %s failed", peer.name)
            self._mark_lost(peer, "is unreachable: its receive loop failed")
            with peer.reader:
                self._end_receiving(peer)
            self._report(peer, peer.gone or "is unreachable: its receive loop failed")

    def _receive_frames(self, peer: _Peer) -> None:
        """The loop itself, until the peer is done or another thread took over.

        A ZeroMQ socket must never be used by two threads at once, so every use of
        ``rx`` is under the peer's ``reader`` lock (delivering is not: a request served
        on this thread may block, and the next holder of the lane receives meanwhile).
        Normally the role moves only while a request is served, and the next holder
        finds the lock free. rpcx can also start a second holder while the first waits
        in ``recv`` (see the README, "Known issue in rpcx"): the newcomer then waits for
        the lock, and the old reader, on its next frame, sees it lost the role, leaves
        the frame in ``stash`` for the newcomer and returns. Nothing is received twice,
        lost, or left waiting.
        """
        ctx = self._ctx
        assert ctx is not None
        lane = peer.lane
        deliver = ctx.deliver
        src = peer.rank
        while True:
            with peer.reader:
                if peer.ended.is_set():  # the loop ended while this thread waited
                    if lane is not None:
                        lane.leave()
                    return
                frame, peer.stash = peer.stash, None
                lost: str | None = None  # the loop ends, and the peer is reported so
                if frame is None:
                    frame, lost = self._receive_one(peer)
                    if frame is None:
                        self._end_receiving(peer)
                elif lane is not None and not lane.still_held():
                    peer.stash = frame  # the holder delivers it, first thing
                    return
            if frame is None:
                if lost:
                    self._report(peer, lost)
                return
            try:
                deliver(src, frame)
            except ProtocolError as exc:  # refused above the transport: stop reading it
                reason = f"is unreachable: protocol error: {exc}"
                self._mark_lost(peer, reason, LostCause.PROTOCOL_ERROR)
                with peer.reader:
                    self._end_receiving(peer)
                self._report(peer, peer.gone or reason)
                return
            except Exception:
                log.exception("%s: delivering a frame from %s failed",
                              ctx.names[ctx.rank], peer.name)
            del frame
            if lane is not None and not lane.still_held():
                return  # a follower receives from here on

    def _receive_one(self, peer: _Peer) -> tuple[Frame | None, str]:
        """The next frame from ``peer``'s socket (under ``reader``).

        ``(frame, "")``, or ``(None, reason)`` when the loop is over: ``reason`` is what
        to report (``""``: nothing, as after a goodbye while closing, or a STOP).
        """
        ctx = self._ctx
        rx = peer.rx
        assert ctx is not None and rx is not None
        while True:
            if peer.draining and not rx.poll(_DRAIN_WAIT_MS):
                return None, peer.gone or f"is unreachable: {_CRASHED}"
            try:
                head = rx.recv()
            except zmq.ZMQError as exc:  # the context is gone: nothing more can arrive
                self._mark_lost(peer, f"is unreachable: {exc}")
                return None, peer.gone or f"is unreachable: {exc}"
            if len(head) < _HEAD.size:
                log.warning("%s: dropped a malformed message from %s",
                            ctx.names[ctx.rank], peer.name)
                continue
            kind, n = _HEAD.unpack_from(head)
            if kind == _DATA:
                try:
                    return self._unpack(rx, head, n, self._max_frame), ""
                except ProtocolError as exc:  # not a frame this format writes: stop
                    reason = f"is unreachable: protocol error: {exc}"
                    log.warning("%s: %s %s", ctx.names[ctx.rank], peer.name, reason)
                    self._mark_lost(peer, reason, LostCause.PROTOCOL_ERROR)
                    return None, peer.gone or reason
            if kind == _BYE:
                self._on_bye(peer)
                return None, "has shut down"
            if kind == _LOST:
                peer.draining = True
            elif kind == _STOP:
                return None, ""
            else:
                log.warning("%s: dropped a message of unknown kind %d from %s",
                            ctx.names[ctx.rank], kind, peer.name)

    @staticmethod
    def _unpack(rx: zmq.Socket[bytes], head: bytes, n: int, max_frame: int) -> Frame:
        """The frame whose head part is ``head``; receives its other parts from ``rx``.

        ``ProtocolError`` for a head no sender writes, or a frame (header plus every
        buffer) over ``max_frame`` bytes (``max_frame_bytes``).
        """
        if n == 0:  # the head is all there is, and MAXMSGSIZE kept it within max_frame
            return Frame(head[_HEAD.size:])
        # Every length is checked against the head before any byte is copied out of it:
        # a peer's numbers must never send a copy past the end of the message.
        if len(head) < _HEAD.size + 9 * n:
            raise ProtocolError(f"a head of {len(head)} bytes for {n} buffers")
        start = _HEAD.size + n
        sizes = head[_HEAD.size:start]
        lengths = struct.unpack_from(f"<{n}q", head, start)
        start += 8 * n
        if any(length < 0 and length != _PART for length in lengths):
            raise ProtocolError("a negative buffer length")
        end = len(head) - sum(length for length in lengths if length > 0)
        if end < start:
            raise ProtocolError(f"buffers of {len(head) - end} bytes in a head of {len(head)}")
        # The frame's size is checked before a byte of it is copied or becomes a tensor:
        # its header and small buffers (in the head), plus every part. ZeroMQ holds a
        # message's parts once its first is read (each within MAXMSGSIZE), so taking
        # them costs no copy; their lengths are the parts' own.
        total = len(head) - start
        parts: list[zmq.Frame] = []
        for length in lengths:
            if length == _PART:
                if not rx.getsockopt(zmq.RCVMORE):
                    raise ProtocolError("a buffer announced as a part of its own, but no part")
                part = rx.recv(copy=False)
                total += len(part)
                parts.append(part)
        if total > max_frame:
            raise ProtocolError(f"a frame of {total} bytes, over max_frame_bytes ({max_frame})")
        header = head[start:end]
        address = ctypes.cast(ctypes.c_char_p(head), ctypes.c_void_p).value
        assert address is not None
        address += end
        buffers = []
        next_part = iter(parts).__next__
        for size, length in zip(sizes, lengths, strict=True):
            if length == _PART:
                buffers.append(_as_tensor(next_part(), size))
                continue
            buffer = torch.empty(length, dtype=torch.uint8)
            if length:
                ctypes.memmove(buffer.data_ptr(), address, length)
                address += length
            buffers.append(buffer)
        return Frame(header, buffers)

    def _end_receiving(self, peer: _Peer) -> None:
        """Close ``rx`` and mark the loop over (the caller holds ``reader``)."""
        rx, peer.rx = peer.rx, None
        if rx is not None:
            rx.close(linger=0)
        if peer.lane is not None:
            peer.lane.leave()
        peer.ended.set()

    def _on_bye(self, peer: _Peer) -> None:
        with peer.lock:
            peer.bye_received = True
            if peer.gone is None:
                peer.gone = "has shut down"
                peer.cause = LostCause.DEPARTED
            answer = not peer.bye_sent
        if answer:  # the peer left on its own: let its receive loop for us end too
            try:
                self._post(peer, _BYE_MESSAGE, deadline=time.monotonic() + _BYE_TIMEOUT)
            except PeerLostError as exc:
                log.debug("goodbye to %s not sent: %s", peer.name, exc)

    def _mark_lost(self, peer: _Peer, reason: str,
                   cause: LostCause = LostCause.CONNECTION_LOST) -> None:
        """The peer is gone: sends fail from now on; its receive loop reports it."""
        with peer.lock:
            if peer.gone is not None:
                return
            peer.gone = reason
            peer.cause = cause
        if peer.ended.is_set() or not peer.started:
            self._report(peer, reason)
        else:
            self._post_control(peer, _LOST_MESSAGE)

    def _report(self, peer: _Peer, reason: str) -> None:
        ctx = self._ctx
        assert ctx is not None
        with peer.lock:
            if peer.reported:
                return
            peer.reported = True
        if not self._closing:
            ctx.peer_lost(peer.rank, reason, peer.cause)

    def _post_control(self, peer: _Peer, message: list[bytes]) -> None:
        with peer.ctl_lock:
            if peer.ctl is None:
                return
            # The receive loop may be over already: never wait for it.
            with contextlib.suppress(zmq.ZMQError):
                peer.ctl.send_multipart(message, flags=zmq.NOBLOCK)

    # ---------------------------------------------------------------------- monitor

    def _monitor_loop(self, wake: zmq.Socket[bytes]) -> None:
        """Turn every peer connection's events into ``connected`` or a lost peer."""
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        owners: dict[zmq.Socket[bytes], _Peer] = {}
        for peer in self._peers.values():
            if peer.tx_monitor is not None:
                owners[peer.tx_monitor] = peer
                poller.register(peer.tx_monitor, zmq.POLLIN)
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is wake:
                        wake.recv()
                        return
                    peer = owners[sock]
                    try:
                        event = recv_monitor_message(sock, zmq.NOBLOCK)
                    except zmq.Again:
                        continue
                    if self._on_event(peer, int(event["event"])):
                        poller.unregister(sock)
                        del owners[sock]
                        sock.close(linger=0)
        except zmq.ZMQError as exc:
            log.debug("monitor thread ends: %s", exc)
        finally:
            for sock in owners:
                sock.close(linger=0)
            wake.close(linger=0)

    def _on_event(self, peer: _Peer, event: int) -> bool:
        """Handle one monitor event of our connection to ``peer``; True: monitor over."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            peer.connected.set()
        elif event == zmq.EVENT_DISCONNECTED:
            if peer.connected.is_set() and not (self._closing or peer.bye_received):
                self._mark_lost(peer, f"is unreachable: {_CRASHED}")
        elif event == zmq.EVENT_MONITOR_STOPPED:
            return True
        elif peer.connected.is_set():  # a handshake failed after the first succeeded
            self._mark_lost(peer, "is unreachable: a new connection to it failed")
        else:
            log.debug("connection to %s at %s: event %#x", peer.name, peer.endpoint, event)
        return False

    # ------------------------------------------------------------------------ close

    def close(self, timeout: float) -> None:
        """Say goodbye to every peer, wait (bounded) for theirs, release the sockets."""
        ctx, zctx = self._ctx, self._zctx
        if ctx is None or zctx is None or self._closed:
            return
        self._closing = True
        deadline = time.monotonic() + timeout
        for peer in self._peers.values():
            # No goodbye to a peer that was never reached, or that crashed.
            crashed = peer.gone is not None and not peer.bye_received
            if peer.connected.is_set() and not peer.bye_sent and not crashed:
                try:
                    self._post(peer, _BYE_MESSAGE, deadline=deadline)
                except PeerLostError as exc:
                    log.debug("goodbye to %s not sent: %s", peer.name, exc)
        started = [p for p in self._peers.values() if p.started]
        for peer in started:
            if not peer.connected.is_set():  # start failed: nothing to wait for
                self._post_control(peer, _STOP_MESSAGE)
        for peer in started:
            peer.ended.wait(max(0.0, deadline - time.monotonic()))
        silent = [p for p in started if not p.ended.is_set()]
        if silent:
            log.warning(
                "%s: no goodbye from %s within %.1f s",
                ctx.names[ctx.rank], ", ".join(p.name for p in silent), timeout,
            )
        for peer in silent:  # a loop waiting in recv ends on STOP at once
            self._post_control(peer, _STOP_MESSAGE)
        for peer in silent:  # past the deadline now: a short grace, no more
            peer.ended.wait(max(0.0, deadline + _GRACE_S - time.monotonic()))
        stuck = [p for p in started if not p.ended.is_set()]
        self._closed = True
        self._stop_monitor(max(_GRACE_S, deadline - time.monotonic()))
        for peer in self._peers.values():
            with peer.ctl_lock:
                if peer.ctl is not None:
                    peer.ctl.close(linger=0)
                    peer.ctl = None
            with peer.tx_lock:
                if peer.tx is not None:
                    # Our goodbye may still be queued: give it a moment to leave.
                    left = max(0.0, min(1.0, deadline - time.monotonic()))
                    peer.tx.close(linger=int(left * 1000))
                    peer.tx = None
            with peer.queued:  # its writer fails what still waits, then ends
                peer.stopping = True
                peer.queued.notify()
            if not peer.started and peer.rx is not None:
                peer.rx.close(linger=0)
                peer.rx = None
            if self._monitor is None and peer.tx_monitor is not None:
                peer.tx_monitor.close(linger=0)  # start failed before the monitor ran
                peer.tx_monitor = None
        monitor_alive = self._monitor is not None and self._monitor.is_alive()
        if stuck or monitor_alive:
            log.warning(
                "%s: receive loops for %s still busy; their sockets stay open",
                ctx.names[ctx.rank], ", ".join(p.name for p in stuck) or "none",
            )
            _abandoned.append(zctx)
        else:
            if self._zap is not None:
                self._zap.stop()
            zctx.term()
        self._zctx = None
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _stop_monitor(self, timeout: float) -> None:
        with self._wake_lock:
            if self._wake is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._wake.send(b"stop", flags=zmq.NOBLOCK)
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout)
        with self._wake_lock:
            if self._wake is not None:
                self._wake.close(linger=0)
                self._wake = None


def _zap_domain(rank: int) -> str:
    """The ZAP domain of the PULL socket that receives from ``rank``."""
    return f"rpcx-from-{rank}"


def _password(ctx: TransportContext, src: int, dst: int) -> str:
    """What ``src`` logs in with on ``dst``'s socket for it (a proof of the world key)."""
    assert ctx.auth is not None
    return ctx.auth.proof("zmq connect", src, dst).hex()


def _pipe(zctx: zmq.Context[Any], address: str) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """Two connected inproc PAIR sockets: (sending end, receiving end)."""
    receiving = zctx.socket(zmq.PAIR)
    receiving.linger = 0
    receiving.bind(address)
    sending = zctx.socket(zmq.PAIR)
    sending.linger = 0
    sending.connect(address)
    return sending, receiving


def _last_endpoint(sock: zmq.Socket[bytes]) -> str:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


def _private_dir() -> str | None:
    """A fresh directory only this user can enter, for ``ipc://`` sockets (or None)."""
    path = tempfile.mkdtemp(prefix="rpcx-zmq-")
    if len(path) + 12 > _IPC_PATH_MAX:  # room for "/<rank>"
        log.info("temp directory %s is too long for ipc:// paths; using TCP only", path)
        os.rmdir(path)
        return None
    return path


def _memory_of(tensor: torch.Tensor, nbytes: int) -> ctypes.Array[ctypes.c_char]:
    """A buffer over a contiguous CPU tensor's memory that keeps the tensor alive.

    rpcx does not require numpy, and a tensor has no buffer interface of its own, so the
    memory is exposed through ctypes. ZeroMQ holds the returned object until it is done
    with the bytes, and the object holds the tensor.
    """
    memory = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    memory.tensor = tensor  # type: ignore[attr-defined]  # ctypes objects take attributes
    return memory


def _as_tensor(part: zmq.Frame, alignment: int) -> torch.Tensor:
    """A received part as a flat ``uint8`` tensor, over ZeroMQ's memory when it is safe.

    ``alignment``: the element size of the tensor the part will be viewed as.
    """
    nbytes = len(part)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if nbytes >= ZERO_COPY_RECEIVE:
        # The tensor keeps the frame, and so libzmq's message, alive. The memory is the
        # message's own (libzmq allocates every large message separately) and writable.
        tensor = torch.frombuffer(part, dtype=torch.uint8)
        if alignment and tensor.data_ptr() % alignment == 0:
            return tensor
        return tensor.clone()
    return torch.frombuffer(bytearray(part.buffer), dtype=torch.uint8)
