"""With a world key, strangers at a zmq worker's listening ports get nothing through.

A keyed world of three runs; this process (worker0) plays the stranger too. It opens
raw TCP connections and ZeroMQ sockets (without credentials, and logging in with wrong
passwords) to worker1's socket for frames from worker0, and sends thousands of random
messages and mutations of a real call frame that would bump a counter in worker1's
environment if it ever ran. Afterwards: nothing ran, worker1 reported nobody lost and
serves both peers, and its memory grew by less than a bound.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import socket
import struct
import uuid
from collections.abc import Iterator

import psutil
import pytest
import rpcx
import zmq
from rpcx.testing import remote
from rpcx.testing.conformance_auth import call_frames
from rpcx.testing.transports import published_address
from rpcx.testing.world import World, world

from rpcx_zmq import transport as zmq_transport

KEY = "zmq-auth-test-key-0123456789abcdef"
BOUND = 30.0
SEED = 20261124
RAW_CONNECTIONS = 200
ZMQ_SOCKETS = 24  # half without credentials, half with wrong passwords
MESSAGES_PER_SOCKET = 150
MEMORY_BOUND = 64 << 20


@pytest.fixture(scope="module")
def keyed_world() -> Iterator[World]:
    with world("zmq", size=3, rpc_timeout=BOUND, auth_key=KEY) as started:
        yield started


def _endpoint_of_worker1_for_worker0() -> str:
    endpoint: str = published_address("zmq/1")["rx"]["0"]["tcp"]
    return endpoint


def _call_frames(marker: str) -> list[bytes]:
    """Data messages as zmq's wire carries them, each a call that would bump ``marker``:
    unsealed, and sealed with another key."""
    head = zmq_transport._PLAIN_HEAD
    return [head + header for header in call_frames(marker, (remote.tally, (marker,), {}))]


def _mutations(rng: random.Random, genuine: list[bytes], count: int) -> Iterator[list[bytes]]:
    """``count`` multipart messages: random bytes, and real frames bit-flipped,
    truncated, extended or given a random announced buffer count."""
    for _ in range(count):
        choice = rng.randrange(5)
        base = bytearray(rng.choice(genuine))
        if choice == 0:
            yield [rng.randbytes(rng.randrange(0, 512)) for _ in range(rng.randrange(1, 4))]
            continue
        if choice == 1:
            for _ in range(rng.randrange(1, 8)):
                base[rng.randrange(len(base))] ^= 1 << rng.randrange(8)
        elif choice == 2:
            base = base[: rng.randrange(len(base))]
        elif choice == 3:
            base += rng.randbytes(rng.randrange(1, 256))
        else:
            struct.pack_into("<I", base, 4, rng.randrange(1 << 32))
        yield [bytes(base)] + [rng.randbytes(rng.randrange(64)) for _ in range(rng.randrange(2))]


def test_strangers_at_the_listening_port_run_nothing(keyed_world: World) -> None:
    rng = random.Random(SEED)
    marker = f"RPCX_ZMQ_FUZZ_{uuid.uuid4().hex}"
    endpoint = _endpoint_of_worker1_for_worker0()
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    worker1 = psutil.Process(rpcx.rpc_sync("worker1", remote.process_id))
    rss_before = worker1.memory_info().rss
    genuine = _call_frames(marker)

    raw_bytes = 0
    for _ in range(RAW_CONNECTIONS):  # not even ZeroMQ: bytes at the TCP port
        with socket.create_connection((host, int(port)), timeout=BOUND) as conn:
            data = rng.choice([rng.randbytes(rng.randrange(1, 2048)),
                               b"\xff" + bytes(8) + b"\x7f\x03" + rng.randbytes(64)])
            with contextlib.suppress(OSError):  # refused mid-way: what we want
                conn.sendall(data)
            raw_bytes += len(data)

    zctx = zmq.Context.instance()
    sent = 0
    sockets = []
    for index in range(ZMQ_SOCKETS):
        push = zctx.socket(zmq.PUSH)
        push.linger = 0
        push.sndhwm = MESSAGES_PER_SOCKET * 2
        if index % 2:
            push.plain_username = b"0"  # worker0's name, a wrong password
            push.plain_password = secrets.token_hex(16).encode()
        push.connect(endpoint)
        sockets.append(push)
        for message in _mutations(rng, genuine, MESSAGES_PER_SOCKET):
            try:
                push.send_multipart(message, flags=zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass  # no connection was ever accepted: nothing takes the message
    # Real traffic both ways meanwhile and afterwards: everything still works.
    assert rpcx.rpc_sync("worker1", remote.add, args=(2, 3), timeout=BOUND) == 5
    assert rpcx.rpc_sync("worker2", remote.call_and_wait, args=(
        rpcx.rpc_async, "worker1", remote.add, (4, 4))) == 8
    for push in sockets:
        push.close(linger=0)

    assert rpcx.rpc_sync("worker1", remote.tally_of, args=(marker,)) == 0
    info = rpcx.rpc_sync("worker1", rpcx.debug_info)
    assert info["lost_peers"] == {}, info["lost_peers"]
    assert rpcx.rpc_sync("worker1", remote.add, args=(1, 1), timeout=BOUND) == 2
    grown = worker1.memory_info().rss - rss_before
    assert grown < MEMORY_BOUND, f"worker1 grew by {grown >> 20} MiB"
    print(f"zmq: {RAW_CONNECTIONS} raw connections ({raw_bytes} bytes), {ZMQ_SOCKETS} "
          f"ZeroMQ sockets, {sent} messages queued of "
          f"{ZMQ_SOCKETS * MESSAGES_PER_SOCKET} tried; worker1 grew {grown >> 10} KiB")
