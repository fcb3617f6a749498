"""A dynamic world's bookkeeping in the rendezvous store (``init_rpc`` without ``world_size``).

Workers of a dynamic world join and leave one at a time, as in torch: each takes the
world's *membership token* (a key set with ``compare_set``, so only one worker holds it),
reads who is in the world, enters itself, connects to every member, and gives the token
back. Leaving takes the token too, so that no worker joins while another leaves.

The store also records which kind of world it serves: a worker that joins a static world
(``world_size`` given) dynamically, or the reverse, is refused with torch's message.

Keys, under ``rpcx/dynamic/`` of the store:

* ``token``: who holds the token (``name:purpose:rank:nonce``; empty: free);
* ``member/<rank>``: the name of the worker holding ``rank`` (empty once it left);
* ``roster``: every rank held now, as JSON (``{"rank": "name"}``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Iterator

from rpcx._store import BoundedStore
from rpcx.errors import RpcError, RpcTimeoutError

__all__ = ["KIND_KEY", "MIXED_WORLDS", "DynamicWorld", "HeldToken", "claim_kind"]

log = logging.getLogger("rpcx.rendezvous")

KIND_KEY = "rpcx/kind"
MIXED_WORLDS = ("RPC group mixes statically and dynamically initialized members which is "
                "not supported.")
_POLL_FIRST, _POLL_MAX = 0.002, 0.1  # seconds between looks at a token held by another
_REPORT_EVERY = 30.0


def claim_kind(store: BoundedStore, kind: str, who: str, timeout: float | None) -> None:
    """Record that the world on ``store`` is ``"static"`` or ``"dynamic"``; raise
    ``RuntimeError`` (torch's wording) if it already is the other kind."""
    found = store.compare_set(KIND_KEY, "", kind, timeout).decode()
    if found != kind:
        raise RuntimeError(
            f"{MIXED_WORLDS} Worker {who} asked to join a {kind} world (world_size "
            f"{'given' if kind == 'static' else 'not given'}), but the workers on this "
            f"rendezvous store started a {found} one.")


class DynamicWorld:
    """The store's record of one dynamic world, as worker ``name`` (rank ``rank``) sees it.

    ``store`` is the rendezvous store (the keys live under ``rpcx/dynamic/``); waits are
    bounded by ``timeout`` seconds (``None``: no bound, with a progress line every 30 s).
    """

    def __init__(self, store: BoundedStore, name: str, rank: int,
                 timeout: float | None) -> None:
        self.store = store.prefixed("rpcx/dynamic")
        self.name = name
        self.rank = rank
        self.timeout = timeout
        self._held: HeldToken | None = None  # the token this worker holds now, if any

    # ------------------------------------------------------------------ the token

    @contextlib.contextmanager
    def token(self, purpose: str, timeout: float | None = None) -> Iterator[None]:
        """Hold the membership token for ``purpose`` ("join", "leave"): no other worker
        joins or leaves meanwhile. ``RpcTimeoutError`` naming the holder if it is not
        free within ``timeout`` (default: the world's; its holder may be stopped)."""
        # Unique to this attempt: two workers that give the same name cannot both
        # believe they hold it.
        me = f"{self.name}:{purpose}:{self.rank}:{uuid.uuid4().hex[:8]}"
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        started = report_at = time.monotonic()
        pause = _POLL_FIRST
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            holder = self.store.compare_set("token", "", me, left).decode()
            if holder in ("", me):
                break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                holder_name, holder_purpose = holder.split(":")[:2]
                raise RpcTimeoutError(
                    f"worker {self.name!r} (rank {self.rank}) could not {purpose} the "
                    f"dynamic world within {timeout:g} s: worker {holder_name!r} holds its "
                    f"membership token (to {holder_purpose}) all that time; it may be "
                    "stopped in the middle of joining or leaving, or still connecting")
            if now >= report_at + _REPORT_EVERY:
                report_at = now
                log.info("%s: waiting %.0f s for the membership token (held by %s)",
                         self.name, now - started, holder)
            time.sleep(pause)  # (a store has no wait for a value to change)
            pause = min(pause * 2, _POLL_MAX)
        try:
            yield
        finally:
            try:
                self.store.compare_set("token", me, "", self.timeout)
            except RpcError as exc:  # the store is gone: nobody is left to wait for it
                log.debug("%s: giving the membership token back: %s", self.name, exc)

    def hold_token(self, purpose: str, timeout: float | None = None) -> HeldToken:
        """Take the token for ``purpose`` and keep it until :meth:`HeldToken.release`
        (what joining needs: it spans the agent's start)."""
        self._held = HeldToken(self.token(purpose, timeout))
        return self._held

    # ------------------------------------------------------------------ the roster

    def roster(self) -> dict[int, str]:
        """Every rank held now, and its worker's name (read under the token)."""
        if not self.store.check(["roster"], self.timeout):
            return {}
        return {int(rank): name for rank, name in
                json.loads(self.store.get("roster", self.timeout)).items()}

    def enter(self, roster: dict[int, str]) -> None:
        """Enter this worker in ``roster`` (the one just read, under the token).

        Raises ``RpcError`` if its rank or its name is taken."""
        if self.rank in roster:
            raise RpcError(
                f"init_rpc: worker {self.name!r} cannot take rank {self.rank} of the dynamic "
                f"world: worker {roster[self.rank]!r} holds it")
        for rank, name in roster.items():
            if name == self.name:
                raise RpcError(
                    f"init_rpc: worker name {self.name!r} is taken in the dynamic world (by "
                    f"rank {rank}); names must be unique")
        self.store.set(f"member/{self.rank}", self.name, self.timeout)
        self.store.set("roster", json.dumps({**roster, self.rank: self.name}), self.timeout)

    def leave(self) -> None:
        """Strike this worker off the roster (under the token)."""
        roster = self.roster()
        if roster.get(self.rank) == self.name:
            del roster[self.rank]
            self.store.set("roster", json.dumps(roster), self.timeout)
        self.store.set(f"member/{self.rank}", "", self.timeout)

    @contextlib.contextmanager
    def departing(self, timeout: float | None = None) -> Iterator[None]:
        """This worker leaves: off the roster under the token (waited for at most
        ``timeout``), which is held until the block ends (the worker closes its
        connections meanwhile). A token or store that does not answer is logged, and
        the worker leaves all the same. A worker whose join failed still holds the
        token: it leaves under that one."""
        if self._held is not None and self._held.held:
            with contextlib.suppress(RpcError):
                self.leave()
            yield
            return
        try:
            token = self.hold_token("leave", timeout)
        except RpcError as exc:
            log.warning("%s: leaving the dynamic world without its membership token: %s",
                        self.name, exc)
            yield
            return
        try:
            self.leave()
        except RpcError as exc:
            log.debug("%s: striking itself off the roster: %s", self.name, exc)
        try:
            yield
        finally:
            token.release()

    def was_held(self, rank: int) -> bool:
        """Whether a worker ever held ``rank`` in this world (read under the token)."""
        return self.store.check([f"member/{rank}"], self.timeout)

    def member(self, rank: int) -> str:
        """The name of the worker that holds ``rank`` (a worker admitting a newcomer
        reads it: the newcomer entered itself before connecting). ``RpcError`` if none."""
        key = f"member/{rank}"
        name = (self.store.get(key, self.timeout).decode()
                if self.store.check([key], self.timeout) else "")
        if not name:
            raise RpcError(f"rank {rank} holds no place in the dynamic world's roster")
        return name


class HeldToken:
    """The membership token, taken on creation and held until :meth:`release`."""

    def __init__(self, taking: contextlib.AbstractContextManager[None]) -> None:
        self._taking = taking
        taking.__enter__()
        self.held = True

    def release(self) -> None:
        """Give the token back (once; later calls do nothing)."""
        if self.held:
            self.held = False
            self._taking.__exit__(None, None, None)
