"""The soak: four workers, every one calling every other for many rounds, with faults.

Each round, every worker runs :func:`drive` at once: mixed calls (small values, tensors
of up to 64 KiB) to random peers, each reply checked against what was sent (a lost
reply fails its call, a duplicated or crossed one fails the check); RRefs created on
one peer, passed to another, fetched there and dropped; and a distributed backward
through two peers whose gradient is checked. After every round the driver samples
each worker's resident memory (psutil). At the end every worker must hold no RRef, no
autograd context and no pending call, and memory after warm-up must stay flat.

Run it as ``nox -s soak`` or ``python -m rpcx.testing.soak --help``; a short version
runs in the test suite (tests/test_soak.py). By default it runs on ``faulty:gloo`` with
rpcx's bookkeeping dropped now and then and every kind of frame duplicated now and
then (:data:`DEFAULT_FAULTS`).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import rpcx
import rpcx.autograd as dist_autograd
from rpcx._services.calls import UNSET_RPC_TIMEOUT
from rpcx._util.environ import environment_variable
from rpcx.faulty import FAULTS_ENV
from rpcx.testing import remote, training
from rpcx.testing.world import world

__all__ = ["DEFAULT_FAULTS", "SoakResult", "drive", "leftover_problems", "main", "run",
           "settled_leftovers"]

log = logging.getLogger("rpcx.soak")

SIZE = 4
_BOOKKEEPING = ("RREF_FETCH", "RREF_FORKS", "RREF_DELETE", "RREF_CONFIRM", "AUTOGRAD_BACKWARD",
                "AUTOGRAD_RELEASE", "AUTOGRAD_RUN", "AUTOGRAD_CHAIN", "AUTOGRAD_CHAIN_END",
                "AUTOGRAD_FORGET")
DEFAULT_FAULTS: dict[str, Any] = {
    "drop": dict.fromkeys(_BOOKKEEPING, 0.02),
    "duplicate": dict.fromkeys(("CALL", "REMOTE_CALL", "RESULT", "ERROR", *_BOOKKEEPING), 0.02),
    "seed": 1,
}
WARM_UP = 0.25  # the share of rounds before memory must be flat
RSS_SLACK = 0.10  # memory may grow this much after warm-up


# ------------------------------------------------------------- run on every worker


def _echo(token: Any, payload: torch.Tensor | None) -> tuple[Any, float | None]:
    return token, None if payload is None else float(payload.sum())


def _fetch(rref: rpcx.RRef[Any], also: str) -> Any:
    """Fetch ``rref`` here, and have worker ``also`` fetch it too (a second fork)."""
    value = rref.to_here()
    assert rpcx.rpc_sync(also, remote.rref_to_here, args=(rref,)) == value
    return value


def drive(names: list[str], me: str, round_: int, calls: int, rrefs: int) -> dict[str, int]:
    """One round of worker ``me``'s share; returns what it did. Raises on any wrong reply."""
    rng = random.Random(f"{me}/{round_}")
    peers = [n for n in names if n != me]
    sent: list[tuple[Any, torch.Tensor | None, rpcx.RpcFuture[Any]]] = []
    for i in range(calls):
        payload = None if rng.random() < 0.7 else torch.full((rng.randrange(1, 16384),), 1.0)
        token = (me, round_, i)
        sent.append((token, payload, rpcx.rpc_async(rng.choice(peers), _echo,
                                                    args=(token, payload))))
    for token, payload, future in sent:
        expected = (token, None if payload is None else float(payload.numel()))
        got = tuple(future.wait())
        if got != expected:
            raise AssertionError(f"{me}: call {token} answered {got}, not {expected}")
    for i in range(rrefs):
        owner, holder, also = rng.sample([*peers, me], 3)
        value = (me, round_, "rref", i)
        rref = rpcx.remote(owner, remote.echo, args=(value,))
        got = rpcx.rpc_sync(holder, _fetch, args=(rref, also))
        if tuple(got) != value:
            raise AssertionError(f"{me}: RRef of {value} fetched as {got}")
        del rref
    first, second = rng.sample(peers, 2)
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    with dist_autograd.context() as context_id:
        y = rpcx.rpc_sync(first, training.square_then_call, args=(w, [second]))
        dist_autograd.backward(context_id, [y.sum()])
        grad = dist_autograd.get_gradients(context_id)[w]
    if not torch.equal(grad, 4 * w.detach() ** 3):
        raise AssertionError(f"{me}: gradient {grad.tolist()}, not {(4 * w ** 3).tolist()}")
    return {"calls": calls, "rrefs": rrefs, "backwards": 1}


def resident_bytes() -> int:
    """This process's resident memory."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def leftovers() -> dict[str, Any]:
    """What this worker still holds after the soak: must all be zero."""
    info = rpcx.debug_info()
    rrefs, contexts = info["rrefs"], info["autograd"]
    left = {
        "pending_calls": info["pending_calls"],
        "owned_rrefs": rrefs["owned"],
        "user_rrefs": rrefs["user_rrefs"],
        "references_to_owned": rrefs["references_to_owned"],
        "autograd_contexts": contexts["contexts"],
        "resent_frames": info["resent_frames"],
    }
    if rrefs["owned"]:  # (what a leak report names: the entries themselves)
        left["owned_entries"] = remote.owned_rref_entries()
    return left


# ------------------------------------------------------------------ the driver


@dataclass
class SoakResult:
    """What a soak did and found. ``ok`` is True when nothing was lost, left or grown."""

    backend: str
    rounds: int
    calls: int = 0
    rrefs: int = 0
    backwards: int = 0
    seconds: float = 0.0
    rss_mib: dict[str, list[float]] = field(default_factory=dict)  # per worker, per round
    growth: dict[str, float] = field(default_factory=dict)  # after warm-up, per worker
    leftovers: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def run(backend: str = "faulty:gloo", rounds: int = 200, calls: int = 100, rrefs: int = 10,
        faults: dict[str, Any] | None = None,
        progress: Callable[[str], None] = log.info) -> SoakResult:
    """Run the soak; every worker's checks raise on a wrong reply, the rest is reported.

    On a ``faulty:`` backend it sets ``$RPCX_FAULTS`` (``faults``, or
    :data:`DEFAULT_FAULTS`) for the workers it starts, and puts it back after.
    """
    fault_spec = None
    if backend.startswith("faulty:"):
        fault_spec = json.dumps(DEFAULT_FAULTS if faults is None else faults)
    result = SoakResult(backend, rounds)
    names = [f"worker{r}" for r in range(SIZE)]
    started = time.monotonic()
    with (environment_variable(FAULTS_ENV, fault_spec),
          world(backend, size=SIZE, rpc_timeout=120)):
        for name in names:
            result.rss_mib[name] = []
        for round_ in range(rounds):
            futures = [rpcx.rpc_async(name, drive, args=(names, name, round_, calls, rrefs))
                       for name in names[1:]]
            done = [drive(names, names[0], round_, calls, rrefs)] + [f.wait() for f in futures]
            for counts in done:
                result.calls += counts["calls"]
                result.rrefs += counts["rrefs"]
                result.backwards += counts["backwards"]
            for name in names:
                rss = rpcx.rpc_sync(name, resident_bytes) / 2**20
                result.rss_mib[name].append(round(rss, 1))
            if (round_ + 1) % max(1, rounds // 10) == 0:
                progress(f"round {round_ + 1}/{rounds}: {result.calls} calls, {result.rrefs} "
                         f"RRefs, {result.backwards} backward passes, "
                         f"{time.monotonic() - started:.0f} s; RSS MiB " + ", ".join(
                             f"{n} {result.rss_mib[n][-1]:.0f}" for n in names))
        result.leftovers = settled_leftovers(names[0], names[1:])
    result.seconds = round(time.monotonic() - started, 1)
    _judge(result)
    return result


def settled_leftovers(me: str, others: list[str], timeout: float = UNSET_RPC_TIMEOUT
                      ) -> dict[str, dict[str, Any]]:
    """What this worker (``me``) and ``others`` still hold, by name, once the RRef
    deletions and the autograd context releases in flight have settled everywhere
    (three times over: a deletion that frees a value can release more). A release
    travels one way, or on a lossy transport as a request sent again until answered,
    so the last round's contexts may still be on their way to a peer when it ends."""
    for _ in range(3):
        remote.rref_settle()
        remote.autograd_settle()
        for name in others:
            rpcx.rpc_sync(name, remote.rref_settle, timeout=timeout)
            rpcx.rpc_sync(name, remote.autograd_settle, timeout=timeout)
    found = {me: leftovers()}  # (a call to itself would count as pending)
    for name in others:
        found[name] = rpcx.rpc_sync(name, leftovers, timeout=timeout)
    return found


_MUST_BE_ZERO = ("pending_calls", "owned_rrefs", "user_rrefs", "references_to_owned",
                 "autograd_contexts")


def leftover_problems(found: dict[str, dict[str, Any]]) -> list[str]:
    """One line per count of :func:`leftovers` that is not zero, naming the worker."""
    return [f"{name}: {left[key]} {key.replace('_', ' ')} left"
            + (f" ({'; '.join(left['owned_entries'])})"
               if key == "owned_rrefs" and left.get("owned_entries") else "")
            for name, left in found.items() for key in _MUST_BE_ZERO if left[key]]


def _judge(result: SoakResult) -> None:
    result.problems += leftover_problems(result.leftovers)
    start = max(1, int(result.rounds * WARM_UP)) - 1
    for name, curve in result.rss_mib.items():
        if len(curve) <= start:
            continue
        base = curve[start]
        result.growth[name] = round(max(curve[start:]) / base - 1, 3)
        if result.growth[name] > RSS_SLACK:
            result.problems.append(
                f"{name}: memory grew {result.growth[name]:.0%} after warm-up "
                f"({base:.0f} -> {max(curve[start:]):.0f} MiB; limit {RSS_SLACK:.0%})")


def main(argv: list[str] | None = None) -> int:
    """``python -m rpcx.testing.soak``: run, print the summary and the memory curve."""
    parser = argparse.ArgumentParser(prog="python -m rpcx.testing.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="faulty:gloo")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--calls", type=int, default=100, help="calls per worker per round")
    parser.add_argument("--rrefs", type=int, default=10, help="RRefs per worker per round")
    parser.add_argument("--faults", help="JSON of rpcx.faulty.Faults (faulty: backends)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        stream=sys.stdout)
    result = run(args.backend, args.rounds, args.calls, args.rrefs,
                 json.loads(args.faults) if args.faults else None, progress=log.info)
    summary = {k: v for k, v in asdict(result).items() if k != "rss_mib"}
    log.info("soak %s: %s", "passed" if result.ok else "FAILED", json.dumps(summary))
    for name, curve in result.rss_mib.items():
        step = max(1, len(curve) // 20)
        log.info("RSS MiB %s: %s", name, " ".join(f"{v:.0f}" for v in curve[::step]))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(asdict(result), out, indent=1)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
