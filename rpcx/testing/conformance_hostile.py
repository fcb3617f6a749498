"""Conformance: a peer that misbehaves cannot make a worker run code or take a reply.

A worker sends, through its own agent and the backend under test, what a buggy or
compromised peer could: a reply to a request that went to someone else, a frame of a
kind nobody handles, notes that would run code when unpickled. The victim must drop
them without running anything and keep serving everyone.
"""

from __future__ import annotations

import pickle
import uuid
from typing import cast

import rpcx
from rpcx._core import context as _context
from rpcx._core.agent import RpcAgent
from rpcx.messages import MessageKind
from rpcx.testing import remote
from rpcx.testing.world import World

__all__ = ["TestHostilePeers"]

W1, W2 = "worker1", "worker2"
BOUND = 30.0


def _notes_that_run_code(marker: str) -> bytes:
    """A pickle of notes that sets the environment variable ``marker`` when loaded."""
    return pickle.dumps([(int(MessageKind.RREF_CONFIRM), remote.SetsEnvironmentWhenUnpickled(
        marker))])


class TestHostilePeers:
    """worker2 misbehaves towards worker0 or worker1."""

    def test_a_reply_from_another_worker_than_the_callee_is_dropped(
        self, rpc_world: World
    ) -> None:
        key = uuid.uuid4().hex
        call = rpcx.rpc_async(W1, remote.wait_for_event, args=(key, BOUND), timeout=BOUND)
        pending = cast(RpcAgent, _context.current_agent())._pending._calls
        request_id = max(rid for rid, p in pending.items() if p.dst.name == W1)
        # worker2 answers worker1's call; its next reply to us follows that frame.
        rpcx.rpc_sync(W2, remote.forge_reply, args=(0, request_id, "forged"))
        assert not call.done()
        assert rpcx.rpc_sync(W1, remote.set_event, args=(key,)) == W1
        assert call.wait() is True  # the real reply, from worker1

    def test_a_frame_of_an_unknown_kind_is_dropped_unread(self, rpc_world: World) -> None:
        marker = f"RPCX_KIT_{uuid.uuid4().hex}"
        rpcx.rpc_sync(W2, remote.send_noted_frame,
                      args=(1, 0x3E, None, _notes_that_run_code(marker)))
        # worker2's next call to worker1 is served after that frame was handled.
        assert rpcx.rpc_sync(W2, remote.call_and_wait, args=(
            rpcx.rpc_async, W1, remote.environment_has, (marker,))) is False
        assert rpcx.rpc_sync(W1, remote.add, args=(1, 2)) == 3

    def test_notes_that_name_a_global_are_refused(self, rpc_world: World) -> None:
        marker = f"RPCX_KIT_{uuid.uuid4().hex}"
        rpcx.rpc_sync(W2, remote.send_noted_frame, args=(
            1, int(MessageKind.RREF_CONFIRM), [], _notes_that_run_code(marker)))
        assert rpcx.rpc_sync(W2, remote.call_and_wait, args=(
            rpcx.rpc_async, W1, remote.environment_has, (marker,))) is False
        assert rpcx.rpc_sync(W1, remote.add, args=(1, 2)) == 3
        assert rpcx.rpc_sync(W2, remote.call_and_wait, args=(
            rpcx.rpc_async, W1, remote.add, (2, 2))) == 4

    def test_bookkeeping_messages_that_name_a_global_run_nothing(
        self, rpc_world: World
    ) -> None:
        # RRef and autograd bookkeeping is read as plain data and tensors only.
        marker = f"RPCX_KIT_{uuid.uuid4().hex}"
        for kind in (MessageKind.RREF_FETCH, MessageKind.RREF_FORKS, MessageKind.RREF_DELETE,
                     MessageKind.RREF_CONFIRM, MessageKind.AUTOGRAD_BACKWARD,
                     MessageKind.AUTOGRAD_RELEASE, MessageKind.AUTOGRAD_RUN,
                     MessageKind.AUTOGRAD_CHAIN, MessageKind.AUTOGRAD_CHAIN_END,
                     MessageKind.AUTOGRAD_FORGET):
            rpcx.rpc_sync(W2, remote.send_code_as, args=(1, int(kind), marker))
        assert rpcx.rpc_sync(W2, remote.call_and_wait, args=(
            rpcx.rpc_async, W1, remote.environment_has, (marker,))) is False
        assert rpcx.rpc_sync(W1, remote.add, args=(1, 2)) == 3
        # and the bookkeeping itself still works between them
        rref = rpcx.rpc_sync(W2, remote.make_rref, args=(41,))
        assert rpcx.rpc_sync(W1, remote.rref_to_here, args=(rref,)) == 41
