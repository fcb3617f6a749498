"""Authentication with a shared key: who may join a world, and which frames are genuine.

With a key set (``RPCX_AUTH_KEY``, or the ``auth_key`` field of the backend options,
which wins), three things hold on every backend, plugins included:

* every value rpcx reads back from the rendezvous store carries an HMAC, so a worker
  holding another key, or a stray store client, makes ``init_rpc`` fail naming the rank
  (:class:`ValueSeal`);
* each worker draws a fresh random *session nonce* at ``init_rpc`` and publishes it,
  sealed. Every frame from ``src`` to ``dst`` carries HMAC-SHA256 over its sequence
  number, its buffer sizes and its header, under a key derived from the world key and
  both workers' nonces: a frame is only accepted if its sender holds the key *and* knows
  this session's nonce of the receiver (the challenge), and only once (the sequence
  number). It is checked before the codec reads a byte of it (:class:`FrameGuard`);
* transports that accept connections of their own prove the key on each connection
  before reading frames from it (:class:`ConnectionAuth`).

The key never leaves the process: only HMACs of it travel. Nothing is encrypted here;
:mod:`rpcx._wire.cipher` encrypts with keys derived from it (``RPCX_ENCRYPT``).
docs/security.md gives the threat model.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rpcx._util.recent import RecentIds
from rpcx.errors import ProtocolError, RpcError
from rpcx.transport import Frame

__all__ = [
    "AUTH_KEY_ENV",
    "ConnectionAuth",
    "FrameGuard",
    "ValueSeal",
    "new_nonce",
    "resolve_key",
]

log = logging.getLogger("rpcx.auth")

AUTH_KEY_ENV = "RPCX_AUTH_KEY"
NONCE_BYTES = 16
TAG_BYTES = 32  # HMAC-SHA256, untruncated
_SEALED = b"rpcx-v1\x00"  # starts every sealed store value: an unkeyed worker can tell
_SEQ = struct.Struct("<Q")
_FRAME_HEAD = struct.Struct("<QQI")  # seq, header length, number of buffers
_SEALED_PREFIX = _SEQ.size + TAG_BYTES  # what a sealed frame's header starts with
_LOG_EVERY = 10.0  # seconds between log lines about one source's refused frames
# A sealed frame's 8-byte number is ``seq << _LAG_BITS | lag``: its sequence number, and
# how far back the oldest frame to the same peer still being sent was when it was sealed
# (``seq - lag``: every earlier frame's send had returned, so each must arrive before
# it). ``_LAG_NONE``: no such claim (more in flight than the field holds).
_LAG_BITS = 24
_LAG_NONE = (1 << _LAG_BITS) - 1
_SEQ_MAX = (1 << (64 - _LAG_BITS)) - 1  # frames to one peer in one session


def resolve_key(options: Any) -> bytes | None:
    """The world key: ``options.auth_key`` if set, else ``$RPCX_AUTH_KEY``, else ``None``.

    A ``str`` is taken as UTF-8. An empty key is an error rather than "no key": a
    launcher that exports an empty variable meant to set one.
    """
    key = getattr(options, "auth_key", None)
    source = "auth_key option"
    if key is None:
        key = os.environ.get(AUTH_KEY_ENV)
        source = AUTH_KEY_ENV
    if key is None:
        return None
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if not raw:
        raise ValueError(f"the {source} is empty; unset it to run without authentication")
    if len(raw) < 16:
        log.warning("the %s is %d bytes long; use at least 16 random bytes "
                    "(python -c 'import secrets; print(secrets.token_hex(32))')",
                    source, len(raw))
    return raw


def new_nonce() -> bytes:
    """A fresh random session nonce."""
    return secrets.token_bytes(NONCE_BYTES)


def _derive(key: bytes, purpose: bytes, *parts: bytes) -> bytes:
    """A subkey of ``key`` for one purpose: keys for different jobs never coincide."""
    return hmac.digest(key, b"\x00".join((b"rpcx", purpose, *parts)), "sha256")


class ValueSeal:
    """Seals and opens values in the rendezvous store with the world key.

    A sealed value is ``_SEALED + HMAC(label, value) + value``; the label (the value's key
    in the store) is covered, so a value cannot be moved to another rank's slot.
    """

    def __init__(self, key: bytes) -> None:
        self._key = _derive(key, b"store")

    def seal(self, label: str, value: bytes) -> bytes:
        """``value`` with its seal, for the store key ``label``."""
        return _SEALED + self._tag(label, value) + value

    def open(self, label: str, sealed: bytes) -> bytes | None:
        """The value inside ``sealed`` if its seal is genuine for ``label``, else ``None``."""
        start = len(_SEALED) + TAG_BYTES
        if not sealed.startswith(_SEALED) or len(sealed) < start:
            return None
        value = sealed[start:]
        if not hmac.compare_digest(sealed[len(_SEALED):start], self._tag(label, value)):
            return None
        return value

    def _tag(self, label: str, value: bytes) -> bytes:
        return hmac.digest(self._key, label.encode() + b"\x00" + value, "sha256")


def is_sealed(value: bytes) -> bool:
    """Whether a store value was sealed (by a worker that holds a key)."""
    return value.startswith(_SEALED)


class ConnectionAuth:
    """Proofs of the key for transports that accept connections of their own.

    Each end sends a fresh challenge and answers the other's with :meth:`proof`; the
    proof also covers both ranks, both session nonces and a ``purpose`` naming the
    transport and the role, so a proof cannot be replayed in another session, in the
    other direction or on another transport.

    ``nonces``: every rank's session nonce (``None`` for a rank nobody holds). In a
    dynamic world, ``renew(rank)`` reads the nonce of the worker that holds ``rank`` now
    (from its sealed session record): :meth:`renew` calls it for a worker joining.
    """

    def __init__(self, key: bytes, nonces: Sequence[bytes | None],
                 renew: Callable[[int], bytes] | None = None) -> None:
        self._key = _derive(key, b"connection")
        self._nonces = {rank: nonce for rank, nonce in enumerate(nonces) if nonce is not None}
        self._renew = renew

    @staticmethod
    def challenge() -> bytes:
        """A fresh random challenge (``NONCE_BYTES`` long)."""
        return new_nonce()

    def renew(self, rank: int) -> None:
        """A connection from ``rank`` says a worker joins there (a dynamic world): take
        the nonce of its session record, which it published before it dialled. Raises
        ``RpcError`` naming the rank if there is none, or it is not sealed with the key;
        does nothing in a world of fixed size."""
        if self._renew is not None:
            self._nonces[rank] = self._renew(rank)

    def forget(self, rank: int) -> None:
        """The worker at ``rank`` left (a dynamic world): no proof for or from it
        passes until a worker joins there again (:meth:`renew`)."""
        self._nonces.pop(rank, None)

    def proof(self, purpose: str, src: int, dst: int, challenge: bytes = b"") -> bytes:
        """What rank ``src`` answers ``dst``'s ``challenge`` with (``TAG_BYTES`` long)."""
        return hmac.digest(self._key, b"\x00".join((
            purpose.encode(), _SEQ.pack(src), _SEQ.pack(dst),
            self._nonces[src], self._nonces[dst], challenge,
        )), "sha256")

    def check(self, purpose: str, src: int, dst: int, challenge: bytes, proof: bytes) -> bool:
        """Whether ``proof`` is rank ``src``'s genuine answer to ``challenge``."""
        if src not in self._nonces or dst not in self._nonces:
            return False
        return hmac.compare_digest(self.proof(purpose, src, dst, challenge), proof)


class FrameGuard:
    """Seals every frame a worker sends and checks every frame it receives.

    A sealed frame's header is ``number (8 bytes) + tag (32 bytes) + the codec's
    header``. The tag is HMAC-SHA256, under a key for the ordered pair (src, dst)
    derived from the world key and both session nonces, over the number, the header's
    length, the number and sizes of the buffers and the header itself; with
    ``payload=True`` also over every buffer's bytes (a pass over each tensor at both
    ends).

    The number is the frame's sequence number and its *floor*: every frame to the same
    peer numbered below the floor had its ``send`` return before this one was sealed,
    so the transport delivers it first (``Transport.send``'s order). A receiver refuses
    a frame numbered below the highest floor it has accepted from that source: it was
    held back and reordered in transit. Frames whose sends overlapped (two sending
    threads; a small call passing a bulk transfer) may arrive in either order, each
    number once.
    """

    def __init__(
        self,
        key: bytes,
        rank: int,
        nonces: Sequence[bytes | None],
        names: Sequence[str],
        *,
        payload: bool = False,
    ) -> None:
        """``nonces``: every rank's session nonce, ``None`` for a rank nobody holds yet
        (a dynamic world: :meth:`admit` keys it when a worker joins there)."""
        self.rank = rank
        self._names = list(names)
        self._payload = payload
        self._base = _derive(key, b"frame")
        own = nonces[rank]
        assert own is not None, "this worker's own nonce"
        self._nonce = own
        self._send_keys: list[bytes] = []
        self._receive_keys: list[bytes] = []
        self._next_seq: list[int] = []
        # Per destination: the numbers of frames being sent (their ``send`` has not
        # returned), in order, and which holder of the rank they were numbered for.
        self._in_flight: list[dict[int, None]] = []
        self._generation: list[int] = []
        # Sequence numbers seen, per source. Frames whose sends overlapped may arrive in
        # either order: each number is accepted once. A frame below its source's floor
        # (the highest floor accepted from it) is refused as reordered.
        self._windows: list[RecentIds] = []
        self._floors: list[int] = []
        self._order_lock = threading.Lock()
        self._refused: list[int] = []
        self._last_logged: list[float] = []
        self._refused_from: set[int] = set()  # sources whose connection is condemned
        self._seq_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._grow(len(nonces))
        for peer, nonce in enumerate(nonces):
            if nonce is not None:
                self._key_peer(peer, nonce)

    def _pair_key(self, src: int, dst: int, src_nonce: bytes, dst_nonce: bytes) -> bytes:
        return _derive(self._base, b"pair", _SEQ.pack(src), _SEQ.pack(dst), src_nonce,
                       dst_nonce)

    def _grow(self, size: int) -> None:
        """Room for ranks below ``size`` (unkeyed: every frame to or from them refused)."""
        more = size - len(self._send_keys)
        if more <= 0:
            return
        self._send_keys.extend([b""] * more)
        self._receive_keys.extend([b""] * more)
        self._next_seq.extend([0] * more)
        self._in_flight.extend({} for _ in range(more))
        self._generation.extend([0] * more)
        self._windows.extend(RecentIds() for _ in range(more))
        self._floors.extend([0] * more)
        self._refused.extend([0] * more)
        self._last_logged.extend([0.0] * more)
        self._names.extend("?" for _ in range(len(self._names), size))

    def _key_peer(self, peer: int, nonce: bytes) -> None:
        """Make the pair keys with the worker holding ``peer`` whose nonce is ``nonce``."""
        self._send_keys[peer] = self._pair_key(self.rank, peer, self._nonce, nonce)
        self._receive_keys[peer] = self._pair_key(peer, self.rank, nonce, self._nonce)

    def admit(self, peer: int, nonce: bytes) -> None:
        """A worker joins a dynamic world at ``peer``, with session nonce ``nonce``:
        frames to and from it are keyed from now on, numbered from the start. Whatever
        this guard knew of an earlier holder of the rank is dropped (its keys, its
        numbers, its refusal): nothing of it verifies any more."""
        with self._seq_lock, self._count_lock:
            self._admit_locked(peer, nonce)

    def forget(self, peer: int) -> None:
        """The worker at ``peer`` left a dynamic world: its keys go, and every frame to
        or from the rank is refused until a worker joins there (:meth:`admit`)."""
        with self._seq_lock, self._count_lock:
            if 0 <= peer < len(self._send_keys):
                self._forget_locked(peer)

    def _forget_locked(self, peer: int) -> None:
        self._send_keys[peer] = self._receive_keys[peer] = b""

    def named(self, peer: int, name: str) -> None:
        """The worker admitted at ``peer`` is ``name`` (for the log lines)."""
        self._names[peer] = name

    def _admit_locked(self, peer: int, nonce: bytes) -> None:
        self._grow(peer + 1)
        self._key_peer(peer, nonce)
        self._names[peer] = "?"
        self._next_seq[peer] = 0
        self._in_flight[peer] = {}
        self._generation[peer] += 1  # (sends to the earlier holder end unnoticed)
        self._windows[peer] = RecentIds()
        self._floors[peer] = 0
        self._refused[peer] = 0
        self._last_logged[peer] = 0.0
        self._refused_from.discard(peer)

    def close(self) -> None:
        """The world is over: let go of what is kept for sends (nothing, here)."""

    @property
    def refused(self) -> int:
        """Frames refused so far, from every source."""
        return sum(self._refused)

    # --------------------------------------------------------------------------- send

    def seal(self, dst: int, frame: Frame) -> Frame:
        """Seal ``frame`` for ``dst`` (its header is replaced by the sealed one) and
        return it, as a frame whose send is over at once (see :meth:`sealing`). (In
        place: this runs on every send, and a frame is sent once.)"""
        sealed, token = self.sealing(dst, frame)
        self.sent(dst, token)
        return sealed

    def sealing(self, dst: int, frame: Frame) -> tuple[Frame, tuple[int, int]]:
        """:meth:`seal`, for a send that is under way until :meth:`sent` is called with
        the token returned: frames sealed meanwhile may arrive before this one."""
        with self._seq_lock:  # (the number and the key together: admit changes both)
            number, token = self._number_locked(dst)
            keys = self._keys_locked(dst)
        return self._sealed_with(keys, number, frame), token

    def sent(self, dst: int, token: tuple[int, int]) -> None:
        """The send :meth:`sealing` numbered (``token``) returned: frames sealed from now
        on say it arrives before them."""
        generation, seq = token
        with self._seq_lock:
            if self._generation[dst] == generation:
                self._in_flight[dst].pop(seq, None)

    def _number_locked(self, dst: int) -> tuple[int, tuple[int, int]]:
        """The next number of a frame to ``dst`` (under ``_seq_lock``), and its token;
        the frame counts as being sent until :meth:`sent`."""
        seq = self._next_seq[dst] = self._next_seq[dst] + 1
        if seq > _SEQ_MAX:
            raise RpcError(f"{self._names[self.rank]}: {seq - 1} frames sent to rank {dst} "
                           "in one session, the most one session numbers; start anew")
        flying = self._in_flight[dst]
        floor = next(iter(flying)) if flying else seq  # (the oldest still being sent)
        flying[seq] = None
        return seq << _LAG_BITS | min(seq - floor, _LAG_NONE), (self._generation[dst], seq)

    def _keys_locked(self, dst: int) -> Any:
        """What seals a frame to ``dst`` (under ``_seq_lock``): its pair key."""
        return self._send_keys[dst]

    def _sealed_with(self, keys: Any, number: int, frame: Frame) -> Frame:
        return self._mac_sealed(keys, number, frame)

    def _mac_sealed(self, key: bytes, seq: int, frame: Frame) -> Frame:
        header = frame.header
        frame.header = _SEQ.pack(seq) + self._tag(key, seq, header, frame.buffers) + header
        return frame

    # ------------------------------------------------------------------------ receive

    def guarding(self, deliver: Callable[[int, Frame], None],
                 refuse: Callable[[int, str], None]) -> Callable[[int, Frame], None]:
        """A ``deliver`` for transports: checks each frame, passes genuine ones on.

        A frame that fails is dropped and counted, its source logged (at most once per
        ``_LOG_EVERY`` seconds each), ``refuse(src, detail)`` is called once per source
        (a protocol error), and :class:`~rpcx.errors.ProtocolError` is raised, so the
        transport ends that connection. Later frames from that source are refused too.
        """

        def checked(src: int, frame: Frame) -> None:
            problem = self._problem(src, frame)
            if problem is None:
                deliver(src, frame)
                return
            first = self._count(src, problem)
            detail = f"a frame failed authentication ({problem})"
            if first:
                refuse(src, detail)
            raise ProtocolError(f"a frame from rank {src} failed authentication ({problem})")

        return checked

    def _problem(self, src: int, frame: Frame) -> str | None:
        """Why ``frame`` from ``src`` is refused, or ``None`` if it is genuine (then its
        header is the codec's again: the seal is taken off)."""
        if src in self._refused_from:
            return "its connection already sent a frame that failed"
        if not 0 <= src < len(self._receive_keys) or not self._receive_keys[src]:
            return "no worker of this world holds that rank"
        header = frame.header
        if len(header) < _SEALED_PREFIX:
            return "missing MAC"
        (seq,) = _SEQ.unpack_from(header)
        tag = header[_SEQ.size:_SEALED_PREFIX]
        body = header[_SEALED_PREFIX:]
        if not hmac.compare_digest(tag, self._tag(self._receive_keys[src], seq, body,
                                                  frame.buffers)):
            return "bad or missing MAC"
        problem = self._accept_sequence(src, seq)
        if problem is None:
            frame.header = body
        return problem

    def _accept_sequence(self, src: int, number: int) -> str | None:
        """Take the sealed ``number`` of a frame from ``src`` (its sequence number and
        floor), or say why not: a number seen before (a replay), or one below the
        source's floor (a frame held back: sent before a frame that arrived first). Only
        once the frame is known genuine: a forged number must not move anything."""
        seq, lag = number >> _LAG_BITS, number & _LAG_NONE
        with self._order_lock:
            if not self._windows[src].add(seq):
                return f"sequence number {seq} replayed or out of range"
            if seq < self._floors[src]:
                return (f"frame {seq} arrived after frames sent after it (reordered or "
                        "held back in transit)")
            if lag != _LAG_NONE and seq - lag > self._floors[src]:
                self._floors[src] = seq - lag
        return None

    def _count(self, src: int, problem: str) -> bool:
        """Count a refused frame; log it if due. True for the source's first."""
        with self._count_lock:
            first = src not in self._refused_from
            self._refused_from.add(src)
            if not 0 <= src < len(self._refused):  # (no rank of this world: not counted)
                return first
            self._refused[src] += 1
            now = time.monotonic()
            due = now - self._last_logged[src] >= _LOG_EVERY
            if due:
                self._last_logged[src] = now
            count = self._refused[src]
        if due:
            name = self._names[src] if 0 <= src < len(self._names) else "?"
            log.warning("%s: refused a frame from %r (rank %d): %s; %d refused from it so far",
                        self._names[self.rank], name, src, problem, count)
        return first

    # ---------------------------------------------------------------------------- MAC

    def _tag(self, key: bytes, seq: int, header: bytes, buffers: list[torch.Tensor]) -> bytes:
        if not buffers and not self._payload:  # most calls: one C call, no list
            return hmac.digest(key, _FRAME_HEAD.pack(seq, len(header), 0) + header, "sha256")
        sizes = [b.numel() * b.element_size() for b in buffers]
        head = _FRAME_HEAD.pack(seq, len(header), len(sizes))
        if sizes:
            head += struct.pack(f"<{len(sizes)}Q", *sizes)
        if not self._payload:
            return hmac.digest(key, head + header, "sha256")
        mac = hmac.new(key, head, hashlib.sha256)
        mac.update(header)
        for buffer in buffers:
            if buffer.numel():
                _hash_bytes_of(mac, buffer)
        return mac.digest()


def _hash_bytes_of(mac: Any, tensor: torch.Tensor) -> None:
    """Feed a tensor's bytes to ``mac`` (through a host copy if it lives elsewhere)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().view(torch.uint8)
    # ``flat`` stays referenced until the update returns: the view borrows its memory.
    mac.update(memoryview((ctypes.c_char * flat.numel()).from_address(flat.data_ptr())))
