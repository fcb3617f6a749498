"""A dynamic world's admission, at the transport: a member that sends to a newcomer the
moment its agent admits it (before the transport has the link) must not get ahead of
the "admitted" answer the newcomer reads first (a frame written before it was read as
the answer, and the stream was misread from there: "a frame announcing 1979711488
buffers", seen with TorchRL's dynamic replay buffer under load)."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
import torch
from torch._C._distributed_c10d import HashStore

from rpcx.backends.socket_options import SocketRpcBackendOptions
from rpcx.backends.sockets import AutoTransport, TcpTransport
from rpcx.transport import Frame, TransportContext

BOUND = 30.0


def _context(rank: int, names: list[str], store: Any, deliver: Any, admit: Any
             ) -> TransportContext:
    return TransportContext(
        rank=rank, world_size=len(names), names=names, store=store,
        options=SocketRpcBackendOptions(rpc_timeout=BOUND),
        init_method="tcp://127.0.0.1:1", deliver=deliver,
        peer_lost=lambda rank, cause, detail="": None, admit=admit)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", [AutoTransport, TcpTransport])
def test_a_frame_sent_at_admission_follows_the_answer(transport: type) -> None:
    store = HashStore()
    member, newcomer = transport(), transport()
    member_names = ["member"]
    sent_at_admission: list[BaseException | None] = []
    sender_done = threading.Event()

    def send_now() -> None:
        try:
            member.send(1, Frame(b"sent the moment it was admitted",
                                 [torch.arange(4, dtype=torch.uint8)]))
            sent_at_admission.append(None)
        except BaseException as exc:  # reported below
            sent_at_admission.append(exc)
        finally:
            sender_done.set()

    def admit(rank: int) -> str:
        member_names.append("newcomer")  # (what the agent does: the name, in place)
        threading.Thread(target=send_now, daemon=True).start()
        # Give that send every chance to get ahead of the answer (with the fix it
        # waits for the link, so this wait runs out).
        sender_done.wait(0.3)
        return "newcomer"

    received: list[tuple[int, Frame]] = []
    arrived = threading.Event()

    def deliver(src: int, frame: Frame) -> None:
        received.append((src, frame))
        arrived.set()

    member.start(_context(0, member_names, store, lambda src, frame: None, admit))
    try:
        newcomer.start(_context(1, ["member", "newcomer"], store, deliver,
                                lambda rank: "unexpected"))
        try:
            assert sender_done.wait(BOUND) and sent_at_admission == [None]
            assert arrived.wait(BOUND), "the frame sent at admission never arrived"
            [(src, frame)] = received
            assert src == 0 and frame.header == b"sent the moment it was admitted"
            assert frame.buffers[0].view(torch.uint8).tolist() == [0, 1, 2, 3]
        finally:
            newcomer.close(5.0)
    finally:
        member.close(5.0)


def test_a_segment_freed_after_its_filler_left_is_not_announced_to_the_next_holder() -> None:
    # A tensor received over a segment the old holder of rank 1 filled is dropped after
    # a new worker took rank 1: the id means another segment there, which the new
    # worker may still be filling. It must not be told (the old code told whoever held
    # the rank).
    from types import SimpleNamespace

    from rpcx.backends.segments import SendPool
    from rpcx.backends.socket_mesh import Route
    from rpcx.backends.sockets import _Peer
    from rpcx.transport_kit import Peers

    transport = AutoTransport()
    here = [socket.socketpair() for _ in range(2)]
    try:
        def peer(name: str, sock: socket.socket) -> _Peer:
            return _Peer(1, name, sock, f"rpcx-test-send-{name}", Route(True, "test"),
                         1 << 18, SendPool(1 << 20), transport._segment_freed)

        old, new = peer("left", here[0][0]), peer("joined", here[1][0])
        ctx = SimpleNamespace(rank=0, names=["me", "joined"], receive_lane=None)
        transport._started = Peers(ctx, {1: new}, lambda link: None,  # type: ignore[arg-type]
                                   lambda link: None)
        transport._segment_freed(old, 7)
        assert list(new.freed) == [] and list(old.freed) == []
        transport._segment_freed(new, 7)  # (the holder's own segment: announced)
        assert list(new.freed) == [7]
    finally:
        for a, b in here:
            a.close()
            b.close()
