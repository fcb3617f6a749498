"""The loopback backend: every worker is a thread of this process.

Frames still go through the full codec and every tensor buffer is copied on send, so
values, pickling errors and exceptions behave exactly as on a real transport. Delivery
is a direct call into the receiving agent (which queues requests on its own pool), so
frames from one sender arrive in the order they were sent.

Like a network transport, each worker publishes its address (here a token naming its
endpoint in this process) through the rendezvous store, and resolves peers from it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any, ClassVar

from rpcx.errors import LostCause, PeerLostError, ProtocolError, lost_reason
from rpcx.hookspecs import hookimpl
from rpcx.transport import Capabilities, Frame, TransportContext

log = logging.getLogger("rpcx.backends.loopback")

__all__ = ["LoopbackTransport"]

_endpoints_lock = threading.Lock()
_endpoints: dict[str, LoopbackTransport] = {}  # address token -> live endpoint


class LoopbackTransport:
    """Hands frames straight to the destination worker's agent, copying tensors."""

    capabilities: ClassVar[Capabilities] = Capabilities(
        multi_process=False, multi_host=False, in_process=True
    )

    def __init__(self) -> None:
        self._ctx: TransportContext | None = None
        self._token = uuid.uuid4().hex
        self._peers: dict[int, LoopbackTransport] = {}
        self._gone: set[int] = set()
        self._closed = False

    def start(self, ctx: TransportContext) -> None:
        """Publish this endpoint's address in the store."""
        self._ctx = ctx
        with _endpoints_lock:
            _endpoints[self._token] = self
        ctx.store.set(f"addr/{ctx.rank}", self._token)

    def send(self, dst: int, frame: Frame) -> None:
        """Copy the frame's buffers and deliver it on the calling thread."""
        ctx = self._ctx
        assert ctx is not None
        peer = self._peers.get(dst) or self._resolve(dst)
        if peer is None or peer._closed or dst in self._gone:
            raise PeerLostError(lost_reason(LostCause.DEPARTED))
        # Tensors are copied, as a network would, except those the codec copied already.
        copy = Frame(frame.header, frame.private_buffers())
        try:
            peer._deliver(ctx.rank, copy)
        except ProtocolError as exc:  # the peer refused the frame and ended the link
            log.debug("%s: %s", ctx.names[ctx.rank], exc)
            self._peer_gone(dst, LostCause.PROTOCOL_ERROR, f"ended the connection: {exc}")

    def close(self, timeout: float) -> None:
        """Leave the world; peers still running see this worker as gone."""
        ctx = self._ctx
        if ctx is None:  # never started (init_rpc failed before the transport)
            return
        self._closed = True
        with _endpoints_lock:
            _endpoints.pop(self._token, None)
        for rank in range(ctx.world_size):
            peer = self._peers.get(rank) or self._resolve(rank)
            if peer is not None and peer is not self and not peer._closed:
                peer._peer_gone(ctx.rank)

    def _resolve(self, rank: int) -> LoopbackTransport | None:
        ctx = self._ctx
        assert ctx is not None
        if not ctx.store.check([f"addr/{rank}"]):
            return None
        with _endpoints_lock:
            peer = _endpoints.get(ctx.store.get(f"addr/{rank}").decode())
        if peer is not None:
            self._peers[rank] = peer
        return peer

    def _deliver(self, src: int, frame: Frame) -> None:
        ctx = self._ctx
        if ctx is None or self._closed:
            raise PeerLostError(lost_reason(LostCause.DEPARTED))
        ctx.deliver(src, frame)

    def _peer_gone(self, rank: int, cause: LostCause = LostCause.DEPARTED,
                   detail: str = "") -> None:
        if rank not in self._gone and self._ctx is not None:
            self._gone.add(rank)
            self._ctx.peer_lost(rank, cause, detail)


@hookimpl
def rpcx_register_backends(register: Any) -> None:
    """Register the loopback backend."""
    register(
        "loopback",
        LoopbackTransport,
        description="every worker a thread of one process; for tests and notebooks",
    )
