"""The zmq backend's own behaviour: addresses, IPC or TCP, options, zero copy, lost peers.

Most tests drive transports directly (two or three in this process, on a shared
``HashStore``), the way rpcx's agent does; the conformance kit (test_kit.py) covers the
backend under rpcx.
"""

from __future__ import annotations

import ipaddress
import json
import multiprocessing
import os
import queue
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import rpcx
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from rpcx.errors import LostCause, PeerLostError, ProtocolError, lost_reason
from rpcx.registry import available_backends
from rpcx.transport import Frame, TransportContext
from rpcx.transport_kit import owning_memory
from torch.distributed import FileStore, HashStore

from rpcx_zmq import ZmqRpcBackendOptions, ZmqTransport
from rpcx_zmq import transport as zmq_transport
from rpcx_zmq.addresses import host_identity, listen_host, resolve

MiB = 1 << 20


class Inbox:
    """What one transport delivered and which peers it lost."""

    def __init__(self) -> None:
        self.frames: queue.SimpleQueue[tuple[int, Frame]] = queue.SimpleQueue()
        self.lost: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self.causes: list[LostCause] = []
        self.block: threading.Event | None = None  # set: deliver waits on it
        self.progress: list[int] = []  # ranks TransportContext.progress was called with

    def deliver(self, src: int, frame: Frame) -> None:
        if self.block is not None:
            self.block.wait(30)
        self.frames.put((src, frame))

    def peer_lost(self, rank: int, cause: LostCause, detail: str = "") -> None:
        self.lost.put((rank, lost_reason(cause, detail)))  # the sentence rpcx writes
        self.causes.append(cause)

    def next(self, timeout: float = 10.0) -> tuple[int, Frame]:
        return self.frames.get(timeout=timeout)


def _context(rank: int, size: int, store: Any, options: Any, inbox: Inbox) -> TransportContext:
    return TransportContext(
        rank=rank, world_size=size, names=[f"worker{r}" for r in range(size)], store=store,
        options=options, init_method="file:///nonexistent", deliver=inbox.deliver,
        peer_lost=inbox.peer_lost, progress=inbox.progress.append,
    )


def _start_all(size: int, store: Any, options: Any) -> tuple[list[ZmqTransport], list[Inbox]]:
    transports = [ZmqTransport() for _ in range(size)]
    inboxes = [Inbox() for _ in range(size)]
    errors: list[BaseException] = []

    def start(rank: int) -> None:
        try:
            transports[rank].start(_context(rank, size, store, options, inboxes[rank]))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return transports, inboxes


@contextmanager
def transports(
    size: int = 2, **options: Any
) -> Iterator[tuple[list[ZmqTransport], list[Inbox]]]:
    """``size`` started transports of one world in this process, closed afterwards."""
    store = HashStore()
    store.set_timeout(timedelta(seconds=30))
    started, inboxes = _start_all(size, store, ZmqRpcBackendOptions(rpc_timeout=30, **options))
    try:
        yield started, inboxes
    finally:
        closers = [threading.Thread(target=t.close, args=(5.0,)) for t in started]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(30)


# ------------------------------------------------------------------ registration


def test_registered_through_the_entry_point() -> None:
    spec = available_backends()["zmq"]
    assert spec.factory is ZmqTransport
    assert spec.options_type is ZmqRpcBackendOptions
    assert spec.capabilities.multi_process and spec.capabilities.multi_host
    assert not spec.capabilities.in_process
    assert "rpcx_zmq.plugin" in spec.plugin


def test_rpcx_never_imports_the_plugin_itself() -> None:
    code = (
        "import sys, rpcx\n"
        "assert 'rpcx_zmq' not in sys.modules\n"
        "assert 'zmq' in rpcx.backend_names()\n"  # loads plugins through entry points
        "assert 'rpcx_zmq.plugin' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------------ options


def test_options_defaults_and_torch_fields() -> None:
    options = ZmqRpcBackendOptions(rpc_timeout=12, num_worker_threads=4)
    options.validate()
    assert isinstance(options, rpcx.TensorPipeRpcBackendOptions)
    assert options.rpc_timeout == 12 and options.num_worker_threads == 4
    assert options.hostname is None and options.interface is None and options.ipc


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hostname": "127.0.0.1", "interface": "lo"}, "not both"),
        ({"hostname": ""}, "non-empty"),
        ({"heartbeat_interval": -1.0}, "heartbeat_interval"),
        ({"heartbeat_interval": 5.0, "heartbeat_timeout": 5.0}, "must be longer than"),
    ],
)
def test_options_validate(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ZmqRpcBackendOptions(**fields).validate()


# ---------------------------------------------------------------------- addresses
# (rpcx.hosts, which picks the address and names the host, is tested in rpcx's tests)


def test_listen_host_options_override_the_guess() -> None:
    assert listen_host("127.0.0.1", None, "tcp://203.0.113.7:1") == "127.0.0.1"
    assert ipaddress.ip_address(listen_host("localhost", None, "file:///x")).is_loopback
    assert listen_host(None, "lo", "tcp://203.0.113.7:1") == "lo"
    assert listen_host(None, None, "tcp://127.0.0.1:1") == "127.0.0.1"
    with pytest.raises(ValueError, match="does not resolve"):
        resolve("no-such-host.invalid")


# -------------------------------------------------------------- ipc or tcp, sending


def test_peers_on_this_host_use_ipc() -> None:
    with transports(3) as (started, _):
        for transport in started:
            assert len(transport.endpoints) == 2
            assert all(e.startswith("ipc://") for e in transport.endpoints.values())


def test_ipc_off_uses_tcp_on_the_chosen_address() -> None:
    with transports(2, ipc=False, hostname="127.0.0.1") as (started, inboxes):
        for transport in started:
            (endpoint,) = transport.endpoints.values()
            assert endpoint.startswith("tcp://127.0.0.1:")
        started[0].send(1, Frame(b"over tcp", [torch.arange(4)]))
        src, frame = inboxes[1].next()
        assert (src, frame.header) == (0, b"over tcp")
        assert torch.equal(frame.buffers[0].view(torch.int64), torch.arange(4))


def test_interface_option_binds_that_interface() -> None:
    with transports(2, ipc=False, interface="lo") as (started, inboxes):
        (endpoint,) = started[0].endpoints.values()
        assert endpoint.startswith("tcp://127.0.0.1:")
        started[1].send(0, Frame(b"via lo"))
        assert inboxes[0].next()[1].header == b"via lo"


@pytest.mark.parametrize("ipc", [True, False])
def test_large_tensor_round_trip_without_copies(ipc: bool) -> None:
    # (over TCP, as large as a buffer gets before it travels in pieces, which are copied
    # together: see the next test)
    original = torch.randn((16 * MiB if ipc else zmq_transport.PIECE_BYTES) // 4)
    expected = original.clone()
    with transports(2, ipc=ipc) as (started, inboxes):
        started[0].send(1, Frame(b"there", [original, torch.empty(0), torch.arange(3)]))
        original.zero_()  # send returned: the bytes are out, the caller may change them
        _, frame = inboxes[1].next()
        there = frame.buffers[0]
        assert there.numel() == expected.numel() * 4
        assert torch.equal(there.view(torch.float32), expected)
        assert frame.buffers[1].numel() == 0
        assert torch.equal(frame.buffers[2].view(torch.int64), torch.arange(3))
        # Received without a copy: the tensor lives in ZeroMQ's message memory, which
        # torch did not allocate (so cannot resize), aligned for the dtype.
        assert not there.untyped_storage().resizable()
        assert there.data_ptr() % 4 == 0
        # ... and it is writable, as any tensor rpcx hands to a program.
        there.view(torch.float32).mul_(2)
        started[1].send(0, Frame(b"back", [there]))
        _, back = inboxes[0].next()
        assert torch.equal(back.buffers[0].view(torch.float32), expected * 2)
        assert not back.buffers[0].untyped_storage().resizable()


def test_a_buffer_larger_than_a_piece_crosses_tcp_in_pieces_the_receiver_sees() -> None:
    # ZeroMQ hands over a message only whole: a 2 GiB tensor between hosts would show
    # nothing for longer than heartbeat_timeout. In pieces, each one says the peer lives.
    piece = zmq_transport.PIECE_BYTES
    original = torch.arange((4 * piece + 12) // 4, dtype=torch.int32)  # 4 pieces and a bit
    small = torch.arange(3)
    with transports(2, ipc=False) as (started, inboxes):
        started[0].send(1, Frame(b"pieced", [small, original, torch.empty(0), original[:5]]))
        started[0].send(1, Frame(b"after it"))  # frames stay in order behind the pieces
        _, frame = inboxes[1].next()
        assert frame.header == b"pieced"
        assert torch.equal(frame.buffers[0].view(torch.int64), small)
        assert torch.equal(frame.buffers[1].view(torch.int32), original)
        assert frame.buffers[2].numel() == 0
        assert torch.equal(frame.buffers[3].view(torch.int32), original[:5])
        assert inboxes[1].next()[1].header == b"after it"
        assert inboxes[1].progress == [0] * 5  # once per piece, naming the sender
        started[1].send(0, Frame(b"back", [frame.buffers[1]]))
        assert torch.equal(inboxes[0].next()[1].buffers[0].view(torch.int32), original)


def test_buffers_needing_more_alignment_than_zeromq_gives_are_copied() -> None:
    values = torch.randn(1 << 18, dtype=torch.complex128)  # 4 MiB, 16-byte elements
    with transports(2) as (started, inboxes):
        started[0].send(1, Frame(b"complex", [values, torch.arange(1 << 18)]))
        _, frame = inboxes[1].next()
        wide, narrow = frame.buffers
        assert wide.data_ptr() % 16 == 0
        assert torch.equal(wide.view(torch.complex128), values)
        assert not narrow.untyped_storage().resizable()  # int64: ZeroMQ's memory will do
        assert torch.equal(narrow.view(torch.int64), torch.arange(1 << 18))


def test_every_size_of_buffer_arrives_whole_and_in_place() -> None:
    # Inline in the head (<= INLINE_MAX), a copied part of its own, a part sent from the
    # tensor's memory (>= ZERO_COPY_SEND), empty ones, many of them, and odd dtypes.
    inline = zmq_transport.INLINE_MAX
    buffers = [
        torch.arange(7, dtype=torch.int16),
        torch.empty(0),
        torch.randn(inline // 4),  # exactly INLINE_MAX bytes: inline
        torch.randn(inline // 4 + 1),  # one element more: a part of its own, copied
        torch.randint(0, 255, (zmq_transport.ZERO_COPY_SEND,), dtype=torch.uint8),
        torch.tensor([True, False, True]),
        torch.randn(3, dtype=torch.complex128),
        *[torch.full((5,), float(i)) for i in range(50)],
    ]
    with transports(2) as (started, inboxes):
        started[0].send(1, Frame(b"all sizes", buffers))
        _, frame = inboxes[1].next()
        assert frame.header == b"all sizes"
        assert len(frame.buffers) == len(buffers)
        for sent, got in zip(buffers, frame.buffers, strict=True):
            assert got.dtype == torch.uint8 and got.dim() == 1
            assert torch.equal(got.view(sent.dtype), sent.reshape(-1))
            assert got.data_ptr() % sent.element_size() == 0


def test_a_peer_on_another_host_is_reached_over_tcp(tmp_path: Any) -> None:
    transport = ZmqTransport()
    transport._ctx = _context(0, 2, HashStore(), ZmqRpcBackendOptions(), Inbox())
    transport._ipc_dir = str(tmp_path)
    socket_file = tmp_path / "0"
    socket_file.touch()
    endpoints = {"0": {"tcp": "tcp://10.0.0.2:5555", "ipc": f"ipc://{socket_file}"}}
    here = host_identity()
    assert transport._choose_endpoint({"host": here, "rx": endpoints}) == f"ipc://{socket_file}"
    assert transport._choose_endpoint({"host": "other|boot|mnt", "rx": endpoints}) == (
        "tcp://10.0.0.2:5555"
    )
    socket_file.unlink()  # same host, yet the path is not there (another /tmp)
    assert transport._choose_endpoint({"host": here, "rx": endpoints}) == (
        "tcp://10.0.0.2:5555"
    )
    transport._ipc_dir = None  # this worker does not use IPC
    socket_file.touch()
    assert transport._choose_endpoint({"host": here, "rx": endpoints}) == (
        "tcp://10.0.0.2:5555"
    )


def test_a_sender_waiting_on_a_full_queue_is_released_by_close() -> None:
    with transports(2) as (started, inboxes):
        gate = threading.Event()
        inboxes[1].block = gate  # worker1 stops reading after its first frame
        outcome: list[BaseException | None] = []

        def flood() -> None:
            try:
                for _ in range(100_000):  # far more than the queues and sockets hold
                    started[0].send(1, Frame(b"x" * 1000))
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        sender = threading.Thread(target=flood)
        sender.start()
        time.sleep(2.0)
        assert sender.is_alive(), "the queue should be full by now"
        began = time.monotonic()
        started[0].close(0.5)
        sender.join(5.0)
        assert not sender.is_alive() and time.monotonic() - began < 5.0
        assert isinstance(outcome[0], PeerLostError)
        gate.set()


def test_sends_to_a_peer_that_reads_nothing_return_by_their_deadline_in_order() -> None:
    # Past ZeroMQ's queues, messages wait for the peer's writer thread: each send returns
    # by its frame's deadline, and every frame still arrives, in order, once the peer
    # reads again.
    deadline_s, slack_s = 0.2, 1.0
    with transports(2) as (started, inboxes):
        gate = threading.Event()
        inboxes[1].block = gate  # worker1 stops reading after its first frame
        peer = started[0].links[1]
        sent = 0

        def send(deadline: float = 0.0) -> float:
            nonlocal sent
            frame = Frame(str(sent).encode())
            frame.deadline = deadline
            sent += 1
            began = time.monotonic()
            started[0].send(1, frame)
            return time.monotonic() - began

        try:
            while not peer.backlog:  # ~8,200: both ends' queues (4,096 each), the kernel's
                assert sent < 100_000, "the queues never filled"
                assert send(time.monotonic() + deadline_s) < deadline_s + slack_s
            for _ in range(3):  # behind the first: each waits for its deadline only
                assert deadline_s / 2 < send(time.monotonic() + deadline_s) < deadline_s + slack_s
        finally:
            gate.set()
        send()  # no deadline: returns once ZeroMQ has it, after all the others
        numbers = [int(inboxes[1].next()[1].header) for _ in range(sent)]
        assert numbers == list(range(sent))
        assert not peer.backlog


def test_sent_from_the_tensor_memory_kept_alive_by_zeromq() -> None:
    tensor = torch.arange(1 << 18, dtype=torch.int32)
    memory = owning_memory(tensor)  # (what send hands ZeroMQ, from the kit)
    assert memoryview(memory).nbytes == tensor.numel() * 4
    import ctypes

    assert ctypes.addressof(memory) == tensor.data_ptr()  # no copy
    assert memory.tensor is tensor  # type: ignore[attr-defined]


def test_owned_buffers_are_not_waited_for_but_stay_valid() -> None:
    with transports(2) as (started, inboxes):
        owned = torch.full((4 * MiB,), 7, dtype=torch.uint8)
        started[0].send(1, Frame(b"owned", [owned], owned=frozenset({0})))
        del owned  # the message holds the memory until ZeroMQ is done
        _, frame = inboxes[1].next()
        assert bool((frame.buffers[0] == 7).all())


def test_per_peer_order_from_many_threads() -> None:
    with transports(2) as (started, inboxes):
        threads = 4
        per_thread = 300

        def sender(t: int) -> None:
            for i in range(per_thread):
                size = 300_000 if i % 50 == 0 else 8  # some zero-copy frames among them
                started[0].send(1, Frame(f"{t}:{i}".encode(), [torch.zeros(size)]))

        workers = [threading.Thread(target=sender, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        seen: dict[int, int] = {}
        for _ in range(threads * per_thread):
            _, frame = inboxes[1].next()
            t, i = map(int, frame.header.split(b":"))
            assert i == seen.get(t, -1) + 1, "frames of one thread out of order"
            seen[t] = i
        assert seen == dict.fromkeys(range(threads), per_thread - 1)


# ------------------------------------------------------------- goodbyes and losses


def test_a_peer_that_leaves_is_reported_once_and_sends_fail() -> None:
    with transports(3) as (started, inboxes):
        started[2].send(0, Frame(b"last words"))
        started[2].close(5.0)
        assert inboxes[0].next()[1].header == b"last words"  # delivered before the loss
        for survivor in (0, 1):
            rank, reason = inboxes[survivor].lost.get(timeout=10)
            assert (rank, reason) == (2, "has shut down")
            assert inboxes[survivor].causes == [LostCause.DEPARTED]
            with pytest.raises(PeerLostError, match="shut down"):
                started[survivor].send(2, Frame(b"too late"))
        started[0].send(1, Frame(b"others still talk"))
        assert inboxes[1].next()[1].header == b"others still talk"
        time.sleep(0.2)
        assert inboxes[0].lost.empty() and inboxes[1].lost.empty()


@pytest.mark.parametrize(("parts", "why"), [
    # A length past the end of the head (copied out of it before, past its memory).
    ([zmq_transport._HEAD.pack(zmq_transport._DATA, 1) + b"\x01"
      + struct.pack("<q", 1 << 40) + b"hdr"], "in a head of"),
    ([zmq_transport._HEAD.pack(zmq_transport._DATA, 3) + b"\x01"], "for 3 buffers"),
    # -2 - size announces a buffer in pieces: only one larger than a piece may be.
    ([zmq_transport._HEAD.pack(zmq_transport._DATA, 1) + b"\x01"
      + struct.pack("<q", -7)], "a buffer of 5 bytes announced in pieces"),
    ([zmq_transport._HEAD.pack(zmq_transport._DATA, 1) + b"\x01"
      + struct.pack("<q", zmq_transport._PART)], "but no part"),
])
def test_heads_that_are_no_frame_end_the_peer_with_a_protocol_error(
    parts: list[bytes], why: str
) -> None:
    with transports(3) as (started, inboxes):
        peer = started[1].links[0]
        with peer.lock:
            assert peer.tx is not None
            peer.tx.send_multipart(parts)
        rank, reason = inboxes[0].lost.get(timeout=10)
        assert rank == 1 and "protocol error" in reason and why in reason, reason
        assert inboxes[0].causes == [LostCause.PROTOCOL_ERROR]
        assert inboxes[0].frames.empty()
        started[2].send(0, Frame(b"the others still talk"))  # worker 0 serves on
        assert inboxes[0].next()[1].header == b"the others still talk"


@pytest.mark.parametrize("ipc", [True, False])
def test_a_frame_over_max_frame_bytes_is_refused_and_ends_the_connection(ipc: bool) -> None:
    # ZeroMQ's MAXMSGSIZE on the receiving socket: a part over max_frame_bytes closes the
    # connection before the part is read. The sender sees its connection close and
    # reports the peer lost; the receiver, whose connection back is then closed, too.
    # Neither can report a protocol error here: ZeroMQ says nothing of why it dropped the
    # connection (its monitors see the EVENT_DISCONNECTED a peer that exits causes), so
    # this stays "connection closed". A frame over the limit in parts each within it is
    # a protocol error (the next test).
    with transports(2, max_frame_bytes=MiB, ipc=ipc) as (started, inboxes):
        started[0].send(1, Frame(b"small", [torch.ones(256, dtype=torch.uint8)]))
        assert inboxes[1].next()[1].header == b"small"  # within the cap: delivered
        started[0].send(1, Frame(b"big", [torch.ones(2 * MiB, dtype=torch.uint8)]))
        for rank, other in ((0, 1), (1, 0)):
            try:
                lost, reason = inboxes[rank].lost.get(timeout=10)
            except queue.Empty:
                pytest.fail(f"worker{rank} still reaches worker{other} after a frame over "
                            "max_frame_bytes")
            assert lost == other and "connection closed" in reason, reason
        assert inboxes[1].frames.empty()  # the big frame never arrived
        with pytest.raises(PeerLostError):
            started[0].send(1, Frame(b"after"))


@pytest.mark.parametrize("ipc", [True, False])
@pytest.mark.parametrize("layout", [
    [768 << 10, 768 << 10],  # two parts sent from the tensors' memory (zero copy)
    [(MiB >> 2) - 1] * 4 + [100 << 10],  # five copied parts, each under ZERO_COPY_SEND
])
def test_a_frame_over_max_frame_bytes_in_parts_under_it_is_a_protocol_error(
    ipc: bool, layout: list[int]
) -> None:
    # MAXMSGSIZE limits each ZeroMQ part, not the frame: a frame whose parts are each
    # under max_frame_bytes, but whose total is over it, was delivered. The receiver
    # refuses it by its total (header plus every buffer, as gloo and shm count) and ends
    # the connection, reporting a protocol error that names the limit.
    with transports(3, max_frame_bytes=MiB, ipc=ipc) as (started, inboxes):
        # Exactly max_frame_bytes (header plus buffers): delivered.
        at_limit = [MiB >> 1, (MiB >> 1) - 2]
        started[1].send(0, Frame(b"ok", [torch.ones(k, dtype=torch.uint8) for k in at_limit]))
        _, frame = inboxes[0].next()
        assert frame.header == b"ok" and [b.numel() for b in frame.buffers] == at_limit
        started[1].send(0, Frame(b"big", [torch.ones(k, dtype=torch.uint8) for k in layout]))
        try:
            rank, reason = inboxes[0].lost.get(timeout=10)
        except queue.Empty:
            pytest.fail(f"a frame of {3 + sum(layout)} bytes over max_frame_bytes ({MiB}) "
                        f"in parts of {layout} bytes was not refused: "
                        f"delivered {inboxes[0].frames.qsize()} frame(s)")
        assert rank == 1, rank
        assert reason == (f"is unreachable: protocol error: a frame of {3 + sum(layout)} "
                          f"bytes, over max_frame_bytes ({MiB})"), reason
        assert inboxes[0].causes == [LostCause.PROTOCOL_ERROR]
        assert inboxes[0].frames.empty()  # the big frame never arrived
        with pytest.raises(PeerLostError, match="max_frame_bytes"):
            started[0].send(1, Frame(b"to a peer that broke the protocol"))
        # The sender sees its connection end (as with gloo and shm), and sends fail.
        rank, _ = inboxes[1].lost.get(timeout=10)
        assert rank == 0
        with pytest.raises(PeerLostError):
            started[1].send(0, Frame(b"after"))
        started[2].send(0, Frame(b"the others still talk"))  # worker 0 serves on
        assert inboxes[0].next()[1].header == b"the others still talk"


def test_close_is_bounded_when_a_peer_does_not_answer() -> None:
    with transports(2) as (started, inboxes):
        gate = threading.Event()
        inboxes[1].block = gate  # worker1's receive loop hangs in deliver
        started[0].send(1, Frame(b"hang here"))
        time.sleep(0.2)
        began = time.monotonic()
        started[0].close(0.5)  # worker1 never reads our goodbye
        assert time.monotonic() - began < 3.0
        began = time.monotonic()
        started[1].close(0.5)  # its own loop is stuck: close gives up, bounded
        assert time.monotonic() - began < 3.0
        gate.set()


def _crashing_worker(path: str) -> None:
    store = FileStore(path, 2)
    inbox = Inbox()
    transport = ZmqTransport()
    transport.start(_context(1, 2, store, ZmqRpcBackendOptions(rpc_timeout=30), inbox))
    inbox.next(30)  # the cue
    os._exit(1)


@pytest.mark.parametrize("ipc", [True, False])
def test_a_crashed_peer_is_reported_at_once(tmp_path: Any, ipc: bool) -> None:
    path = str(tmp_path / "store")
    process = multiprocessing.get_context("spawn").Process(target=_crashing_worker,
                                                            args=(path,))
    process.start()
    try:
        store = FileStore(path, 2)
        inbox = Inbox()
        transport = ZmqTransport()
        transport.start(_context(0, 2, store, ZmqRpcBackendOptions(rpc_timeout=30, ipc=ipc),
                                 inbox))
        # ipc=False here is only this side's choice; the child still offers IPC.
        assert transport.endpoints[1].startswith("ipc://" if ipc else "tcp://")
        began = time.monotonic()
        transport.send(1, Frame(b"die"))
        rank, reason = inbox.lost.get(timeout=10)
        assert rank == 1 and "exited or crashed" in reason
        assert time.monotonic() - began < 5.0
        with pytest.raises(PeerLostError, match="crashed"):
            transport.send(1, Frame(b"anyone?"))
        began = time.monotonic()
        transport.close(2.0)
        assert time.monotonic() - began < 4.0
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()


def test_start_fails_in_time_when_a_peer_never_listens() -> None:
    store = HashStore()
    store.set_timeout(timedelta(seconds=5))
    # A peer that published an endpoint nobody listens on, then died.
    context = zmq.Context()
    dead = context.socket(zmq.PULL)
    port = dead.bind_to_random_port("tcp://127.0.0.1")
    dead.close(linger=0)
    context.term()
    endpoints = {"0": {"tcp": f"tcp://127.0.0.1:{port}"}}
    store.set("zmq/1", json.dumps({"host": "elsewhere", "rx": endpoints}))
    transport = ZmqTransport()
    options = ZmqRpcBackendOptions(rpc_timeout=1.0)
    began = time.monotonic()
    with pytest.raises(rpcx.RpcTimeoutError, match="worker1"):
        transport.start(_context(0, 2, store, options, Inbox()))
    assert time.monotonic() - began < 5.0
    transport.close(1.0)


class _NoMoreParts:
    """An rx socket with nothing after the head part."""

    def getsockopt(self, option: int) -> int:
        assert option == zmq.RCVMORE
        return 0

    def recv(self, copy: bool = True) -> Any:
        raise AssertionError("a part was read although none was announced")


@settings(max_examples=3000, deadline=None)
@given(
    n=st.one_of(st.integers(1, 4), st.integers(1, 2**32 - 1)),
    lengths=st.lists(st.one_of(st.integers(-2, 64), st.integers(-(2**63), 2**63 - 1)),
                     max_size=4),
    rest=st.binary(max_size=200),
    max_frame=st.one_of(st.integers(0, 300), st.just(1 << 62)),
)
def test_any_head_unpacks_within_its_own_bytes_or_is_refused(
    n: int, lengths: list[int], rest: bytes, max_frame: int
) -> None:
    # Every byte copied out of a head must lie inside it: lengths a peer writes are
    # checked before ctypes.memmove runs (a wrong one read past the message before).
    # And a frame unpacked is within max_frame_bytes.
    head = (zmq_transport._HEAD.pack(zmq_transport._DATA, n) + bytes(min(n, 4))
            + struct.pack(f"<{len(lengths)}q", *lengths) + rest)
    try:
        frame = ZmqTransport._unpack(_NoMoreParts(), head, n,  # type: ignore[arg-type]
                                     max_frame)
    except ProtocolError:
        return
    assert len(frame.header) + sum(b.numel() for b in frame.buffers) <= len(head)
    assert len(frame.header) + sum(b.numel() for b in frame.buffers) <= max_frame
