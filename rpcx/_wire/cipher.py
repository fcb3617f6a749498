"""Encryption with the world key: every byte of a frame private and authenticated.

:class:`FrameCipher` is a :class:`~rpcx._wire.auth.FrameGuard` that encrypts the frames
of the pairs it is told to (by default those between two hosts) with AES-256-GCM, and
seals the rest as the guard does. For an encrypted pair, each frame is::

    header:  seq (8 bytes, in clear) + AES-GCM(codec's header)          (+16 tag bytes)
    buffer i: AES-GCM(buffer i's bytes)                                  (+16 tag bytes)

(a part over ``PIECE_BYTES``, 1 GiB, goes in pieces, each with its own tag).

A large frame costs the cipher's own pass over its bytes and little else: the encrypted
copies of large buffers are kept and used again once the send is over
(:class:`~rpcx._util.memory.ReusedBuffers`), and a large buffer the transport received
into memory of its own (``Frame.owned``) is decrypted where it lies, a chunk at a time
through a small scratch buffer (``cryptography`` refuses to decrypt into the bytes it
reads).

Keys come from the world key, both workers' session nonces and an X25519 exchange
between the two (:class:`KeyExchange`: each worker draws a key pair at ``init_rpc`` and
publishes the public half, sealed), one per ordered pair (src, dst), so each direction
of each session has its own. A worker that did not hold the world key in this session
can neither read nor forge a frame. Recorded frames stay unreadable to anyone who holds
the world key but not the pair's private halves (another member listening, a past one,
whoever learns the key later): the halves never leave their processes and are dropped
once the pair keys are made. That is forward secrecy against listeners; a member who
can write to the store while the world forms could still put its own public key in
(the world key is what authenticates members, and a member can run code on any peer).

Each piece of a frame has its own nonce: the frame's sequence number and the piece's
index in the frame, so no nonce is used twice under one key. The associated data of
every piece is the frame's sequence number, the header's length, the number of buffers
and each buffer's size: a piece cannot be moved to another frame or another slot, and a
frame cannot gain or lose a buffer. A sequence number is taken into the guard's window
once the header decrypted, and refused if seen before. The cryptography is the
``cryptography`` package's (OpenSSL's AES-GCM); nothing here is a cipher of rpcx's own.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Sequence
from typing import Any

import torch

from rpcx._util.memory import ReusedBuffers, empty_bytes, memory_at
from rpcx._wire.auth import _SEQ, FrameGuard, _derive
from rpcx.errors import RpcError
from rpcx.transport import Frame

__all__ = ["ENCRYPT_ENV", "PUBLIC_BYTES", "FrameCipher", "KeyExchange", "aead_available",
           "encrypted_pairs", "pair_encrypted", "resolve_encrypt"]

ENCRYPT_ENV = "RPCX_ENCRYPT"
TAG = 16  # AES-GCM's tag, appended to each piece
_NONCE = struct.Struct("<IQ")  # piece index, sequence number: 12 bytes, AES-GCM's size
_HEAD = struct.Struct("<QQI")  # seq, plain header length, number of buffers
_INSTALL = "pip install 'torch-rpcx[encrypt]'"

# The ``cryptography`` package is optional (the ``encrypt`` extra): without it rpcx runs
# as before and only a world that asks for encryption fails, saying what to install.
_AESGCM: Any = None
_GCM_DECRYPTION: Any = None  # (key, nonce, tag) -> a streaming decryptor
_X25519: Any = None
_X25519_PUBLIC: Any = None
_InvalidTag: type[Exception] = Exception
try:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.asymmetric.x25519 import (
        X25519PrivateKey,
        X25519PublicKey,
    )
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
except ImportError:  # pragma: no cover - depends on the environment
    pass
else:
    if hasattr(AESGCM, "encrypt_into"):  # (cryptography 45 on: no copy of each tensor)
        _AESGCM, _InvalidTag = AESGCM, InvalidTag
        _X25519, _X25519_PUBLIC = X25519PrivateKey, X25519PublicKey

        def _GCM_DECRYPTION(key: bytes, nonce: bytes, tag: bytes) -> Any:
            return Cipher(algorithms.AES(key), modes.GCM(nonce, tag)).decryptor()

PUBLIC_BYTES = 32  # an X25519 public key, raw


_MODES = {"1": "hosts", "true": "hosts", "yes": "hosts", "on": "hosts", "hosts": "hosts",
          "always": "always", "0": None, "false": None, "no": None, "off": None, "": None}


def resolve_encrypt(options: Any, default: str | None = None) -> str | None:
    """Which pairs to encrypt: ``"hosts"`` (those on two hosts), ``"always"`` (every
    pair) or ``None``, from ``options.encrypt`` if set, else ``$RPCX_ENCRYPT``, else
    ``default`` (``"hosts"`` for a world keyed by certificates).

    ``True``, ``"1"``, ``"hosts"``: between hosts; ``"always"``: every pair, one host
    included; ``False``, ``"0"``, unset: none.
    """
    value = getattr(options, "encrypt", None)
    source = "encrypt option"
    if value is None:
        value = os.environ.get(ENCRYPT_ENV)
        source = ENCRYPT_ENV
    if value is None:
        return default
    if value is False:
        return None
    if value is True:
        return "hosts"
    mode = _MODES.get(str(value).strip().lower(), "?")
    if mode == "?":
        raise ValueError(f"the {source} is {value!r}; expected 1 (encrypt between hosts), "
                         "always (every pair, one host included) or 0")
    return mode


def aead_available() -> bool:
    """Whether the ``cryptography`` package (45 or newer: AES-GCM into given buffers)
    can be imported here."""
    return _AESGCM is not None


def encrypted_pairs(rank: int, hosts: Sequence[bytes], mode: str) -> list[bool]:
    """Which peers ``rank`` encrypts frames with: ``mode`` ``"hosts"`` those on another
    host (``hosts``: each rank's host identity), ``"always"`` every one."""
    return [pair_encrypted(mode, hosts[rank], host) for host in hosts]


def pair_encrypted(mode: str, here: bytes, there: bytes) -> bool:
    """Whether a worker on host ``here`` encrypts its frames with one on ``there``
    (``mode``: :func:`resolve_encrypt`'s answer)."""
    return mode == "always" or here != there


class KeyExchange:
    """This worker's X25519 key pair for one session: :attr:`public` is published
    (sealed), :meth:`shared` makes the secret it shares with each peer. Drop it once the
    pair keys are made: without the private half, recorded frames stay unreadable."""

    def __init__(self) -> None:
        if _X25519 is None:
            raise RpcError(f"encryption ({ENCRYPT_ENV}) needs the 'cryptography' package: "
                           f"{_INSTALL}")
        self._private = _X25519.generate()
        self.public: bytes = self._private.public_key().public_bytes_raw()

    def shared(self, public: bytes) -> bytes:
        """The secret this worker shares with the peer whose public key is ``public``."""
        peer = _X25519_PUBLIC.from_public_bytes(public)
        secret: bytes = self._private.exchange(peer)
        return secret


class FrameCipher(FrameGuard):
    """Encrypts and authenticates every byte of the frames to and from the peers
    ``encrypted[peer]`` names; seals the others as :class:`FrameGuard` does."""

    def __init__(
        self,
        key: bytes,
        rank: int,
        nonces: Sequence[bytes | None],
        names: Sequence[str],
        encrypted: Sequence[bool],
        shared: Sequence[bytes],
        *,
        payload: bool = False,
    ) -> None:
        """``encrypted[peer]``: whether frames to and from ``peer`` are encrypted;
        ``shared[peer]``: the secret of this worker's key exchange with it
        (:meth:`KeyExchange.shared`)."""
        if _AESGCM is None:
            raise RpcError(f"encryption ({ENCRYPT_ENV}) needs the 'cryptography' package: "
                           f"{_INSTALL}")
        # (before the guard's own start, which grows them with its per-rank tables)
        self.encrypted: list[bool] = []
        self._send_aead: list[Any] = []
        # Per peer: its frames' cipher and key (the key for decryption in place), one
        # record read once per frame: admit and forget replace it whole.
        self._receive_ciphers: list[tuple[Any, bytes] | None] = []
        # Encrypted copies of large buffers, used again once their send is over.
        self.send_buffers = ReusedBuffers()
        self.decrypted_in_place = 0  # buffers (for tests and debugging)
        super().__init__(key, rank, nonces, names, payload=payload)
        for peer, on in enumerate(encrypted):
            if on:
                self._encrypt_with(peer, shared[peer])

    def _grow(self, size: int) -> None:
        more = size - len(self.encrypted)
        super()._grow(size)
        if more > 0:
            self.encrypted.extend([False] * more)
            self._send_aead.extend([None] * more)
            self._receive_ciphers.extend([None] * more)

    def _encrypt_with(self, peer: int, shared: bytes | None) -> None:
        """Encrypt the frames to and from ``peer`` with keys made from the pair's keys and
        ``shared`` (the secret of the key exchange with it); ``None``: only seal them."""
        self.encrypted[peer] = shared is not None
        if shared is None:
            self._send_aead[peer] = self._receive_ciphers[peer] = None
            return
        self._send_aead[peer] = _AESGCM(_derive(self._send_keys[peer], b"cipher", shared))
        receive_key = _derive(self._receive_keys[peer], b"cipher", shared)
        self._receive_ciphers[peer] = (_AESGCM(receive_key), receive_key)

    def _forget_locked(self, peer: int) -> None:
        super()._forget_locked(peer)
        self._encrypt_with(peer, None)

    def admit(self, peer: int, nonce: bytes, *, shared: bytes | None = None) -> None:
        """As :meth:`FrameGuard.admit`; ``shared``: the secret of the key exchange with
        the newcomer when the pair encrypts (``None``: it only seals)."""
        with self._seq_lock, self._count_lock:
            self._admit_locked(peer, nonce)
            self._encrypt_with(peer, shared)

    def close(self) -> None:
        """Let go of the kept send buffers (up to 256 MiB)."""
        self.send_buffers.clear()

    # --------------------------------------------------------------------------- send

    def _keys_locked(self, dst: int) -> Any:
        # (taken with the number: a worker joining at ``dst`` changes both (admit), and
        # a number must never be used twice under one key: AES-GCM's nonce)
        return self._send_aead[dst], self._send_keys[dst]

    def _sealed_with(self, keys: Any, seq: int, frame: Frame) -> Frame:
        """Encrypt ``frame`` in place (header and buffers replaced) under the pair's
        cipher and frame number ``seq``, or seal it if the pair is not encrypted."""
        aead, key = keys
        if aead is None:
            return self._mac_sealed(key, seq, frame)
        header = frame.header
        if not frame.buffers and len(header) <= PIECE_BYTES:  # most calls: one AES-GCM call
            frame.header = _SEQ.pack(seq) + aead.encrypt(
                _NONCE.pack(0, seq), header, _HEAD.pack(seq, len(header), 0))
            return frame
        sizes = [b.numel() * b.element_size() for b in frame.buffers]
        extra = _extra(seq, len(header), sizes)
        parts = _Parts(aead, seq, extra)
        frame.header = _SEQ.pack(seq) + parts.encrypt_header(header)
        sealed = []
        for buffer, size in zip(frame.buffers, sizes, strict=True):
            flat = _flat_bytes(buffer)  # (held until encrypted: the views borrow it)
            # Storage of exactly this size (a transport may send a view's whole storage),
            # used again once nothing holds it: after the send, or the receiver in this
            # process, is done with it.
            out = self.send_buffers.take(sealed_size(size))
            parts.encrypt(_view(flat, size), _view(out, out.numel()))
            sealed.append(out)
        frame.buffers = sealed
        # Every buffer is now a copy made here, which nothing changes while anyone holds
        # it: transports need not copy them again.
        frame.owned = frozenset(range(len(sealed)))
        return frame

    # ------------------------------------------------------------------------ receive

    def _problem(self, src: int, frame: Frame) -> str | None:
        ciphers = self._receive_ciphers[src] if 0 <= src < len(self._receive_ciphers) else None
        if ciphers is None:
            return super()._problem(src, frame)
        if src in self._refused_from:
            return "its connection already sent a frame that failed"
        aead, cipher_key = ciphers
        header = memoryview(frame.header)
        header_size = plain_size(len(header) - _SEQ.size)
        if header_size is None:
            return "not an encrypted frame (too short)"
        if not frame.buffers and header_size <= PIECE_BYTES:  # most calls (as seal does)
            (seq,) = _SEQ.unpack_from(header)
            try:
                plain = aead.decrypt(_NONCE.pack(0, seq), bytes(header[_SEQ.size:]),
                                     _HEAD.pack(seq, header_size, 0))
            except _InvalidTag:
                return "the header did not decrypt (wrong key, not encrypted, or altered)"
            problem = self._accept_sequence(src, seq)
            if problem is None:
                frame.header = plain
            return problem
        sizes = [plain_size(b.numel() * b.element_size()) for b in frame.buffers]
        if None in sizes:
            return "not an encrypted frame (a buffer shorter than its tag)"
        known = [size for size in sizes if size is not None]  # (all of them)
        (seq,) = _SEQ.unpack_from(header)
        parts = _Parts(aead, seq, _extra(seq, header_size, known), cipher_key)
        try:
            plain = parts.decrypt_header(header[_SEQ.size:], header_size)
        except _InvalidTag:
            return "the header did not decrypt (wrong key, not encrypted, or altered)"
        # The number goes into the window as soon as the header proves the frame is the
        # peer's: a large frame's buffers take a while to decrypt, and frames delivered
        # meanwhile on another thread must not push its number below the window. (A
        # genuine header with a forged buffer so uses its number up: harmless, as the
        # refusal below ends everything from that source.)
        problem = self._accept_sequence(src, seq)
        if problem is not None:
            return problem
        opened = []
        for index, (buffer, size) in enumerate(zip(frame.buffers, known, strict=True)):
            flat = _flat_bytes(buffer)
            try:
                if size >= IN_PLACE_MIN and index in frame.owned:
                    # (the transport's own memory: no second buffer to fault in)
                    parts.decrypt_in_place(_view(flat, sealed_size(size)), size)
                    out = flat[:size]
                    self.decrypted_in_place += 1
                else:
                    out = empty_bytes(size)
                    parts.decrypt(_view(flat, sealed_size(size)), _view(out, size), size)
            except _InvalidTag:
                return f"buffer {index} did not decrypt (altered in transit)"
            opened.append(out)
        frame.header = plain
        frame.buffers = opened
        frame.owned = frozenset()
        return None


IN_PLACE_MIN = 4 << 20
"""A received buffer this large, in memory the transport allocated for the frame alone,
is decrypted in place; a smaller one into a new buffer (the allocator reuses those)."""
_CHUNK = 256 << 10  # decrypted in place through a scratch buffer of this size (cached)
_scratch = threading.local()

PIECE_BYTES = 1 << 30
"""The most one AES-GCM call encrypts: ``cryptography`` takes at most 2**31 - 1 bytes a
call, so a larger header or buffer is encrypted in pieces, each with its own tag."""


def _pieces(size: int) -> int:
    return max(1, -(-size // PIECE_BYTES))


def sealed_size(size: int) -> int:
    """How many bytes ``size`` bytes take encrypted: a tag per piece."""
    return size + TAG * _pieces(size)


def plain_size(sealed: int) -> int | None:
    """The plain size of ``sealed`` encrypted bytes, or ``None`` if no plain size
    encrypts to that many."""
    if sealed < TAG:
        return None
    size = sealed - TAG * -(-sealed // (PIECE_BYTES + TAG))
    return size if size >= 0 and sealed_size(size) == sealed else None


class _Parts:
    """The parts of one frame, in order (header, then each buffer), each in pieces of
    at most ``PIECE_BYTES``: piece ``n`` of the frame is sealed under the nonce
    (``n``, the frame's sequence number), so no nonce repeats under the pair's key."""

    __slots__ = ("_aead", "_extra", "_key", "_next", "_seq")

    def __init__(self, aead: Any, seq: int, extra: bytes, key: bytes = b"") -> None:
        """``key``: the cipher's key, which :meth:`decrypt_in_place` needs."""
        self._aead, self._seq, self._extra, self._next = aead, seq, extra, 0
        self._key = key

    def _nonce(self) -> bytes:
        nonce = _NONCE.pack(self._next, self._seq)
        self._next += 1
        return nonce

    def encrypt_header(self, header: bytes) -> bytes:
        if len(header) <= PIECE_BYTES:  # (every header but a pathological one)
            sealed: bytes = self._aead.encrypt(self._nonce(), header, self._extra)
            return sealed
        out = bytearray(sealed_size(len(header)))
        self.encrypt(memoryview(header), memoryview(out))
        return bytes(out)

    def decrypt_header(self, sealed: memoryview, size: int) -> bytes:
        if size <= PIECE_BYTES:
            plain: bytes = self._aead.decrypt(self._nonce(), bytes(sealed), self._extra)
            return plain
        out = bytearray(size)
        self.decrypt(sealed, memoryview(out), size)
        return bytes(out)

    def encrypt(self, plain: Any, out: Any) -> None:
        """``plain`` into ``out`` (``sealed_size(len(plain))`` bytes), piece by piece."""
        size = len(plain)
        for piece in range(_pieces(size)):
            start = piece * PIECE_BYTES
            end = min(size, start + PIECE_BYTES)
            self._aead.encrypt_into(self._nonce(), plain[start:end], self._extra,
                                    out[start + piece * TAG : end + (piece + 1) * TAG])

    def decrypt(self, sealed: Any, out: Any, size: int) -> None:
        """``sealed`` into ``out`` (``size`` bytes); ``InvalidTag`` if any piece fails."""
        for piece in range(_pieces(size)):
            start = piece * PIECE_BYTES
            end = min(size, start + PIECE_BYTES)
            self._aead.decrypt_into(self._nonce(), sealed[start + piece * TAG :
                                                          end + (piece + 1) * TAG],
                                    self._extra, out[start:end])

    def decrypt_in_place(self, sealed: Any, size: int) -> None:
        """``sealed`` (``sealed_size(size)`` writable bytes) decrypted into its own first
        ``size`` bytes; ``InvalidTag`` if any piece fails (the bytes are then garbage).

        Each piece streams through AES-GCM a chunk at a time into a scratch buffer and is
        copied back: plain bytes land at or before the ciphertext still to be read, which
        the writes never reach. Nothing is believed before the piece's tag checks out:
        the frame is refused then, bytes and all.
        """
        scratch = getattr(_scratch, "view", None)
        if scratch is None or len(scratch) < _CHUNK + 16:
            # (one per thread; a block more than a chunk, as the API asks of a buffer)
            scratch = _scratch.view = memoryview(bytearray(_CHUNK + 16))
        for piece in range(_pieces(size)):
            start = piece * PIECE_BYTES
            length = min(size, start + PIECE_BYTES) - start
            read = start + piece * TAG  # (each earlier piece's tag shifts this one)
            tag = bytes(sealed[read + length : read + length + TAG])  # (before it is overwritten)
            decryptor = _GCM_DECRYPTION(self._key, self._nonce(), tag)
            decryptor.authenticate_additional_data(self._extra)
            written = start
            for offset in range(0, length, _CHUNK):
                end = min(length, offset + _CHUNK)
                count = decryptor.update_into(sealed[read + offset : read + end], scratch)
                sealed[written : written + count] = scratch[:count]
                written += count
            rest = decryptor.finalize()  # (GCM holds nothing back: b"")
            sealed[written : written + len(rest)] = rest


def _extra(seq: int, header_length: int, sizes: list[int]) -> bytes:
    """The associated data of each part of a frame: what binds the parts together."""
    head = _HEAD.pack(seq, header_length, len(sizes))
    return head + struct.pack(f"<{len(sizes)}Q", *sizes) if sizes else head


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat ``uint8`` CPU tensor (a host copy if it lives elsewhere)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.contiguous().view(torch.uint8)


def _view(tensor: torch.Tensor, nbytes: int) -> Any:
    """A writable view of a CPU tensor's first ``nbytes`` (keep the tensor meanwhile)."""
    return memory_at(tensor.data_ptr(), nbytes) if nbytes else bytearray()
