"""With a world key, each shm connection proves the key both ways before a frame is read.

Both ends of the handshake run here, on a Unix socket pair: the connecting side
(``introduce``) and the accepting side (``admit``), as rpcx's transport kit runs them
for shm's mesh (``connect_stream_mesh``).
"""

from __future__ import annotations

import random
import socket
import threading
from typing import Any

import pytest
import torch.distributed as dist

import rpcx
from rpcx._wire import auth
from rpcx.errors import AuthenticationError
from rpcx.transport import TransportContext
from rpcx.transport_kit import admit, hello, introduce
from rpcx.transport_kit import mesh as kit_mesh

LABEL = "shm"  # the shm backend's label: its handshake's magic and proof purposes


def _admit(conn: socket.socket, ctx: TransportContext) -> int | None:
    """The accepting side as shm's mesh runs it (higher ranks only, each once)."""
    return admit(conn, ctx, LABEL, lambda rank: ctx.rank < rank < ctx.world_size)

KEY = b"shm-handshake-test-key-012345678"
NONCES = [auth.new_nonce() for _ in range(3)]
BOUND = 30.0


def _ctx(rank: int, key: bytes | None = KEY, nonces: list[bytes] = NONCES) -> TransportContext:
    return TransportContext(
        rank=rank, world_size=3, names=["w0", "w1", "w2"], store=dist.HashStore(),
        options=rpcx.RpcBackendOptions(), init_method="file:///unused",
        deliver=lambda src, frame: None, peer_lost=lambda rank, cause, detail="": None,
        auth=None if key is None else auth.ConnectionAuth(key, nonces),
    )


def _handshake(acceptor: TransportContext, connector: TransportContext
               ) -> tuple[int | None, BaseException | None]:
    """Run both sides; (what the acceptor admitted, what the connector raised)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.settimeout(BOUND)
    theirs.settimeout(BOUND)
    raised: list[BaseException] = []

    def connect() -> None:
        try:
            introduce(theirs, connector, acceptor.rank, LABEL)
        except BaseException as exc:
            raised.append(exc)
        finally:
            theirs.close()

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    try:
        admitted = _admit(ours, acceptor)
    finally:
        ours.close()
    thread.join(BOUND)
    return admitted, (raised[0] if raised else None)


def test_workers_holding_the_key_admit_each_other() -> None:
    assert _handshake(_ctx(0), _ctx(2)) == (2, None)
    assert _handshake(_ctx(0, None), _ctx(2, None)) == (2, None)  # no key: hello only


def test_a_worker_with_another_key_is_refused_and_refuses() -> None:
    admitted, raised = _handshake(_ctx(0), _ctx(2, b"another key, also 32 bytes long!"))
    assert admitted is None
    assert isinstance(raised, AuthenticationError)
    assert "connection to rank 0 failed authentication" in str(raised)


def test_a_proof_from_another_session_is_refused() -> None:
    other_session = [auth.new_nonce() for _ in range(3)]
    admitted, raised = _handshake(_ctx(0), _ctx(2, KEY, other_session))
    assert admitted is None and isinstance(raised, AuthenticationError)


def test_a_stray_claiming_a_rank_without_a_proof_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    admitted, raised = _handshake(_ctx(0), _ctx(2, None))  # a hello, then nothing
    assert admitted is None and raised is None
    assert "refused an shm connection" in caplog.text


@pytest.mark.parametrize("seed", range(40))
def test_random_bytes_are_refused(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kit_mesh, "HANDSHAKE_TIMEOUT", 0.5)
    rng = random.Random(seed)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        greeting = hello(_ctx(2), LABEL) if seed % 2 else b""
        theirs.sendall(greeting + rng.randbytes(rng.randrange(0, 200)))
        if seed % 4 == 1:
            theirs.shutdown(socket.SHUT_WR)  # and hang up; the others go silent
        assert _admit(ours, _ctx(0)) is None


def test_a_silent_connection_is_dropped_after_the_handshake_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kit_mesh, "HANDSHAKE_TIMEOUT", 0.2)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        admitted: list[Any] = []
        thread = threading.Thread(target=lambda: admitted.append(_admit(ours, _ctx(0))))
        thread.start()
        thread.join(BOUND)
        assert admitted == [None]
