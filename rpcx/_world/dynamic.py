"""A dynamic world's bookkeeping in the rendezvous store (``init_rpc`` without ``world_size``).

Workers of a dynamic world join and leave one at a time, as in torch: each takes the
world's *membership token* (a key set with ``compare_set``, so only one worker holds it),
reads who is in the world, enters itself, connects to every member, and gives the token
back. Leaving takes the token too, so that no worker joins while another leaves.

The store also records which kind of world it serves: a worker that joins a static world
(``world_size`` given) dynamically, or the reverse, is refused with torch's message.

Keys, under ``rpcx/dynamic/`` of the store:

* ``token``: who holds the token, as JSON (its name, purpose, rank, a nonce, and its
  process mark); empty: free;
* ``member/<rank>``: the name of the worker holding ``rank`` (empty once it left);
  this and the roster are sealed in a world with a key (:mod:`rpcx._world.sealed`), so
  a store client without it cannot rename or add members;
* ``process/<rank>``: that worker's process mark (:mod:`rpcx._util.process_watch`);
* ``incarnation/<rank>``: how many workers have taken ``rank`` so far (the ids a worker
  makes, of RRefs and autograd contexts, start past those its predecessors made, which
  other workers may still remember);
* ``roster``: every rank held now, as JSON (``{"rank": "name"}``);
* ``session/<rank>``: in a world with a key, the session record of the worker holding
  ``rank``, sealed (:mod:`rpcx._wire.sessions`; empty once it left);
* ``tls/servers``: in a world keyed by certificates, where each member's key server
  listens (:mod:`rpcx._world.enrollment`).

A worker killed outright (``kill -9``) never gives its place back. On one host the
kernel says so: a worker waiting for the token takes it over from a holder whose
process is gone, and a joining worker strikes members whose processes are gone off the
roster before it connects to them. Across hosts, the members that see the dead worker's
connection break strike it off (:meth:`DynamicWorld.strike_off`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator

from rpcx._util.process_watch import local_mark, process_state
from rpcx._wire.auth import AUTH_KEY_ENV, ValueSeal, is_sealed
from rpcx._world import enrollment, sealed
from rpcx._world.store import BoundedStore
from rpcx.errors import RpcError, RpcTimeoutError

__all__ = ["KIND_KEY", "MIXED_WORLDS", "DynamicWorld", "HeldToken", "claim_kind",
           "holder_label", "process_mark_label"]

log = logging.getLogger("rpcx.rendezvous")

KIND_KEY = "rpcx/kind"
MIXED_WORLDS = ("RPC group mixes statically and dynamically initialized members which is "
                "not supported.")
_POLL_FIRST, _POLL_MAX = 0.002, 0.1  # seconds between looks at a token held by another
_REPORT_EVERY = 30.0
_LOOK_MIN = 0.05  # seconds a look at the token may take past the deadline
# proc(5) states of a process that will never run again ("gone": no such process).
_DEAD = frozenset({"gone", "Z", "X"})


def _is_dead(mark_hex: str) -> bool:
    """Whether the process a (hex) mark names is gone, as far as this host can tell."""
    try:
        state = process_state(bytes.fromhex(mark_hex))
    except ValueError:
        return False
    return state is not None and state[0] in _DEAD


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

    PREFIX = "rpcx/dynamic"

    def __init__(self, store: BoundedStore, name: str, rank: int,
                 timeout: float | None) -> None:
        self.store = store.prefixed(self.PREFIX)
        self.name = name
        self.rank = rank
        self.timeout = timeout
        self._held: HeldToken | None = None  # the token this worker holds now, if any
        self.incarnation = 0  # workers that held this rank before this one (see enter)
        # Run with a newcomer's rank before it is admitted; one that raises refuses it,
        # and each returns what undoes it if the newcomer is refused later (joining adds
        # the check of its device declaration).
        self.admission_checks: list[Callable[[int], Callable[[], None]]] = []
        # Run once this worker has left (its key server closes: joining adds it).
        self.on_departure: list[Callable[[], None]] = []
        self.key_servers = False  # whether members list key servers (certificates)

    def use_seal(self, seal: ValueSeal) -> None:
        """Seal and open values with ``seal`` from now on (a worker with certificates
        has the world key only once it holds the token)."""
        self.store = self.store.with_seal(seal)
        self.key_servers = True

    def has_members(self) -> bool:
        """Whether anyone is in the world (read under the token): a roster exists and
        was not emptied by the last worker of a world keyed by certificates to leave."""
        return (self.store.check(["roster"], self.timeout)
                and self.store.get("roster", self.timeout) != b"")

    # ------------------------------------------------------------------ the token

    @contextlib.contextmanager
    def token(self, purpose: str, timeout: float | None = None) -> Iterator[None]:
        """Hold the membership token for ``purpose`` ("join", "leave"): no other worker
        joins or leaves meanwhile. ``RpcTimeoutError`` naming the holder if it is not
        free within ``timeout`` (default: the world's; its holder may be stopped)."""
        # Unique to this attempt (the nonce): two workers that give the same name cannot
        # both believe they hold it. The process mark lets a waiter see a dead holder.
        me = json.dumps({"name": self.name, "purpose": purpose, "rank": self.rank,
                         "nonce": uuid.uuid4().hex[:8], "process": local_mark().hex()})
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        started = report_at = time.monotonic()
        pause = _POLL_FIRST
        while True:
            # (a look at the deadline still gets a moment: a store that answers is not
            # to be taken for one that does not, and the error below names the holder)
            left = None if deadline is None else max(deadline - time.monotonic(), _LOOK_MIN)
            holder = self.store.compare_set("token", "", me, left).decode()
            if holder in ("", me):
                break
            held_by = _describe_holder(holder)
            if _is_dead(held_by.get("process", "")):
                # Killed while it held the token: nobody else will ever give it back.
                if self.store.compare_set("token", holder, me, left).decode() == me:
                    log.warning("%s: worker %r (rank %s) died holding the dynamic world's "
                                "membership token (to %s); taken over", self.name,
                                held_by["name"], held_by["rank"], held_by["purpose"])
                    break
                continue  # (someone else took it over first: look again at once)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise RpcTimeoutError(
                    f"worker {self.name!r} (rank {self.rank}) could not {purpose} the "
                    f"dynamic world within {timeout:g} s: worker {held_by['name']!r} holds "
                    f"its membership token (to {held_by['purpose']}) all that time; it may "
                    "be stopped in the middle of joining or leaving, or still connecting")
            if now >= report_at + _REPORT_EVERY:
                report_at = now
                log.info("%s: waiting %.0f s for the membership token (held by worker %r, "
                         "to %s)", self.name, now - started, held_by["name"],
                         held_by["purpose"])
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
        if not self.has_members():
            return {}
        return {int(rank): name for rank, name in
                json.loads(self._read_sealed("roster", "its roster")).items()}

    def _read_sealed(self, key: str, what: str) -> bytes:
        """The value of ``key`` (which exists), opened with the world key where this
        worker has one; ``RpcError`` saying how the keys differ otherwise."""
        (value,) = sealed.read(self.store, [key], self.timeout)
        if value is not None and (self.store.seal is not None or not is_sealed(value)):
            return value
        if self.store.seal is None:
            raise RpcError(
                f"init_rpc: worker {self.name!r} (rank {self.rank}): the dynamic world's "
                f"members hold a world key ({what} is sealed with one) and this worker "
                f"has none: set {AUTH_KEY_ENV} (or the auth_key option) to the world's key")
        raise RpcError(
            f"init_rpc: worker {self.name!r} (rank {self.rank}): {what} in the store is not "
            "sealed with this worker's world key: the members run with another key or "
            "none, or a store client without the key wrote it")

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
        self.incarnation = self.store.add(f"incarnation/{self.rank}", 1, self.timeout) - 1
        key = f"process/{self.rank}"
        sealed.publish(self.store, key, local_mark(), self.timeout,
                       label=holder_label(self.store, key, self.incarnation + 1))
        sealed.publish(self.store, f"member/{self.rank}", self.name, self.timeout)
        sealed.publish(self.store, "roster", json.dumps({**roster, self.rank: self.name}),
                       self.timeout)

    def strike_off_the_dead(self, roster: dict[int, str]) -> dict[int, str]:
        """Strike off ``roster`` (read under the token) every member whose process this
        host's kernel says is gone; the roster that is left. A joining worker does this
        before it connects to the members: a connection to a dead one would fail it."""
        ranks = list(roster)  # (this worker is not on it yet)
        keys = [f"process/{rank}" for rank in ranks]
        if not ranks or not self.store.check(keys, self.timeout):
            return roster  # (a member without a mark is one from before marks: kept)
        # (a forged mark, or one an earlier holder of the rank published: not dead)
        marks = sealed.read(self.store, keys, self.timeout,
                            labels=[self.holder_label(key, rank) for key, rank in
                                    zip(keys, ranks, strict=True)])
        dead = [rank for rank, mark in zip(ranks, marks, strict=True)
                if mark is not None and _is_dead(mark.hex())]
        if not dead:
            return roster
        for rank in dead:
            log.warning("%s: worker %r (rank %d) died without leaving the dynamic world; "
                        "struck off its roster", self.name, roster[rank], rank)
        return self._strike(roster, dead)

    def strike_off(self, rank: int, name: str, timeout: float) -> None:
        """Worker ``name`` (``rank``) was lost without leaving: strike it off the roster
        under the token, unless it left or another worker struck it off already (any
        member that saw it go does this; once is enough). Bounded by ``timeout``."""
        with self.token("strike off", timeout):
            roster = self.roster()
            if roster.get(rank) != name:
                return
            self._strike(roster, [rank])
        log.info("%s: struck worker %r (rank %d) off the dynamic world's roster: it was lost "
                 "without leaving", self.name, name, rank)

    def _strike(self, roster: dict[int, str], ranks: list[int]) -> dict[int, str]:
        """Take ``ranks`` off ``roster`` (read under the token) and off the store; the
        roster that is left."""
        kept = {rank: name for rank, name in roster.items() if rank not in ranks}
        for rank in ranks:
            sealed.publish(self.store, f"member/{rank}", "", self.timeout)
            self._forget_session(rank)
            if self.key_servers:
                enrollment.unlist_server(self.store, rank, self.timeout)
        sealed.publish(self.store, "roster", json.dumps(kept), self.timeout)
        return kept

    def leave(self) -> None:
        """Strike this worker off the roster (under the token)."""
        roster = self.roster()
        if roster.get(self.rank) == self.name:
            del roster[self.rank]
            if not roster and self.key_servers:
                # The last to leave a world keyed by certificates: the world's key goes
                # with it, so the next worker starts the world anew with a key of its own.
                self.store.set("roster", b"", self.timeout)
            else:
                sealed.publish(self.store, "roster", json.dumps(roster), self.timeout)
        sealed.publish(self.store, f"member/{self.rank}", "", self.timeout)
        self._forget_session(self.rank)
        if self.key_servers:
            enrollment.unlist_server(self.store, self.rank, self.timeout)

    def _forget_session(self, rank: int) -> None:
        """Empty ``rank``'s session record, if it has one (a keyless worker may take
        the rank next, in a world whose keyed members have all left)."""
        key = f"{self.SESSION}/{rank}"
        if self.store.check([key], self.timeout):
            self.store.set(key, b"", self.timeout)

    @contextlib.contextmanager
    def departing(self, timeout: float | None = None) -> Iterator[None]:
        """This worker leaves: off the roster under the token (waited for at most
        ``timeout``), which is held until the block ends (the worker closes its
        connections meanwhile). A token or store that does not answer is logged, and
        the worker leaves all the same. A worker whose join failed still holds the
        token: it leaves under that one. Then :attr:`on_departure` runs."""
        try:
            with self._leaving(timeout):
                yield
        finally:
            self.departed()

    def departed(self) -> None:
        """Run :attr:`on_departure` (once)."""
        steps, self.on_departure = self.on_departure, []
        for step in steps:
            step()

    @contextlib.contextmanager
    def _leaving(self, timeout: float | None) -> Iterator[None]:
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

    # ------------------------------------------------------------ the holders' values

    def holder_label(self, key: str, rank: int, *, entering: bool = False) -> str:
        """The seal label of ``key``, a value the worker holding ``rank`` publishes
        (``entering``: this worker, about to enter at ``rank``): bound to that worker's
        incarnation, so a value an earlier holder of the rank published does not open."""
        if self.store.seal is None:  # (nothing is sealed: no store operation for it)
            return self.store.label(key)
        count = self.store.add(f"incarnation/{rank}", 0, self.timeout)
        return holder_label(self.store, key, count + (1 if entering else 0))

    # ------------------------------------------------------------ session records

    SESSION = "session"
    """The key of a rank's session record is ``f"{SESSION}/{rank}"`` (under
    :attr:`PREFIX`, what its seal's label names)."""

    def sessions(self, ranks: list[int]) -> dict[int, bytes]:
        """The session records ``ranks`` published, as stored (empty: none)."""
        found = {}
        for rank in ranks:
            key = f"{self.SESSION}/{rank}"
            found[rank] = (self.store.get(key, self.timeout)
                           if self.store.check([key], self.timeout) else b"")
        return found

    def was_held(self, rank: int) -> bool:
        """Whether a worker ever held ``rank`` in this world (read under the token)."""
        return self.store.check([f"member/{rank}"], self.timeout)

    def admitting(self, rank: int) -> list[Callable[[], None]]:
        """A worker joins at ``rank``: run the admission checks (each raises
        ``RpcError`` to refuse it); what undoes them, last first, should it be refused
        after all. A check that raises has the earlier ones undone."""
        undo: list[Callable[[], None]] = []
        try:
            for check in self.admission_checks:
                undo.insert(0, check(rank))
        except BaseException:
            for step in undo:
                step()
            raise
        return undo

    def member(self, rank: int) -> str:
        """The name of the worker that holds ``rank`` (a worker admitting a newcomer
        reads it: the newcomer entered itself before connecting). ``RpcError`` if none."""
        key = f"member/{rank}"
        name = (self._read_sealed(key, f"the name of rank {rank}").decode()
                if self.store.check([key], self.timeout) else "")
        if not name:
            raise RpcError(f"rank {rank} holds no place in the dynamic world's roster")
        return name


def holder_label(store: BoundedStore, key: str, incarnations: int) -> str:
    """The seal label of ``key`` published by the ``incarnations``-th worker to hold its
    rank (see :meth:`DynamicWorld.holder_label`)."""
    return f"{store.label(key)}@{incarnations}"


def process_mark_label(store: BoundedStore, rank: int, timeout: float | None) -> str | None:
    """The seal label of the process mark of the worker holding ``rank``, where
    ``store`` is a dynamic world's (its ranks have incarnations); ``None`` elsewhere."""
    counter = f"incarnation/{rank}"
    if not store.check([counter], timeout):
        return None
    return holder_label(store, f"process/{rank}", store.add(counter, 0, timeout))


def _describe_holder(holder: str) -> dict[str, str]:
    """The token's holder as stored (a value not in our format: its text as the name)."""
    try:
        found = json.loads(holder)
    except ValueError:
        found = None
    if not isinstance(found, dict):
        return {"name": holder, "purpose": "?", "rank": "?", "process": ""}
    return {key: str(found.get(key, "")) for key in ("name", "purpose", "rank", "process")}


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
