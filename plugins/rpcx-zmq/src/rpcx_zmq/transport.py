"""The zmq transport: frames over ZeroMQ PUSH/PULL sockets, one pair per peer and direction.

Wire format: a frame is one ZeroMQ multipart message (ZeroMQ keeps a message's parts
together and in order): a head part, then one part per buffer larger than
``INLINE_MAX``. The head is ``kind (u8), n (u32)``, then for each of the ``n`` buffers its
element size (u8: the alignment its dtype needs) and its length (i64; -1: it follows as a
part of its own), then the frame's header, then the small buffers' bytes. So a small
frame is one part: one send and one receive, each of which releases the GIL. Kinds:
``DATA`` (a frame), ``PIECE`` and ``BYE`` (the last message a worker sends a peer).
``LOST`` and ``STOP`` never cross the wire: they are posted to a receive loop through an
``inproc://`` endpoint of its own socket. A buffer larger than the kit's ``PIECE_BYTES``
sent to another host follows its frame's message in pieces, each a message ``PIECE``
and its bytes (ZeroMQ hands a message over only whole, and the receiver must see a long
transfer move: ``TransportContext.progress``); its length in the head is then
``-2 - size``.

Sockets, per peer: a PULL socket (``rx``) bound for that peer alone, read by one receive
loop; a PUSH socket (``tx``) connected to the peer's PULL for this worker, written under
the peer's send lock; and a control PUSH (``ctl``) into ``rx``. Same-host peers connect
over ``ipc://`` (a private temp directory), others over TCP. Every ``tx`` has a socket
monitor (ZeroMQ reconnects silently): a disconnect ends the link (``Link.end``) and
posts ``LOST`` to its receive loop, which delivers what came before, then reports it.

The rest is rpcx's transport kit (:class:`rpcx.transport_kit.MessageTransport`): receive
loops on lanes, goodbyes, lost-peer reports, a dynamic world's doorway, the bounded
close, and "write now or queue" (a send never waits for room in ``tx``'s queue). The
README says why each choice: zero-copy tensors and their alignment, the size limit and
``MAXMSGSIZE``, heartbeats, back-pressure.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import json
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import zmq
from rpcx.transport import Capabilities, Frame, TransportContext
from rpcx.transport_kit import (
    ADMITTED,
    PIECE_BYTES,
    Backlog,
    Link,
    LinkEnded,
    LostCause,
    MessageTransport,
    PeerLostError,
    ProtocolError,
    StopReceiving,
    as_bytes,
    check_frame_size,
    host_identity,
    lost_reason,
    options_as,
    owning_memory,
    pieces,
    wait_connected,
)
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from rpcx_zmq.addresses import listen_host
from rpcx_zmq.options import CONNECTION_TIMEOUT_FACTOR, ZmqRpcBackendOptions

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
_GRACE_S = 0.5  # close: how long past the deadline the monitor thread may take to end
_IPC_PATH_MAX = 100  # sun_path holds 108 bytes on Linux, 104 on macOS

# Buffers up to this size travel inside the head part: one ZeroMQ part (one send, one
# receive, each releasing the GIL) per small frame instead of one per buffer.
INLINE_MAX = 32 << 10

_HEAD = struct.Struct("<BI")  # kind, number of buffers
_DATA, _BYE, _LOST, _STOP, _PIECE = 1, 2, 3, 4, 5
_PLAIN_HEAD = _HEAD.pack(_DATA, 0)
_PIECE_HEAD = _HEAD.pack(_PIECE, 0)
_BYE_MESSAGE = [_HEAD.pack(_BYE, 0)]
_STOP_MESSAGE = [_HEAD.pack(_STOP, 0)]
_LOST_MESSAGE = [_HEAD.pack(_LOST, 0)]
_PART = -1  # a buffer's length in the head when it travels as a part of its own
# A buffer larger than the kit's PIECE_BYTES, to a peer on another host (a TCP endpoint),
# travels as messages of its own after the frame's message, one per piece (``PIECE``,
# then the bytes), so the receiver sees it arrive (TransportContext.progress; ZeroMQ
# hands a message over only whole). Its length in the head is then _PIECED - its size.
# One host's peers (ipc://) get it whole: no link there is slow, and the pieces cost a
# copy at the receiver.
_PIECED = -2

_LOCAL = "local"  # the user name of a worker's own control sockets
_DOORWAY = "zmq-door"  # the doorway's label (store keys, handshake) in a dynamic world
_MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_MONITOR_STOPPED
)
# The detail of a peer whose connection ZeroMQ saw close ("is unreachable: ...").
_CRASHED = "its connection closed (its process probably exited or crashed)"
_CLOSED = "cannot be reached: this worker has shut down"  # sends after close
_CLOSING = "cannot be reached: this worker is shutting down"  # queued frames at close

# ZeroMQ contexts whose sockets could not all be closed (a receive loop stuck in user
# code at close). Terminating one would block; collecting it would try to. Kept for good.
_abandoned: list[zmq.Context[Any]] = []
_ids = itertools.count()


class _Message:
    """A message ZeroMQ's queue to a peer had no room for (or that came while others
    waited), for the peer's writer; ``error`` when it is not to be sent after all."""

    __slots__ = ("bye", "error", "messages")

    def __init__(self, messages: list[list[Any]], bye: bool = False) -> None:
        # One frame's messages (its pieces after the first), in order, those not yet
        # handed to ZeroMQ; keeps any zero-copy part's memory alive until sent.
        self.messages = messages
        self.bye = bye
        self.error: PeerLostError | None = None


class _Peer(Link):
    """The kit's link to one peer, plus its sockets and what ZeroMQ's monitor saw.

    ``lock`` (the kit's send lock) guards ``tx`` and the goodbye flags; ``reading`` (the
    kit's) every use of ``rx``, which only the receive loop makes.
    """

    __slots__ = ("connected", "ctl", "ctl_lock", "draining", "endpoint", "rx", "tx",
                 "tx_monitor", "wake")

    def __init__(self, rank: int, name: str) -> None:
        super().__init__(rank, name)
        self.rx: zmq.Socket[bytes] | None = None  # owned by whichever thread holds the lane
        self.ctl: zmq.Socket[bytes] | None = None  # posts LOST/STOP into rx; under ctl_lock
        self.tx: zmq.Socket[bytes] | None = None  # under lock
        self.tx_monitor: zmq.Socket[bytes] | None = None  # owned by the monitor thread
        self.endpoint = ""
        self.ctl_lock = threading.Lock()
        self.draining = False  # LOST seen: deliver what is left, then end
        self.connected = threading.Event()  # our connection to the peer shook hands
        self.wake = threading.Event()  # close(): the writer stops waiting for room


class ZmqTransport(MessageTransport[_Peer]):
    """Moves frames over ZeroMQ: TCP between hosts, IPC within one, zero-copy tensors."""

    capabilities: ClassVar[Capabilities] = Capabilities(multi_process=True, multi_host=True,
                                                        dynamic=True, shows_progress=True)
    label: ClassVar[str] = "zmq"
    connection_errors = (zmq.ZMQError,)  # (the context is gone: nothing more arrives)

    def __init__(self) -> None:
        super().__init__()
        # A dynamic world: the monitors the monitor thread is to take on, this worker's
        # endpoints' host and token (for the sockets of newcomers).
        self._new_monitors: list[_Peer] = []
        self._host = ""
        self._token = ""
        self._options = ZmqRpcBackendOptions()
        self._zctx: zmq.Context[Any] | None = None
        self._ipc_dir: str | None = None
        self._wake: zmq.Socket[bytes] | None = None  # posts to the monitor thread
        self._wake_lock = threading.Lock()
        self._monitor: threading.Thread | None = None
        self._closed = False
        self.endpoints: dict[int, str] = {}  # where this worker's tx connect, by peer rank
        self._zap: ThreadAuthenticator | None = None  # checks connections with a world key

    # ------------------------------------------------------------------------ start

    def start(self, ctx: TransportContext) -> None:
        """Bind one socket per peer, publish the endpoints, connect to every peer's."""
        self._ctx = ctx
        options = self._options = options_as(ctx, ZmqRpcBackendOptions)
        self.max_frame = options.max_frame_bytes
        self._zctx = zctx = zmq.Context(io_threads=1)
        host = self._host = listen_host(options.hostname, options.interface, ctx.init_method)
        if options.ipc:
            self._ipc_dir = _private_dir()
        token = self._token = f"{os.getpid()}-{next(_ids)}-{uuid.uuid4().hex[:8]}"
        if ctx.auth is not None:
            self._start_zap(ctx)
        links: dict[int, _Peer] = {}
        published: dict[str, dict[str, str]] = {}
        try:
            for rank in range(len(ctx.names)):
                if rank != ctx.rank and not ctx.vacant(rank):
                    links[rank] = self._new_peer(rank)
                    published[str(rank)] = self._bind_rx(links[rank], host, token)
        except BaseException:
            for peer in links.values():
                self._close_sockets(peer, unused=True)
            raise
        self.begin(ctx, links)  # (ready to receive before anyone can find us)
        ctx.store.set(
            f"zmq/{ctx.rank}", json.dumps({"host": host_identity(), "rx": published})
        )
        if ctx.admit is not None:  # (members connect to us once told; this closes)
            for sock in self.join_through_doorways(ctx, host, _DOORWAY).values():
                sock.close()
        for peer in self.peers:
            info = json.loads(ctx.store.get(
                f"zmq/{peer.rank}" if ctx.admit is None else f"zmq/{peer.rank}/for/{ctx.rank}"))
            peer.endpoint = self.endpoints[peer.rank] = self._choose_endpoint(info)
            self._connect_tx(peer)
        self._wake, wake_rx = _pipe(zctx, f"inproc://rpcx-zmq-{token}-monitor")
        self._monitor = threading.Thread(target=self._monitor_loop, args=(wake_rx,),
                                         name=self.thread_name("zmq-monitor"), daemon=True)
        self._monitor.start()
        wait_connected(ctx, {f"{p.name!r} at {p.endpoint}": p.connected for p in self.peers},
                       hint="a peer probably died after joining the world, or its address "
                       "cannot be reached from here (set ZmqRpcBackendOptions(hostname=...) "
                       "or interface=...)")
        self.open_doorway()

    def _new_peer(self, rank: int) -> _Peer:
        peer = _Peer(rank, self.ctx.names[rank])
        peer.backlog = Backlog(peer.lock, functools.partial(self._write, peer),
                               self.thread_name("send", peer.name))
        return peer

    # --------------------------------------------------------------- dynamic world

    def retire(self, link: _Peer) -> None:
        """Close the sockets of a peer that left (its receive loop is over, and closed
        ``rx``; its monitor ends with ``tx``), before a new worker takes its rank: the
        context's end waits for every socket, and ``close`` only sees the peers of now."""
        self._close_sockets(link)

    def link_newcomer(self, rank: int, sock: socket.socket) -> _Peer:
        """A worker joins at ``rank``: bind a socket for it and publish it, connect to
        the one it bound for this worker, tell it (it connects once told)."""
        ctx = self.ctx
        peer = self._new_peer(rank)
        if self._zap is not None:  # (its session was read at the doorway: renew)
            self._allow(rank)
        try:
            # (a name of its own per admission: a rank taken again gets fresh ones)
            mine = self._bind_rx(peer, self._host, f"{self._token}-{next(_ids)}")
            ctx.store.set(f"zmq/{ctx.rank}/for/{rank}",
                          json.dumps({"host": host_identity(), "rx": {str(rank): mine}}))
            peer.endpoint = self.endpoints[rank] = self._choose_endpoint(
                json.loads(ctx.store.get(f"zmq/{rank}")))
            self._connect_tx(peer)
            sock.sendall(ADMITTED)
        except BaseException:
            self._close_sockets(peer, unused=True)  # (ZeroMQ's context waits for them)
            raise
        sock.close()
        with self._wake_lock:  # the monitor thread takes the new connection's monitor
            self._new_monitors.append(peer)
            if self._wake is not None:
                self._wake.send(b"add")
        return peer

    def _close_sockets(self, peer: _Peer, linger: float = 0.0, unused: bool = False) -> None:
        """Close ``peer``'s control and sending sockets (``linger``: seconds what is
        queued may still take to leave); ``unused``: also those a receive loop and the
        monitor thread would own (for a peer none of them ever took on)."""
        with peer.ctl_lock:
            peer.ctl = _closed(peer.ctl)
        with peer.lock:
            peer.tx = _closed(peer.tx, linger)
        if unused:
            peer.rx, peer.tx_monitor = _closed(peer.rx), _closed(peer.tx_monitor)

    def _start_zap(self, ctx: TransportContext) -> None:
        """With a world key, every connection to one of our PULL sockets must log in as
        the peer it is for (ZeroMQ's PLAIN mechanism, checked by a ZAP handler thread):
        its password is a proof of the key bound to both ranks and this session's
        nonces, so a stray socket is refused before a message of it is read."""
        assert ctx.auth is not None and self._zctx is not None
        self._zap = ThreadAuthenticator(self._zctx, log=logging.getLogger("rpcx_zmq.zap"))
        self._zap.start()
        for rank in range(ctx.world_size):
            if rank != ctx.rank and not ctx.vacant(rank):
                self._allow(rank)

    def _allow(self, rank: int) -> None:
        """Let the worker at ``rank`` (and our own control socket) log in to the socket
        that receives from it: at start, and for a worker joining (its session's proof)."""
        ctx = self.ctx
        assert self._zap is not None
        self._zap.configure_plain(_zap_domain(rank), {
            str(rank): _password(ctx, rank, ctx.rank),
            _LOCAL: _password(ctx, ctx.rank, ctx.rank),  # our own control socket
        })

    def _bind_rx(self, peer: _Peer, host: str, token: str) -> dict[str, str]:
        """Create and bind the PULL socket for ``peer``; its endpoints for the peer."""
        zctx = self._zctx
        assert zctx is not None
        rx = zctx.socket(zmq.PULL)
        self._tune(rx)
        rx.rcvhwm = _HWM
        # The first line of defence: ZeroMQ never allocates a part larger than the whole
        # frame may be. A part over it makes ZeroMQ drop the connection unread, and tells
        # no one why: the monitors see the same EVENT_DISCONNECTED as when a peer's
        # process exits, so both workers report the other's connection closed, not a
        # protocol error. A frame over max_frame_bytes in parts each within it is
        # refused by its total, as a protocol error (_unpack).
        rx.setsockopt(zmq.MAXMSGSIZE, self.max_frame)
        ctx = self.ctx
        if ctx.auth is not None:
            rx.zap_domain = _zap_domain(peer.rank).encode()
            rx.plain_server = True
        if ":" in host:  # an IPv6 address
            rx.ipv6 = True
            host = f"[{host}]"
        rx.bind(f"tcp://{host}:*")
        endpoints = {"tcp": rx.getsockopt_string(zmq.LAST_ENDPOINT)}
        if self._ipc_dir is not None:
            endpoints["ipc"] = f"ipc://{self._ipc_dir}/{peer.rank}-{next(_ids)}"
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
        endpoints: dict[str, str] = info["rx"][str(self.ctx.rank)]
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
        ctx = self.ctx
        if ctx.auth is not None:
            tx.plain_username = str(ctx.rank).encode()
            tx.plain_password = _password(ctx, ctx.rank, peer.rank).encode()
        # An endpoint of its own: pyzmq's default names it after the socket's descriptor,
        # and a rank taken again gets a socket whose descriptor the old one freed while
        # the old monitor's endpoint may still be bound (ZeroMQ's reaper closes it
        # later): the bind then fails "Address already in use" (seen under load).
        peer.tx_monitor = tx.get_monitor_socket(
            _MONITOR_EVENTS, addr=f"inproc://rpcx-zmq-{self._token}-tx-{next(_ids)}")
        tx.connect(peer.endpoint)
        peer.tx = tx

    def _tune(self, sock: zmq.Socket[bytes]) -> None:
        """Options shared by rx and tx: heartbeats, no linger by default."""
        sock.linger = 0
        interval = self._options.heartbeat_interval
        timeout = CONNECTION_TIMEOUT_FACTOR * self._options.heartbeat_timeout
        if interval > 0:
            sock.setsockopt(zmq.HEARTBEAT_IVL, int(interval * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TTL, int(timeout * 1000))

    # ------------------------------------------------------------------------- send

    def send(self, dst: int, frame: Frame) -> None:
        """Send ``frame`` to ``dst``; returns once every buffer not copied is written,
        or at ``frame.deadline`` with the rest queued for the peer's writer."""
        peer = self.link(dst)  # (the kit's post refuses a peer gone, with its cause)
        buffers = frame.buffers
        if not buffers:
            self._post(peer, [_PLAIN_HEAD + frame.header], frame.deadline)
            return
        n = len(buffers)
        # Each buffer's element size (the alignment its dtype needs at the receiver) and
        # length, or _PART for a buffer that follows as a part of its own.
        sizes = bytearray(n)
        lengths = [0] * n
        inline: list[bytes] = []
        parts: list[Any] = [b""]
        later: list[list[Any]] = []  # pieces, each a message after the frame's
        trackers: list[zmq.MessageTracker] = []
        remote = peer.endpoint.startswith("tcp://")
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
            chunks = pieces(as_bytes(buffer)) if remote else [buffer]
            if len(chunks) > 1:
                lengths[index] = _PIECED - nbytes
            for chunk in chunks:
                part = zmq.Frame(owning_memory(chunk), copy=False, track=not owned)
                if len(chunks) > 1:
                    later.append([_PIECE_HEAD, part])
                else:
                    parts.append(part)
                if not owned:
                    assert part.tracker is not None
                    trackers.append(part.tracker)
        parts[0] = b"".join(
            (_HEAD.pack(_DATA, n), sizes, struct.pack(f"<{n}q", *lengths), frame.header,
             *inline)
        )
        if not self._post(peer, parts, frame.deadline, later, frame.settled):
            log.debug("send to rank %d still queued at its deadline", dst)
            return
        if trackers:
            # libzmq sent copies of our frames (sharing the bytes): the tracker fires
            # once every copy is released, ours included.
            del parts, later, part
            for tracker in trackers:
                if not self._wait_written(peer, tracker, frame.deadline, frame.settled):
                    log.debug("send to rank %d still being written at its deadline", dst)
                    return

    def _post(self, peer: _Peer, parts: list[Any], deadline: float,
              later: list[list[Any]] | None = None,
              settled: Callable[[], bool] | None = None) -> bool:
        """Hand one message (and the ``later`` ones of its frame, in order) to ZeroMQ for
        ``peer``, or queue what does not fit for the peer's writer (the kit's ``post``:
        never waiting for room under the send lock); False if ``deadline`` passed or the
        call is ``settled()`` first."""
        message = _Message([parts, *later] if later else [parts])
        if not self.post(peer, message, functools.partial(self._send_some, peer),
                         deadline, settled):
            return False  # a peer that reads nothing: the call fails on time
        if message.error is not None:
            raise message.error
        return True

    def _send_some(self, peer: _Peer, message: _Message) -> bool:
        """Hand ``message``'s messages to ZeroMQ while its queue has room; whether all
        went (call under the send lock; what did not stays in ``message``)."""
        if peer.tx is None:
            raise PeerLostError(_CLOSED if self._closed else "was never connected")
        messages = message.messages
        while messages:
            if not self._send_now(peer.tx, messages[0]):
                return False
            messages.pop(0)
        return True

    @staticmethod
    def _send_now(tx: zmq.Socket[bytes], parts: list[Any]) -> bool:
        """Hand ``parts`` to ZeroMQ if its queue has room; False if not (call under the
        send lock)."""
        try:
            tx.send_multipart(parts, copy=False)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            raise PeerLostError(lost_reason(LostCause.CONNECTION_LOST, str(exc))) from None

    def _write(self, peer: _Peer, message: _Message) -> None:
        """The writer's job (the kit's ``Backlog``): hand the first waiting message to
        ZeroMQ as room appears. It looks every ``_WRITER_POLL_S`` (ZeroMQ cannot tell
        another thread), holding the send lock only to try. A frame to a peer gone, or
        from a worker closing, is not sent (its sender raises ``message.error``); the
        goodbye still is."""
        while True:
            with peer.lock:
                if peer.tx is None:
                    raise PeerLostError(_CLOSED)
                if not message.bye and (peer.gone or self.closing):
                    message.error = PeerLostError(
                        peer.why_gone if peer.gone else _CLOSING)
                    return
                if self._send_some(peer, message):
                    return
            peer.wake.wait(_WRITER_POLL_S)

    def write_bye(self, peer: _Peer) -> None:
        """Our goodbye, after everything sent or queued before it (the kit calls this
        under the send lock, once; it never waits). None to a peer never reached, or
        one that crashed."""
        tx = peer.tx
        lost = peer.cause_gone is not None and not peer.bye_received
        if tx is None or not peer.connected.is_set() or lost:
            return
        backlog = peer.backlog
        assert backlog is not None
        if not backlog and self._send_now(tx, _BYE_MESSAGE):
            return
        backlog.put(_Message([_BYE_MESSAGE], bye=True))

    def _wait_written(self, peer: _Peer, tracker: zmq.MessageTracker, deadline: float,
                      settled: Callable[[], bool] | None = None) -> bool:
        """Wait until libzmq is done with a buffer sent from the caller's memory; False
        if the frame's ``deadline`` (a request's; 0: none) passed first, or its call is
        over (``settled()``). The message keeps the memory alive until ZeroMQ is done
        with it either way."""
        while True:
            try:
                tracker.wait(_SEND_POLL_S)
                return True
            except zmq.NotDone:
                if (deadline and time.monotonic() >= deadline) or (settled and settled()):
                    return False  # a peer that reads nothing: the call fails on time
                if peer.gone:
                    # The message keeps the memory alive until ZeroMQ drops it.
                    raise PeerLostError(peer.why_gone) from None
                if self._closed:
                    raise PeerLostError(_CLOSED) from None

    # ---------------------------------------------------------------------- receive

    def read_one(self, peer: _Peer) -> Frame | None:
        """The next frame from ``peer``'s socket, or None for its goodbye (the kit's
        receive loop calls it under ``peer.reading``: a ZeroMQ socket must never be used
        by two threads at once).

        Raises ``ProtocolError`` for what is no frame, ``LinkEnded`` once a loss was
        posted (``LOST``) and what had arrived before it is read, ``StopReceiving`` on
        close()'s ``STOP``, ``zmq.ZMQError`` when the context is gone.
        """
        rx = peer.rx
        assert rx is not None
        while True:
            kind, n, head = self._next_message(peer, rx)
            if kind == _DATA:
                return self._unpack(rx, head, n, self.max_frame,
                                    functools.partial(self._receive_pieces, peer, rx)
                                    if n else None)
            if kind == _BYE:
                return None
            log.warning("%s: dropped a message of %d bytes (kind %d) from %s",
                        self.ctx.names[self.ctx.rank], len(head), kind, peer.name)

    @staticmethod
    def _next_message(peer: _Peer, rx: zmq.Socket[bytes]) -> tuple[int, int, bytes]:
        """The peer's next message, ``(kind, n, head)`` (kind 0: one too short for a
        head), past this worker's own: ``LOST`` (what came before it is read, then
        ``LinkEnded``) and ``STOP`` (``StopReceiving``)."""
        while True:
            if peer.draining and not rx.poll(_DRAIN_WAIT_MS):
                raise LinkEnded  # (nothing more is coming)
            head = rx.recv()
            kind, n = _HEAD.unpack_from(head) if len(head) >= _HEAD.size else (0, 0)
            if kind == _LOST:
                peer.draining = True
            elif kind == _STOP:
                raise StopReceiving
            else:
                return kind, n, head

    @staticmethod
    def _unpack(rx: zmq.Socket[bytes], head: bytes, n: int, max_frame: int,
                pieced: Callable[[int], torch.Tensor] | None = None) -> Frame:
        """The frame whose head part is ``head``; receives its other parts from ``rx``,
        and each buffer of ``n`` bytes that follows in pieces with ``pieced(n)`` (none
        may: ``None``).

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
        end = len(head) - sum(length for length in lengths if length > 0)
        if end < start:
            raise ProtocolError(f"buffers of {len(head) - end} bytes in a head of {len(head)}")
        # The frame's size is checked before a byte of it is copied or becomes a tensor:
        # its header and small buffers (in the head), plus every part. ZeroMQ holds a
        # message's parts once its first is read (each within MAXMSGSIZE), so taking
        # them costs no copy; their lengths are the parts' own.
        total = len(head) - start + sum(_PIECED - length for length in lengths
                                        if length <= _PIECED)
        parts: list[zmq.Frame] = []
        for length in lengths:
            if length == _PART:
                if not rx.getsockopt(zmq.RCVMORE):
                    raise ProtocolError("a buffer announced as a part of its own, but no part")
                part = rx.recv(copy=False)
                total += len(part)
                parts.append(part)
        check_frame_size(total, max_frame)
        if rx.getsockopt(zmq.RCVMORE):
            raise ProtocolError("a frame's message with more parts than its head announces")
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
            if length <= _PIECED:
                nbytes = _PIECED - length
                if pieced is None or nbytes <= PIECE_BYTES:  # (no sender pieces those)
                    raise ProtocolError(f"a buffer of {nbytes} bytes announced in pieces")
                buffers.append(pieced(nbytes))
                continue
            buffer = torch.empty(length, dtype=torch.uint8)
            if length:
                ctypes.memmove(buffer.data_ptr(), address, length)
                address += length
            buffers.append(buffer)
        return Frame(header, buffers)

    def _receive_pieces(self, peer: _Peer, rx: zmq.Socket[bytes], nbytes: int
                        ) -> torch.Tensor:
        """A buffer of ``nbytes`` that follows its frame's message in pieces (see
        ``_PIECED``), copied together; says the peer is alive after each piece.

        Each piece is a message of two parts, ``PIECE`` and the bytes: ``rx`` also takes
        this worker's own ``LOST`` and ``STOP``, which ZeroMQ may queue between them.
        """
        ctx = self.ctx
        try:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        except RuntimeError as exc:
            raise ProtocolError(f"a buffer of {nbytes} bytes: {exc}") from None
        for view in pieces(buffer):
            kind, _, head = self._next_message(peer, rx)
            if kind != _PIECE or len(head) != _HEAD.size:
                raise ProtocolError(f"a message of {len(head)} bytes where a piece was due")
            piece = rx.recv(copy=False) if rx.getsockopt(zmq.RCVMORE) else None
            if piece is None or len(piece) != view.numel() or rx.getsockopt(zmq.RCVMORE):
                raise ProtocolError(f"a piece of {len(piece) if piece else 0} bytes where "
                                    f"{view.numel()} were due")
            view.copy_(torch.frombuffer(piece, dtype=torch.uint8))
            ctx.progress(peer.rank)
        return buffer

    def loop_ended(self, peer: _Peer) -> None:
        """The receive loop is over (on its thread, under ``reading``): close ``rx``, so
        the peer's monitor sees the connection end."""
        peer.rx = _closed(peer.rx)

    def _mark_lost(self, peer: _Peer, detail: str,
                   cause: LostCause = LostCause.CONNECTION_LOST) -> None:
        """The peer is gone: sends fail from now on; its receive loop reports it once it
        has delivered what had arrived."""
        with peer.lock:
            if peer.gone or not peer.end(cause, detail):
                return
        if peer.ended.is_set():
            self.peers.lost(peer, cause, detail)
        else:
            self._post_control(peer, _LOST_MESSAGE)

    @staticmethod
    def _post_control(peer: _Peer, message: list[bytes]) -> None:
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
        for peer in self.links.values():
            if peer.tx_monitor is not None:
                owners[peer.tx_monitor] = peer
                poller.register(peer.tx_monitor, zmq.POLLIN)
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is wake:
                        if wake.recv() != b"add":
                            return
                        with self._wake_lock:  # workers that joined (a dynamic world)
                            joined, self._new_monitors = self._new_monitors, []
                        for peer in joined:
                            if peer.tx_monitor is not None:
                                owners[peer.tx_monitor] = peer
                                poller.register(peer.tx_monitor, zmq.POLLIN)
                        continue
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
            if peer.connected.is_set() and not (self.closing or peer.bye_received):
                self._mark_lost(peer, _CRASHED)
        elif event == zmq.EVENT_MONITOR_STOPPED:
            return True
        elif peer.connected.is_set():  # a handshake failed after the first succeeded
            self._mark_lost(peer, "a new connection to it failed")
        else:
            log.debug("connection to %s at %s: event %#x", peer.name, peer.endpoint, event)
        return False

    # ------------------------------------------------------------------------ close

    def stop_connecting(self) -> None:
        """``close`` began: a receive loop for a peer never connected (a failed start)
        has no goodbye to wait for, and ends now."""
        for peer in self.peers:
            if not peer.connected.is_set():
                self.stop_receiving(peer)

    def stop_receiving(self, peer: _Peer) -> bool:
        """``STOP`` into the peer's socket: its loop ends, wherever it waits."""
        self._post_control(peer, _STOP_MESSAGE)
        return True

    def release(self, stuck: list[_Peer], deadline: float) -> None:
        """Release every socket and end the ZeroMQ context, unless a receive loop or the
        monitor is still busy (ending the context would then block: it is kept)."""
        if self._closed:
            return
        self._closed = True
        self._stop_monitor(max(_GRACE_S, deadline - time.monotonic()))
        for peer in self.links.values():
            self.release_link(peer, deadline)
        zctx, self._zctx = self._zctx, None
        if zctx is not None and (stuck or (self._monitor is not None
                                           and self._monitor.is_alive())):
            log.warning("%s: receive loops for %s still busy; their sockets stay open",
                        self.ctx.names[self.ctx.rank],
                        ", ".join(p.name for p in stuck) or "none")
            _abandoned.append(zctx)
        elif zctx is not None:
            if self._zap is not None:
                self._zap.stop()
            zctx.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def release_link(self, peer: _Peer, deadline: float) -> None:
        """Close the peer's sockets (our goodbye may still be queued in ``tx``: a moment
        to leave) and end its writer."""
        self._close_sockets(peer, linger=max(0.0, min(1.0, deadline - time.monotonic())))
        peer.wake.set()  # its writer fails what still waits, then ends
        if self._monitor is None:  # (start failed before the monitor ran)
            peer.tx_monitor = _closed(peer.tx_monitor)
        super().release_link(peer, deadline)

    def _stop_monitor(self, timeout: float) -> None:
        with self._wake_lock:
            if self._wake is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._wake.send(b"stop", flags=zmq.NOBLOCK)
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout)
        with self._wake_lock:
            self._wake = _closed(self._wake)


def _closed(sock: zmq.Socket[bytes] | None, linger: float = 0.0) -> zmq.Socket[bytes] | None:
    """Close ``sock`` if there is one (``linger``: seconds what is queued may still take
    to leave); ``None``, for the attribute that held it."""
    if sock is not None:
        sock.close(linger=int(linger * 1000))
    return None


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


def _private_dir() -> str | None:
    """A fresh directory only this user can enter, for ``ipc://`` sockets (or None)."""
    path = tempfile.mkdtemp(prefix="rpcx-zmq-")
    if len(path) + 12 > _IPC_PATH_MAX:  # room for "/<rank>-<n>"
        log.info("temp directory %s is too long for ipc:// paths; using TCP only", path)
        os.rmdir(path)
        return None
    return path


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
