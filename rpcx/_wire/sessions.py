"""Session records of a keyed world: what each worker publishes, sealed, at ``init_rpc``,
and what the frame guard and the connection proofs are made from.

Every worker of a world with a key draws a fresh *session record*: a random nonce, its
host (hashed, for ``RPCX_ENCRYPT=1``, which encrypts between hosts only), whether and
where it encrypts, and with encryption the public half of an X25519 key pair
(:class:`~rpcx._wire.cipher.KeyExchange`). The records are sealed with the world key in
the rendezvous store. :class:`Sessions` reads the peers' records, checks that every
worker runs with the same settings, and makes this worker's
:class:`~rpcx._wire.auth.FrameGuard` (or :class:`~rpcx._wire.cipher.FrameCipher`) and
:class:`~rpcx._wire.auth.ConnectionAuth` from them.

A world of fixed size exchanges the records once and then drops the private half: no
later key can be made, and recorded frames stay unreadable to anyone who lacks it. A
dynamic world keeps it for the worker's life: each worker that joins later publishes a
record before it connects, and every member reads it when the newcomer's connection
arrives (:meth:`Sessions.renew`) and keys the new pair (:meth:`Sessions.admit`). Keys
are per pair and per session, so a join or a departure changes exactly the keys of the
pairs it concerns: a worker that left holds no key of any pair that follows, and one
that takes its rank again starts a new session with new keys.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from rpcx._wire import cipher
from rpcx._wire.auth import NONCE_BYTES, ConnectionAuth, FrameGuard, new_nonce
from rpcx.errors import RpcError
from rpcx.hosts import host_identity

__all__ = ["MODES", "SessionRecord", "Sessions", "host_digest"]

HOST_BYTES = 16  # each worker's host, hashed, beside its session nonce

MODES = {None: 0, "hosts": 1, "always": 2}
"""A record's mode byte, by :func:`~rpcx._wire.cipher.resolve_encrypt`'s answer."""
_MODE_NAMES = {0: "does not encrypt", 1: f"encrypts between hosts ({cipher.ENCRYPT_ENV}=1)",
               2: f"encrypts every pair ({cipher.ENCRYPT_ENV}=always)"}


@dataclass(frozen=True)
class SessionRecord:
    """What each worker of a keyed world publishes, sealed, at ``init_rpc``."""

    nonce: bytes  # NONCE_BYTES
    host: bytes  # HOST_BYTES: rpcx.hosts.host_identity, hashed
    mode: int  # MODES: whether and where this worker encrypts
    public: bytes  # its X25519 public key when it encrypts, else empty

    # A record starts with _MAGIC (one of an older rpcx, which started with its nonce, is
    # told apart), then the nonce, the host and the mode byte.
    _MAGIC: ClassVar[bytes] = b"rsr1"
    _FIXED: ClassVar[int] = len(_MAGIC) + NONCE_BYTES + HOST_BYTES + 1

    def to_bytes(self) -> bytes:
        """The record as published (before the seal)."""
        return self._MAGIC + self.nonce + self.host + bytes([self.mode]) + self.public

    @classmethod
    def read(cls, value: bytes, peer: str, me: str, mode: int) -> SessionRecord:
        """The record of ``peer`` (e.g. "rank 2 ('w2')"), published as ``value``;
        ``RpcError`` naming it if its settings differ from this worker's (``mode``) or
        it is no record this version writes. ``me``: the start of the error's text."""
        if (len(value) < cls._FIXED or not value.startswith(cls._MAGIC)
                or value[cls._FIXED - 1] not in _MODE_NAMES):
            raise RpcError(f"{me}: {peer} published a session record this version of rpcx "
                           f"cannot read ({len(value)} bytes): run the same rpcx on every "
                           "worker")
        theirs = value[cls._FIXED - 1]
        if theirs != mode:
            raise RpcError(f"{me}: this worker {_MODE_NAMES[mode]} and {peer} "
                           f"{_MODE_NAMES[theirs]}: set {cipher.ENCRYPT_ENV} (or the encrypt "
                           "option) the same on every worker")
        public = value[cls._FIXED:]
        if len(public) != (cipher.PUBLIC_BYTES if mode else 0):
            raise RpcError(f"{me}: {peer} published a public key of {len(public)} bytes")
        start = len(cls._MAGIC)
        return cls(value[start:start + NONCE_BYTES],
                   value[start + NONCE_BYTES:cls._FIXED - 1], theirs, public)


def host_digest() -> bytes:
    """This worker's host, hashed, for the pairs ``RPCX_ENCRYPT=1`` encrypts. Where a part
    of the host's identity cannot be read (no boot id, no mount namespace: not Linux, a
    restricted ``/proc``), a random one: this worker then counts as a host of its own,
    and encrypts with everyone, rather than trusting a hostname another machine may share."""
    identity = host_identity()
    if any(not part for part in identity.split("|")):
        return os.urandom(HOST_BYTES)
    return hashlib.sha256(identity.encode()).digest()[:HOST_BYTES]


class Sessions:
    """This worker's session in a keyed world, and its peers' as their records say.

    Args:
        key: the world key.
        rank: this worker's rank; ``me``: how errors start ("init_rpc: worker 'w' (rank
            0)").
        encrypt: :func:`~rpcx._wire.cipher.resolve_encrypt`'s answer: which pairs
            encrypt (``None``: none; the frames are sealed).
        payload: ``auth_payload``: the seals also cover the tensors' bytes.
    """

    def __init__(self, key: bytes, rank: int, me: str, encrypt: str | None,
                 payload: bool = False) -> None:
        self._key = key
        self.rank = rank
        self._me = me
        self._encrypt = encrypt
        self._payload = payload
        self._exchange = cipher.KeyExchange() if encrypt is not None else None
        self.mine = SessionRecord(new_nonce(), host_digest(), MODES[encrypt],
                                  self._exchange.public if self._exchange else b"")
        self._records: dict[int, SessionRecord] = {rank: self.mine}
        self._fetch: Callable[[int], bytes] | None = None
        self._renewed: set[int] = set()  # ranks whose record a connection just read
        self.guard: FrameGuard | None = None
        self.connections: ConnectionAuth | None = None

    def read(self, peer: int, value: bytes, name: str | None = None) -> SessionRecord:
        """Take ``value`` (its seal already checked) as the session record of ``peer``
        (named ``name``, if known); ``RpcError`` naming it if its settings differ."""
        who = f"rank {peer}" + (f" ({name!r})" if name else "")
        record = SessionRecord.read(value, who, self._me, self.mine.mode)
        self._records[peer] = record
        return record

    def start(self, names: Sequence[str],
              fetch: Callable[[int], bytes] | None = None) -> tuple[FrameGuard, ConnectionAuth]:
        """The frame guard and the connection proofs for the records read so far (``names``:
        every rank's worker, by rank; ranks without a record are keyed when a worker
        joins there).

        ``fetch(rank)``: in a dynamic world, the (opened) record of the worker that holds
        ``rank`` now, read from the store; the private half of the key exchange is then
        kept to key the newcomers. Without it (a world of fixed size) the private half
        is dropped here."""
        nonces = [self._records[r].nonce if r in self._records else None
                  for r in range(len(names))]
        guard: FrameGuard
        if self._exchange is None or self._encrypt is None:
            guard = FrameGuard(self._key, self.rank, nonces, names, payload=self._payload)
        else:
            shared: list[bytes | None] = [self._shared(peer) for peer in range(len(names))]
            guard = cipher.FrameCipher(
                self._key, self.rank, nonces, names,
                [secret is not None for secret in shared],
                [secret or b"" for secret in shared], payload=self._payload)
            del shared
        self._fetch = fetch
        if fetch is None:
            self._exchange = None  # (recorded frames stay unreadable without it)
        self.guard = guard
        self.connections = ConnectionAuth(
            self._key, nonces, renew=None if fetch is None else self.renew)
        return guard, self.connections

    def renew(self, rank: int) -> bytes:
        """Read again the record of the worker holding ``rank`` (a dynamic world: one
        joins there); its nonce."""
        assert self._fetch is not None, "only a dynamic world's workers join later"
        nonce = self.read(rank, self._fetch(rank)).nonce
        self._renewed.add(rank)
        return nonce

    def admit(self, rank: int) -> None:
        """A worker joins a dynamic world at ``rank``: key the pair with it, from the
        record its connection proved itself with (:meth:`renew`), or read now where the
        transport checks no connection of its own. ``RpcError`` naming it if there is
        none, or it differs in its settings."""
        assert self.guard is not None, "start() came first"
        if rank in self._renewed:  # (the record its connection proved itself with)
            self._renewed.discard(rank)
        else:
            self.renew(rank)
            self._renewed.discard(rank)
        if isinstance(self.guard, cipher.FrameCipher):
            self.guard.admit(rank, self._records[rank].nonce, shared=self._shared(rank))
        else:
            self.guard.admit(rank, self._records[rank].nonce)

    def _shared(self, peer: int) -> bytes | None:
        """The secret shared with ``peer`` when the pair encrypts, else ``None``."""
        record = self._records.get(peer)
        if self._exchange is None or self._encrypt is None or record is None:
            return None
        if not cipher.pair_encrypted(self._encrypt, self.mine.host, record.host):
            return None
        unusable = None
        try:
            return self._exchange.shared(record.public)
        except ValueError as exc:  # (a degenerate public key)
            unusable = str(exc)
        # (raised out here: the error's traceback would hold the exchange, private half
        # and all)
        raise RpcError(f"{self._me}: rank {peer} published an unusable public key "
                       f"({unusable})")
