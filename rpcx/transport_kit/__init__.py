"""rpcx's public transport kit: what every transport shares, written once.

A transport moves :class:`~rpcx.transport.Frame` objects between ranks (the contract is
:mod:`rpcx.transport`). Most of what that takes is the same in every backend, and lives
here, public and stable for plugin authors (a plugin needs nothing private from rpcx):

:class:`Link`, :class:`Peers` (:mod:`~rpcx.transport_kit.links`)
    The per-peer state (send lock, goodbye flags, lane, stash, ``ended``), the one way a
    link ends (``Link.end(cause, detail)``) and, for every peer, the receive loop that
    honours the lane protocol, goodbyes, lost-peer reports (``peer_lost(rank, cause,
    detail)``) and ``close`` with its "no goodbye from" warning. ``read_one`` may raise
    :class:`StopReceiving` or :class:`LinkEnded` to end a loop on the transport's word.
:class:`Backlog`, :class:`Pending` (:mod:`~rpcx.transport_kit.writer`)
    The per-peer writer thread that lets ``send`` return by ``frame.deadline`` when a
    peer stops reading.
:class:`MessageTransport` (:mod:`~rpcx.transport_kit.message`)
    The skeleton of a transport whatever carries its bytes: the context and peers, a
    dynamic world's joining and doorway, "write now or queue until the deadline"
    (``post``) and the close template with a per-link release hook. A backend writes
    its wire format, how it connects, and the hooks it needs (gloo, the zmq plugin).
:class:`StreamTransport` (:mod:`~rpcx.transport_kit.sockets`), :func:`introduce`,
:func:`admit`, :func:`connect_stream_mesh` (:mod:`~rpcx.transport_kit.mesh`)
    The skeleton over stream sockets: a new socket backend writes ``connect``,
    ``read_one`` and ``pack``, and the kit does the rest (the handshake, with a world
    key's challenge-response, included). In a dynamic world, :func:`join_stream_mesh`
    connects a newcomer to every member and a :class:`Doorway` admits later ones.
:class:`SocketLink`, :class:`SocketReader`, :func:`send_now`
(:mod:`~rpcx.transport_kit.socket_link`)
    One peer over a stream socket: its buffered reader, writes that never wait, and a
    large frame written in pieces that small frames (``Frame.may_pass``) may pass.
Sentences (:mod:`~rpcx.transport_kit.sentences`)
    ``SHUT_DOWN``, ``CLOSED_CONNECTION``, :func:`unreachable`, :func:`describe`,
    :func:`lost_error`, :func:`classify`: what a transport says of a lost peer.
A frame's bytes (:mod:`~rpcx.transport_kit.buffers`)
    :func:`check_frame_size`, :func:`check_count`, :func:`as_bytes`, :func:`memory_of`,
    :func:`owning_memory`, :func:`empty_bytes`, :func:`copy_of`, :func:`pieces`.
Starting (:mod:`~rpcx.transport_kit.starting`)
    :func:`options_as`, :func:`connect_limit`, :func:`connect_timeout`,
    :func:`run_bounded`, :func:`wait_connected` (every connection up within the
    bound), :func:`environment_variable` (a variable set for a block, for libraries
    that read the environment); and the host facts of :mod:`rpcx.hosts`.
The store (:func:`keep_if_file_store`)
    A transport that clones the world's store marks each clone so that a FileStore is
    never destroyed under another worker.

See ``docs/plugins.md`` for a walk-through.
"""

from rpcx._world.rendezvous import keep_if_file_store
from rpcx.errors import LostCause, PeerLostError, ProtocolError, lost_reason
from rpcx.hosts import address_towards, host_identity
from rpcx.transport import (
    Capabilities,
    ConnectionAuth,
    Frame,
    ReceiveLane,
    Transport,
    TransportContext,
)
from rpcx.transport_kit.buffers import (
    PIECE_BYTES,
    as_bytes,
    check_count,
    check_frame_size,
    copy_of,
    empty_bytes,
    memory_of,
    owning_memory,
    pieces,
)
from rpcx.transport_kit.links import (
    BYE_TIMEOUT,
    Arrivals,
    Link,
    LinkEnded,
    Peers,
    StopReceiving,
)
from rpcx.transport_kit.mesh import (
    ADMITTED,
    HANDSHAKE_TIMEOUT,
    Doorway,
    admit,
    connect_stream_mesh,
    dial_pair,
    dial_tcp,
    hello,
    introduce,
    join_stream_mesh,
    publish_stream_address,
    receive_exactly,
)
from rpcx.transport_kit.message import MessageTransport
from rpcx.transport_kit.sentences import (
    CLOSED_CONNECTION,
    SHUT_DOWN,
    classify,
    describe,
    lost_error,
    unreachable,
    without_cpp_locations,
)
from rpcx.transport_kit.socket_link import SocketLink, SocketReader, send_all, send_now
from rpcx.transport_kit.sockets import StreamTransport
from rpcx.transport_kit.starting import (
    connect_limit,
    connect_timeout,
    environment_variable,
    options_as,
    run_bounded,
    wait_connected,
)
from rpcx.transport_kit.writer import Backlog, Pending

__all__ = [
    "ADMITTED", "BYE_TIMEOUT", "CLOSED_CONNECTION", "HANDSHAKE_TIMEOUT", "PIECE_BYTES",
    "SHUT_DOWN",
    "Arrivals", "Backlog",
    "Capabilities", "ConnectionAuth", "Doorway", "Frame", "Link", "LinkEnded", "LostCause",
    "MessageTransport", "PeerLostError",
    "Peers", "Pending", "ProtocolError", "ReceiveLane", "SocketLink", "SocketReader",
    "StopReceiving", "StreamTransport", "Transport", "TransportContext", "address_towards", "admit",
    "as_bytes", "check_count", "check_frame_size", "classify", "connect_limit",
    "connect_stream_mesh", "connect_timeout", "copy_of", "describe", "dial_pair", "dial_tcp",
    "empty_bytes",
    "environment_variable", "hello", "host_identity", "introduce", "join_stream_mesh",
    "keep_if_file_store",
    "lost_error",
    "lost_reason", "memory_of",
    "options_as", "owning_memory", "pieces", "publish_stream_address", "receive_exactly",
    "run_bounded", "send_all", "send_now", "unreachable", "wait_connected",
    "without_cpp_locations",
]
