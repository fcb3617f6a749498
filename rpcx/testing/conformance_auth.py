"""Conformance: with a world key, nobody without it joins, and no unauthenticated frame runs.

Each test starts worlds of its own (a wrong key must fail ``init_rpc``, and a refused
frame ends a connection), so the module's shared world is closed first.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import random
import socket
import struct
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import rpcx
from rpcx._core import context as _context
from rpcx._wire import auth, codec
from rpcx._world import rendezvous
from rpcx.errors import AuthenticationError
from rpcx.messages import MessageKind
from rpcx.registry import resolve_backend
from rpcx.testing import remote
from rpcx.testing.fixtures import WorldKeeper
from rpcx.testing.processes import worker_context
from rpcx.testing.world import World, _options, world

__all__ = ["TestAuthentication"]

log = logging.getLogger("rpcx.testing")

KEY = "conformance-key-" + "0123456789abcdef"
SEED = 20261124
FUZZ_CONNECTIONS = 60  # per listener
FUZZ_MESSAGES = 25  # per connection
FUZZ_MEMORY_BOUND = 64 << 20
OTHER_KEY = "another-key-----" + "0123456789abcdef"
BOUND = 30.0


def join_and_report(rank: int, size: int, init_method: str, backend: str,
                    options: dict[str, Any], answers: Any) -> None:
    """Worker ``rank`` tries to join; puts ``"joined"`` or the error it got on ``answers``."""
    try:
        rpcx.init_rpc(f"worker{rank}", backend=backend, rank=rank, world_size=size,
                      rpc_backend_options=_options(backend, init_method, options))
    except BaseException as exc:
        answers.put(f"{type(exc).__name__}: {exc}")
        return
    answers.put("joined")
    rpcx.shutdown()


@dataclass
class Tried:
    """What a fuzzing run sent."""

    connections: int = 0
    messages: int = 0
    bytes: int = 0


def listening_addresses(process: Any) -> list[tuple[int, Any]]:
    """``(family, address)`` of every TCP and Unix socket ``process`` listens on."""
    found: list[tuple[int, Any]] = []
    for conn in process.net_connections(kind="inet"):
        if conn.status == "LISTEN":
            host = conn.laddr.ip
            if host in ("0.0.0.0", "::"):
                host = "127.0.0.1" if host == "0.0.0.0" else "::1"
            found.append((socket.AF_INET6 if ":" in host else socket.AF_INET,
                          (host, conn.laddr.port)))
    for conn in process.net_connections(kind="unix"):
        if conn.laddr and conn.status in ("LISTEN", "NONE") and os.path.exists(conn.laddr):
            found.append((socket.AF_UNIX, conn.laddr))
    return found


def call_frames(marker: str, payload: Any = None) -> list[bytes]:
    """Headers of a call to rank 1 that would leave ``marker`` on its callee: as the
    codec writes it, and sealed with a key that is not the world's. The call's payload is
    ``payload`` (e.g. ``(remote.tally, (marker,), {})``), by default an object whose
    unpickling sets the environment variable ``marker``."""
    agent = _context.current_agent()
    ctx = codec.EncodeContext(1, agent=agent, routes=agent.routes)
    if payload is None:
        payload = remote.SetsEnvironmentWhenUnpickled(marker)
    frame = codec.encode(MessageKind.CALL, 0, payload, ctx)
    stranger = auth.FrameGuard(b"not this world's key, 32 bytes..", 0,
                               [auth.new_nonce() for _ in range(3)], ["a", "b", "c"])
    return [frame.header, stranger.seal(1, frame).header]


def _mutated(rng: random.Random, frames: list[bytes]) -> bytes:
    choice = rng.randrange(4)
    if choice == 0:
        return rng.randbytes(rng.randrange(1, 4096))
    data = bytearray(rng.choice(frames))
    if choice == 1:
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif choice == 2:
        data = data[: rng.randrange(1, len(data))]
    else:
        data = bytearray(struct.pack("<Q", rng.randrange(1 << 64))) + data + rng.randbytes(64)
    return bytes(data)


def fuzz_listeners(targets: list[tuple[int, Any]], frames: list[bytes],
                   rng: random.Random) -> Tried:
    """Open ``FUZZ_CONNECTIONS`` connections to each target and write ``FUZZ_MESSAGES``
    random or mutated messages on each; a connection the worker closes is fine."""
    tried = Tried()
    for family, address in targets:
        for _ in range(FUZZ_CONNECTIONS):
            try:
                conn = socket.socket(family, socket.SOCK_STREAM)
                conn.settimeout(BOUND)
                conn.connect(address)
            except OSError:
                continue  # refused (a backlog full of strangers): also fine
            tried.connections += 1
            with conn:
                for _ in range(FUZZ_MESSAGES):
                    data = _mutated(rng, frames)
                    try:
                        conn.sendall(data)
                    except OSError:
                        break  # the worker hung up on us
                    tried.messages += 1
                    tried.bytes += len(data)
    return tried


def _join_when_ready(rank: int, size: int, init_method: str, backend: str,
                     options: dict[str, Any], answers: Any) -> None:
    """Say ``"ready"`` (imports done), then :func:`join_and_report`."""
    answers.put("ready")
    join_and_report(rank, size, init_method, backend, options, answers)


class _Outsider:
    """Runs :func:`join_and_report` for rank 1 as a process or a thread, per backend;
    ready to join once made (a worker started next does not wait for its imports, so a
    short ``rpc_timeout`` of that worker's covers the outsider's attempt)."""

    def __init__(self, backend: str, init_method: str, options: dict[str, Any]) -> None:
        spec = resolve_backend(backend)
        args = (1, 2, init_method, spec.name, options)
        if spec.capabilities.multi_process and not spec.capabilities.in_process:
            context = worker_context()
            self.answers: Any = context.Queue()
            self.runner: Any = context.Process(target=_join_when_ready,
                                               args=(*args, self.answers), daemon=True)
        else:
            self.answers = queue.Queue()
            self.runner = threading.Thread(target=_join_when_ready,
                                           args=(*args, self.answers), daemon=True)
        self.runner.start()
        assert self.answers.get(timeout=BOUND) == "ready"

    def answer(self) -> str:
        got: str = self.answers.get(timeout=2 * BOUND)
        self.runner.join(BOUND)
        return got


def assert_refused(victim: str, sender: str, problem: str) -> None:
    """``victim`` refused a frame of ``sender``'s and reported it lost, as a protocol
    error whose reason names ``problem``."""
    lost = rpcx.rpc_sync(victim, remote.wait_until_lost, args=(sender, BOUND))
    assert sender in lost, (victim, lost)
    assert "failed authentication" in lost[sender] and problem in lost[sender], lost
    causes = rpcx.rpc_sync(victim, rpcx.debug_info)["lost_causes"]
    assert causes[sender] == "protocol error", causes


class TestAuthentication:
    """A world whose workers hold ``KEY`` (the ``auth_key`` option)."""

    @pytest.fixture
    def own_worlds(self, rpc_world_keeper: WorldKeeper) -> Iterator[str]:
        """A fresh ``file://`` rendezvous; this process runs no other world meanwhile."""
        rpc_world_keeper.close()
        with tempfile.TemporaryDirectory(prefix="rpcx-auth-") as directory:
            yield "file://" + os.path.join(directory, "rendezvous")

    @pytest.mark.parametrize("outsider_key", [OTHER_KEY, None], ids=["another-key", "no-key"])
    def test_a_worker_without_the_key_never_joins(
        self, rpcx_backend: str, own_worlds: str, outsider_key: str | None,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.delenv("RPCX_AUTH_KEY", raising=False)
        outsider = _Outsider(rpcx_backend, own_worlds,
                             {"rpc_timeout": BOUND, "auth_key": outsider_key})
        options = _options(rpcx_backend, own_worlds, {"rpc_timeout": BOUND, "auth_key": KEY})
        with pytest.raises(AuthenticationError, match="authentication failed for rank 1"):
            rpcx.init_rpc("worker0", backend=rpcx_backend, rank=0, world_size=2,
                          rpc_backend_options=options)
        answer = outsider.answer()
        assert answer.startswith("AuthenticationError")
        assert "authentication failed for rank 0" in answer
        if outsider_key is None:
            assert "this worker has none" in answer

    @pytest.mark.rpcx_requires("multi_process", reason="an in-process world has no store "
                                "other processes can reach")
    def test_a_stray_store_client_makes_init_rpc_fail_and_runs_nothing(
        self, rpcx_backend: str, own_worlds: str,
    ) -> None:
        marker = f"RPCX_KIT_{uuid.uuid4().hex}"
        posed: list[BaseException] = []

        def intruder() -> None:  # a plain store client posing as rank 1, without the key
            try:
                store = rendezvous.open_store(own_worlds, 1, 2, BOUND)
                session, _ = rendezvous.join_world(store, "intruder", 1, 2, BOUND)
                session.set("devices/1", pickle.dumps(remote.SetsEnvironmentWhenUnpickled(
                    marker)))
            except AuthenticationError:
                pass  # it cannot read the worker's sealed name either
            except BaseException as exc:
                posed.append(exc)

        thread = threading.Thread(target=intruder, daemon=True)
        thread.start()
        options = _options(rpcx_backend, own_worlds, {"rpc_timeout": BOUND, "auth_key": KEY})
        with pytest.raises(AuthenticationError, match="authentication failed for rank 1"):
            rpcx.init_rpc("worker0", backend=rpcx_backend, rank=0, world_size=2,
                          rpc_backend_options=options)
        thread.join(BOUND)
        assert not posed, posed
        assert marker not in os.environ

    def test_frames_with_bad_missing_or_replayed_macs_run_nothing(
        self, rpcx_backend: str, own_worlds: str,
    ) -> None:
        # worker2 -> worker1: a bit flipped; worker3 -> worker1: no MAC at all;
        # worker3 -> worker2: a genuine call sent twice; worker4 -> worker3: a genuine
        # call held back and delivered after a later one. Each receiver refuses the
        # frame, reports the sender lost, and keeps serving worker0.
        with world(rpcx_backend, size=5, init_method=own_worlds, rpc_timeout=BOUND,
                   auth_key=KEY) as started:
            self._check_refusals(started)

    @pytest.mark.rpcx_requires(
        "multi_process", "refuses_strangers",
        reason="strangers are sent bytes at the ports a world of processes listens on, "
               "and only a backend that declares refuses_strangers promises to refuse "
               "them (docs/security.md)")
    def test_strangers_at_every_listening_port_run_nothing(
        self, rpcx_backend: str, own_worlds: str,
    ) -> None:
        # Random bytes, and real call frames (unsealed, or sealed with another key) cut,
        # flipped and extended, at every TCP port and Unix socket worker1 listens on.
        psutil = pytest.importorskip("psutil")
        with world(rpcx_backend, size=3, init_method=own_worlds, rpc_timeout=BOUND,
                   auth_key=KEY):
            worker1 = psutil.Process(rpcx.rpc_sync("worker1", remote.process_id))
            marker = f"RPCX_KIT_FUZZ_{uuid.uuid4().hex}"
            targets = listening_addresses(worker1)
            if not targets:  # (shm closes its socket once every peer is connected)
                pytest.skip(f"worker1 of {rpcx_backend!r} listens on no port or socket "
                            "once init_rpc returns: no stranger can reach it")
            rss_before = worker1.memory_info().rss
            tried = fuzz_listeners(targets, call_frames(marker), random.Random(SEED))
            assert rpcx.rpc_sync("worker1", remote.add, args=(2, 3), timeout=BOUND) == 5
            assert rpcx.rpc_sync("worker2", remote.call_and_wait, args=(
                rpcx.rpc_async, "worker1", remote.add, (4, 4))) == 8
            assert rpcx.rpc_sync("worker1", remote.environment_has, args=(marker,)) is False
            assert rpcx.rpc_sync("worker1", rpcx.debug_info)["lost_peers"] == {}
            grown = worker1.memory_info().rss - rss_before
            assert grown < FUZZ_MEMORY_BOUND, f"worker1 grew by {grown >> 20} MiB"
            log.info("%s: %d connections to %d listeners, %d messages, %d bytes; worker1 "
                     "grew %d KiB", rpcx_backend, tried.connections, len(targets),
                     tried.messages, tried.bytes, grown >> 10)

    @staticmethod
    def _check_refusals(started: World) -> None:
        markers = {how: f"RPCX_KIT_{how}_{uuid.uuid4().hex}"
                   for how in ("bad", "missing", "replayed", "reordered")}
        rpcx.rpc_sync("worker4", remote.send_unauthenticated_call,
                      args=(3, "reordered", markers["reordered"]))
        rpcx.rpc_sync("worker2", remote.send_unauthenticated_call,
                      args=(1, "bad", markers["bad"]))
        rpcx.rpc_sync("worker3", remote.send_unauthenticated_call,
                      args=(1, "missing", markers["missing"]))
        rpcx.rpc_sync("worker3", remote.send_unauthenticated_call,
                      args=(2, "replayed", markers["replayed"]))
        for victim, sender, problem in (("worker1", "worker2", "bad or missing MAC"),
                                        ("worker1", "worker3", "MAC"),
                                        ("worker2", "worker3", "replayed"),
                                        ("worker3", "worker4", "reordered")):
            assert_refused(victim, sender, problem)
        assert rpcx.rpc_sync("worker1", rpcx.debug_info)["refused_frames"] == 2
        assert rpcx.rpc_sync("worker2", rpcx.debug_info)["refused_frames"] == 1
        assert rpcx.rpc_sync("worker3", rpcx.debug_info)["refused_frames"] == 1
        # the frame sent later ran; the one held back and delivered after it did not
        assert rpcx.rpc_sync("worker3", remote.wait_for_tally,
                             args=(markers["reordered"] + "_later", 1, BOUND)) == 1
        assert rpcx.rpc_sync("worker3", remote.tally_of, args=(markers["reordered"],)) == 0
        assert rpcx.debug_info()["authenticated"] is True
        assert rpcx.rpc_sync("worker1", remote.tally_of, args=(markers["bad"],)) == 0
        assert rpcx.rpc_sync("worker1", remote.tally_of, args=(markers["missing"],)) == 0
        assert rpcx.rpc_sync("worker2", remote.tally_of,
                             args=(markers["replayed"],)) == 1  # the genuine one, once
        for name in started.names[1:]:
            assert rpcx.rpc_sync(name, remote.add, args=(2, 3), timeout=BOUND) == 5
        assert rpcx.rpc_sync("worker2", remote.call_and_wait, args=(
            rpcx.rpc_async, "worker0", remote.add, (1, 1))) == 2
