"""The store's values that steer a keyed world, sealed: barriers, process marks, and
every value a transport publishes (its addresses).

With a world key, the store view a worker joins with carries the key's
:class:`~rpcx._wire.auth.ValueSeal` (:meth:`BoundedStore.with_seal
<rpcx._world.store.BoundedStore.with_seal>`). Each value published through
:func:`publish` or a :class:`SealedStore` is sealed under its full key, so it cannot be
moved to another key or another session; :func:`read` and :class:`SealedStore` open
what they read. A value that is not genuine (a stray store client's, or one written
without the key) is ignored and named in a log line, once per key, and the reader waits
for the genuine one, which the worker that owns the key writes over it.

Counters (``add``) cannot be sealed: a claim of a rank, the session counter and the
membership token stay as they are, and a client that can write to the store can still
stop a world from forming by changing them or deleting keys (docs/security.md).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torch._C._distributed_c10d import Store

from rpcx._wire.auth import ValueSeal
from rpcx.errors import AuthenticationError

if TYPE_CHECKING:
    from rpcx._world.store import BoundedStore

__all__ = ["SealedStore", "publish", "read"]

log = logging.getLogger("rpcx.rendezvous")

_POLL_FIRST, _POLL_MAX = 0.005, 0.2  # seconds between looks at a key holding a forged value
_REPORT_EVERY = 30.0
_warned: set[str] = set()  # keys whose forged value was logged (once per key per process)
_warned_lock = threading.Lock()


def note_forged(label: str) -> None:
    """Log, once per key, that the store's value of ``label`` is not genuine."""
    with _warned_lock:
        if label in _warned:
            return
        _warned.add(label)
    log.warning("ignored the value of %r in the rendezvous store: it is not sealed with "
                "this world's key (a store client without the key wrote it); waiting for "
                "the genuine one", label)


def publish(store: BoundedStore, key: str, value: bytes | str,
            timeout: float | None = None, *, label: str | None = None) -> None:
    """Set ``key`` to ``value`` in ``store``, sealed if the store view carries a seal
    (under ``label``, by default the key's full name)."""
    raw = value.encode() if isinstance(value, str) else value
    if store.seal is not None:
        raw = store.seal.seal(label or store.label(key), raw)
    store.set(key, raw, timeout)


def read(store: BoundedStore, keys: list[str], timeout: float | None = None, *,
         labels: list[str] | None = None) -> list[bytes | None]:
    """The values of ``keys`` (which must exist), opened if the store view carries a
    seal (under ``labels``, by default the keys' full names): ``None`` for one that is
    not genuine (logged once per key)."""
    values = store.multi_get(keys, timeout)
    if store.seal is None:
        return list(values)
    opened: list[bytes | None] = []
    for index, (key, value) in enumerate(zip(keys, values, strict=True)):
        label = labels[index] if labels is not None else store.label(key)
        genuine = store.seal.open(label, value)
        if genuine is None:
            note_forged(label)
        opened.append(genuine)
    return opened


class SealedStore(Store):
    """A torch store whose values are sealed with the world key: what a transport (and
    the process group or agent it hands the store to) writes is sealed, what it reads is
    opened, under ``label`` (the full prefix of the store's keys) plus the key.

    A value that is not genuine is ignored (logged once per key) and :meth:`get` waits
    for the genuine one, at most ``bound`` seconds (``None``: for good, with a log line
    every 30 s), then raises :class:`~rpcx.errors.AuthenticationError` naming the key.
    Counters pass through unsealed; ``compare_set`` seals both values (a seal is a
    deterministic function of the key and the value).
    """

    def __init__(self, inner: Any, seal: ValueSeal, label: str, bound: float | None) -> None:
        super().__init__()
        self.inner = inner
        self._seal = seal
        self._label = label
        self._bound = bound

    # -------------------------------------------------------------- sealed values

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, self._sealed(key, value))

    def get(self, key: str) -> bytes:
        return self._genuine(key, bytes(self.inner.get(key)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        # (one store operation for them all, as the transports expect: only a key whose
        # value is not genuine is looked at again, alone)
        return [self._genuine(key, bytes(value))
                for key, value in zip(keys, self.inner.multi_get(keys), strict=True)]

    def _genuine(self, key: str, value: bytes) -> bytes:
        """``value``, just read from ``key``, opened; a forged one is waited past."""
        started = report_at = time.monotonic()
        pause = _POLL_FIRST
        while True:
            genuine = self._seal.open(self._label + key, value)
            if genuine is not None:
                return genuine
            note_forged(self._label + key)
            now = time.monotonic()
            if self._bound is not None and now - started >= self._bound:
                raise AuthenticationError(
                    f"the rendezvous store's value of {self._label + key!r} is not sealed "
                    f"with this world's key, and no genuine one replaced it within "
                    f"{self._bound:g} s: a store client without the key wrote it")
            if now - report_at >= _REPORT_EVERY:
                report_at = now
                log.info("still waiting for a genuine value of %r after %.0f s",
                         self._label + key, now - started)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)
            value = bytes(self.inner.get(key))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.inner.multi_set(keys, [self._sealed(k, v) for k, v in zip(keys, values,
                                                                         strict=True)])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        was = self._sealed(key, expected) if _as_bytes(expected) else b""
        want = self._sealed(key, desired)
        found = bytes(self.inner.compare_set(key, was, want))
        genuine = self._seal.open(self._label + key, found)
        if genuine == b"" and not was and found != want:
            # (set to "" through this view: the value is a sealed "", which counts as
            # no value for a compare_set that expects none, as in torch's token pattern)
            found = bytes(self.inner.compare_set(key, found, want))
            genuine = self._seal.open(self._label + key, found)
        if genuine is not None:
            return genuine
        note_forged(self._label + key)
        if was:  # (a forged value is no value the caller expects)
            return found
        # Expected absent: a forged value counts as absent, and is replaced.
        replaced = bytes(self.inner.compare_set(key, found, want))
        opened = self._seal.open(self._label + key, replaced)
        return opened if opened is not None else replaced

    # ---------------------------------------------------------- passed through

    def add(self, key: str, amount: int) -> int:
        return int(self.inner.add(key, amount))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        found: timedelta = self.inner.timeout
        return found

    def clone(self) -> SealedStore:
        """The same view over a connection of its own (where the inner store has one)."""
        return SealedStore(self.inner.clone(), self._seal, self._label, self._bound)

    def _sealed(self, key: str, value: Any) -> bytes:
        return self._seal.seal(self._label + key, _as_bytes(value))


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
