"""The transport contract: the only thing a backend implements.

A transport moves :class:`Frame` objects between ranks. It never unpickles, never sees a
Python object other than a frame, and knows nothing of calls, RRefs or autograd. What it
needs at start (addresses, shared-memory names) it exchanges through the store it is
handed in its :class:`TransportContext`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

from rpcx._util.memory import copy_of
from rpcx.errors import LostCause

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

    from rpcx.options import RpcBackendOptions

__all__ = [
    "Capabilities", "ConnectionAuth", "DescribesRoutes", "DeviceRoutes", "Frame", "LostCause",
    "PeerLost",
    "ReceiveLane", "ReportsConnections", "Transport", "TransportContext",
    "TransportDecorator",
]


@dataclass(slots=True)
class Frame:
    """One message on the wire: an opaque header and the tensors that travel beside it.

    ``buffers`` are contiguous tensors. A transport must deliver the same bytes, in the same
    order; it may deliver them with another dtype or shape (gloo delivers flat ``uint8``
    tensors) because the codec records each tensor's dtype and shape in the header.
    """

    header: bytes
    buffers: list[torch.Tensor] = field(default_factory=list)
    # Set by the agent; transports may ignore both. ``request_id``: this frame is a
    # request that ``reply_to`` of a later frame from the peer will answer. A transport
    # with request/response messages of its own (tensorpipe) pairs the two.
    request_id: int = 0
    reply_to: int = 0
    # Indices of buffers made for this frame alone. Sent: the codec's copies (a
    # contiguous copy of a strided view, a host copy of device memory), which nothing
    # else can change, so a transport that otherwise copies what it sends later may send
    # these as they are. Delivered (optional): buffers the transport allocated for this
    # frame and shares with nothing (not a shared-memory segment, not a library's
    # message), which the receiver may write over (the cipher decrypts them in place).
    owned: frozenset[int] = frozenset()
    # A request's deadline (a ``time.monotonic()`` value; 0: none), set by the agent. A
    # transport whose ``send`` can wait on a peer that reads nothing should return by
    # then and finish the send in the background (the agent fails the call on time).
    deadline: float = 0.0
    # A request's call is over already (``settled()``: it timed out, or its peer was
    # found silent or lost), set by the agent. A transport whose ``send`` waits for a
    # peer to take the frame stops waiting then, as at the deadline: a caller must not
    # stay in ``rpc_async`` writing to a peer the heartbeat gave up on.
    settled: Callable[[], bool] | None = None
    # Nothing depends on this frame's order among frames sent meanwhile (a user call or
    # reply, a fetch, a heartbeat, with no bookkeeping riding in it), set by the agent. A
    # transport that lets a small frame pass a large one still being written
    # (``Capabilities.interleaves``) lets only these pass.
    may_pass: bool = False

    @property
    def nbytes(self) -> int:
        """Total size of the header and every buffer, in bytes."""
        return len(self.header) + sum(b.numel() * b.element_size() for b in self.buffers)

    def private_buffers(
        self, copy: Callable[[torch.Tensor], torch.Tensor] = copy_of
    ) -> list[torch.Tensor]:
        """The buffers, each a private copy unless the frame owns it (``owned``).

        What a transport that sends after ``send`` returns (or hands the tensors to
        another worker in this process) needs: nothing the caller does to its tensors
        later can change what arrives. ``copy`` makes one copy (default: a plain copy,
        huge-page backed when large; a device tensor is cloned on its device).
        """
        owned = self.owned
        return [b if i in owned else copy(b) for i, b in enumerate(self.buffers)]

    def shallow_copy(self) -> Frame:
        """A second ``Frame`` over the same header and buffers, every field kept: what
        sending a frame twice needs, as a send may seal the frame it is given in place."""
        return dataclasses.replace(self, buffers=list(self.buffers))

    def private_copy(self) -> Frame:
        """This frame with :meth:`private_buffers` (every buffer then owned)."""
        return dataclasses.replace(self, buffers=self.private_buffers(),
                                   owned=frozenset(range(len(self.buffers))))


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do; shown by ``python -m rpcx backends``.

    Attributes:
        multi_process: workers may live in different processes.
        multi_host: workers may live on different machines.
        in_process: every worker is a thread of one process (rendezvous happens in memory).
        cuda_direct: CUDA tensors travel device to device; otherwise they are staged
            through host memory.
        refuses_strangers: bytes from a process outside the world, sent to any port or
            socket the transport listens on, can neither run code nor cost a worker its
            peers (given a world key, where connections must prove it). The conformance
            kit fuzzes every listener of a worker to check it.
        lossy: frames may be dropped or duplicated (never reordered between a pair). rpcx
            then acknowledges its bookkeeping and sends it again until answered (see
            ``rpcx._core.retransmit``); user calls whose frames are lost fail with their
            timeout. False for every built-in transport (a lost connection is a lost peer).
        dynamic: workers may join after this one started (``init_rpc`` without
            ``world_size``): started with ``TransportContext.admit`` set, the transport
            connects to the members it is given and accepts newcomers for as long as it
            runs (see :class:`TransportContext`).
        reuses_ranks: in a dynamic world, a rank a worker left may be taken by a new
            worker. False for tensorpipe: torch's agent keeps its connection to a rank
            after the worker left (torch's own dynamic groups never reuse a rank).
        shows_progress: a large frame is seen arriving piece by piece: the transport
            calls ``TransportContext.progress``, so a transfer longer than
            ``heartbeat_timeout`` (a slow link, a huge tensor) does not make its peer look
            silent. False for tensorpipe: torch's agent hands rpcx a message only whole.
        interleaves: a small frame sent while a large one is still being written (its
            ``send`` not yet returned) may go ahead of it, between its pieces, if the
            agent marked it ``Frame.may_pass``: a call beside a bulk transfer waits for
            about one piece, not for the transfer. Per destination order still holds as
            ``Transport.send`` states it. True for the socket backends (auto, shm, tcp).
    """

    multi_process: bool
    multi_host: bool
    in_process: bool = False
    cuda_direct: bool = False
    refuses_strangers: bool = True
    lossy: bool = False
    dynamic: bool = False
    reuses_ranks: bool = True
    shows_progress: bool = False
    interleaves: bool = False

    def summary(self) -> str:
        """A short comma-separated list of the true flags (``reuses_ranks`` only with
        ``dynamic``)."""
        flags = [name for name, value in vars(self).items()
                 if value and (name != "reuses_ranks" or self.dynamic)]
        return ", ".join(flags) if flags else "-"


class ReceiveLane(Protocol):
    """The role of receiving one peer's frames, as a transport uses it.

    Run the receive loop between :meth:`enter` and :meth:`leave`; after each delivery
    ask :meth:`still_held`: ``False`` means another thread took the loop over (the
    lane's ``resume``), so this one must return. :class:`rpcx.transport_kit.Peers` runs
    this protocol for a transport.
    """

    def enter(self) -> None:
        """The calling thread takes the role (it runs the receive loop from here on)."""

    def still_held(self) -> bool:
        """After a delivery: does the calling thread still hold the role?"""

    def held_here(self) -> bool:
        """Whether the calling thread holds the role now (no side effect)."""

    def leave(self) -> None:
        """The receive loop ended on the calling thread (the peer is gone)."""


class ConnectionAuth(Protocol):
    """A world key's challenge-response, for connections a transport accepts itself.

    ``purpose`` names the step (e.g. ``"shm connect"``), so a proof for one step never
    passes for another; ``src`` proves to ``dst``. :func:`rpcx.transport_kit.introduce`
    and :func:`~rpcx.transport_kit.admit` run the whole exchange on a stream socket.
    """

    def challenge(self) -> bytes:
        """A fresh random challenge (``rpcx._wire.auth.NONCE_BYTES`` long)."""

    def renew(self, rank: int) -> None:
        """A connection from ``rank`` says a worker joins there (a dynamic world): learn
        that worker's session before the proofs. Call it before :meth:`proof` and
        :meth:`check` for a newcomer's connection; raises ``RpcError`` (refuse the
        connection) if the newcomer published no genuine session. Nothing happens in a
        world of fixed size."""

    def proof(self, purpose: str, src: int, dst: int, challenge: bytes = b"") -> bytes:
        """What ``src`` answers ``dst``'s ``challenge`` with (``rpcx._wire.auth.TAG_BYTES``)."""

    def check(self, purpose: str, src: int, dst: int, challenge: bytes, proof: bytes) -> bool:
        """Whether ``proof`` is ``src``'s answer to ``challenge``."""


class DeviceRoutes(Protocol):
    """The world's device maps as they apply to this worker (read-only)."""

    @property
    def outgoing(self) -> Mapping[int, Mapping[torch.device, torch.device]]:
        """For each peer, where this worker's devices land on it."""

    @property
    def incoming(self) -> Mapping[int, Mapping[torch.device, torch.device]]:
        """For each peer, where its devices land on this worker."""

    @property
    def devices(self) -> Sequence[torch.device]:
        """This worker's devices that take part."""


class PeerLost(Protocol):
    """``peer_lost(rank, cause, detail)``: what a transport calls when a peer is gone.

    ``cause`` classifies it (a :class:`LostCause`); ``detail`` says what the transport
    saw, e.g. ``"connection reset"`` or the protocol rule a frame broke (nothing for a
    peer that said goodbye). rpcx writes the sentence users read from both
    (:func:`rpcx.errors.lost_reason`) and decides how loudly to log (a peer that departs
    during shutdown is expected).
    """

    def __call__(self, rank: int, cause: LostCause, detail: str = "") -> None: ...


@dataclass
class TransportContext:
    """Everything a transport gets when it starts.

    Attributes:
        rank: this worker's rank.
        world_size: the number of workers.
        names: every worker's name, by rank.
        store: a torch.distributed ``Store`` private to this transport (already prefixed).
        options: the options object passed to ``init_rpc``.
        init_method: the rendezvous URL in use.
        deliver: call with ``(src_rank, frame)`` for every frame received. It may be called
            from any thread; frames from one source must be delivered in the order sent.
        peer_lost: call with ``(rank, cause, detail)`` when a peer dies or leaves, once
            per peer (see :class:`PeerLost`).
        routes: the world's device maps as they apply to this worker (checked at
            ``init_rpc``); a transport that moves device memory configures its routing
            from them. The codec already decided where each tensor lands.
        receive_lane: optional, for transports that receive on threads of their own:
            ``receive_lane(name, resume)`` returns a :class:`ReceiveLane`
            for one peer's receive loop. Run the loop between ``lane.enter()`` and
            ``lane.leave()`` and stop when ``lane.still_held()`` is false after a
            delivery; ``resume()`` must continue the loop (it is started on another
            thread when a request served on the receiving thread blocks). Requests
            delivered on a lane are served on the receiving thread, saving the hand-off
            to the request pool. Without a lane, they go to the pool.
        admit: set in a dynamic world (only for transports whose capabilities say
            ``dynamic``). Ranks whose name is a vacant placeholder (see
            ``vacant``) hold no worker yet. The transport connects to every member at
            start, and from then on accepts a worker that joins later: it calls
            ``admit(rank)`` before delivering anything from it (it returns the
            newcomer's name, having made room for it in ``names``; it raises to
            refuse the connection). A member that leaves says goodbye as at shutdown.
        vacant: ``vacant(rank)``: whether ``rank`` holds no worker (a dynamic world).
        progress: ``progress(rank)``: call after each piece of a large frame read from
            ``rank`` (not per small read): the peer is alive though no whole frame has
            arrived (a 2 GiB tensor on a slow link takes longer than
            ``heartbeat_timeout``). The core counts it as heard from and now and then
            tells it this worker is alive (its own pings wait behind the frame).
        auth: a :class:`ConnectionAuth`, set when the world has a key. Frames are
            already sealed and checked by the core; a transport that accepts connections of its own
            should make each new connection prove the key with it (a challenge from each
            end, answered with ``auth.proof``) and close one that fails, before reading
            a frame from it.

    ``deliver`` raises :class:`~rpcx.errors.ProtocolError` when a frame breaks the
    protocol above the transport (it failed authentication): end that connection as for
    a malformed frame of the transport's own format.
    """

    rank: int
    world_size: int
    names: list[str]
    store: Store
    options: RpcBackendOptions
    init_method: str
    deliver: Callable[[int, Frame], None]
    peer_lost: PeerLost
    routes: DeviceRoutes | None = None
    receive_lane: Callable[[str, Callable[[], None]], ReceiveLane] | None = None
    auth: ConnectionAuth | None = None
    admit: Callable[[int], str] | None = None
    vacant: Callable[[int], bool] = lambda rank: False
    progress: Callable[[int], None] = lambda rank: None


@runtime_checkable
class DescribesRoutes(Protocol):
    """What a transport that picks a path per peer may add: how it reaches each one.

    ``debug_info()`` shows it under ``routes``; ``rpcx doctor`` explains a fallback."""

    def routes(self) -> Mapping[int, str]:
        """How this worker reaches each peer, by rank, e.g. ``"shm (same host)"``."""
        ...


@runtime_checkable
class ReportsConnections(Protocol):
    """What a transport that may connect a pair of workers when they first talk adds.

    When it does, the agent watches (heartbeats) and says goodbye to connected peers
    only (a peer this worker never talked to has no connection to lose), and a
    shutdown barrier pings the workers it still waits for that it has no connection
    to (connecting to one that is gone fails: it is then reported lost)."""

    def connects_on_demand(self) -> bool:
        """Whether pairs connect when they first talk (else all are connected at start)."""
        ...

    def connected(self, rank: int) -> bool:
        """Whether this worker has a connection to ``rank`` now."""
        ...


class Transport(Protocol):
    """Moves frames between ranks. One instance per worker.

    Implementations provide a class attribute ``capabilities`` and three methods.
    """

    capabilities: ClassVar[Capabilities]

    def start(self, ctx: TransportContext) -> None:
        """Connect to every peer. Returns once frames can be sent to any rank."""

    def send(self, dst: int, frame: Frame) -> None:
        """Send ``frame`` to rank ``dst`` (never this worker's own rank).

        Thread-safe. Frames to one destination arrive in order, whichever threads sent
        them: a frame whose ``send`` returned before another ``send`` to the destination
        began arrives first, and the receiver delivers them one at a time in arrival
        order (the RRef protocol depends on this). Frames whose sends overlap may arrive
        either way. When ``send`` returns the
        buffers have been written or copied: the caller may modify them. Raises
        ``PeerLostError`` if the peer is known to be gone.
        """

    def close(self, timeout: float) -> None:
        """Tell every peer this worker is leaving and release all resources.

        Waits at most ``timeout`` seconds for peers to acknowledge, then gives up with a
        logged warning. Frames from peers that arrive before their goodbye are delivered.
        """


class TransportDecorator:
    """What a transport that wraps another (``inner``) passes through: ``close``, the
    routes and connections it reports, and any other attribute (a test may reach a
    backend's links through it). A decorator writes ``start`` and ``send``; the fault
    injector (:mod:`rpcx.faulty`) and the world key's seals are two."""

    inner: Transport

    def close(self, timeout: float) -> None:
        """Close the inner transport."""
        self.inner.close(timeout)

    def routes(self) -> Mapping[int, str]:
        """The inner transport's routes, if it reports any."""
        inner = self.inner
        return inner.routes() if isinstance(inner, DescribesRoutes) else {}

    def connects_on_demand(self) -> bool:
        """Whether the inner transport connects pairs when they first talk."""
        inner = self.inner
        return isinstance(inner, ReportsConnections) and inner.connects_on_demand()

    def connected(self, rank: int) -> bool:
        """Whether the inner transport has a connection to ``rank`` (always, for one
        that connects every pair at start)."""
        inner = self.inner
        return not isinstance(inner, ReportsConnections) or inner.connected(rank)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self.inner, name)
