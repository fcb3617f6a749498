"""The churn: a dynamic world whose workers keep leaving and joining while others work.

This process is ``lead`` (rank 0, the store's host). ``stable1`` .. ``stableK`` join once
and, all through the run, call random members, create RRefs on them, pass RRefs they
own to them, run distributed backward passes through them, and step a ``DistributedOptimizer`` over
a module one of them owns. The last ranks are
*slots*, whose workers do the same while they are in the world: each cycle one slot's
worker leaves, gracefully (``shutdown()``) or killed
outright (``kill -9``: no goodbye, nothing said to the store), and a new worker with a
new name joins at that rank. A graceful leaver's process joins again; a killed one is
replaced by a spare process started ahead of time (a process's start, on a small host
seconds, is not what is measured).

What must hold: every join succeeds; no call hangs (each has a timeout, and one that
times out is a problem); a call that fails does so with ``PeerLostError``,
``UnknownWorkerError`` or ``RpcShutdownError`` (the callee was shutting down) naming the
departed worker; at the end every survivor holds no
RRef, no autograd context and no pending call.

Run it as ``nox -s soak -- --churn`` or ``python -m rpcx.testing.churn --help``; a short
version runs in the test suite (tests/test_churn.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import rpcx
import rpcx.autograd as dist_autograd
from rpcx.errors import PeerLostError, RpcShutdownError, UnknownWorkerError
from rpcx.testing import remote, training
from rpcx.testing.processes import worker_context
from rpcx.testing.soak import leftover_problems, settled_leftovers
from rpcx.testing.world import _options, free_port

__all__ = ["ChurnResult", "main", "run"]

log = logging.getLogger("rpcx.churn")

ORDER_TIMEOUT = 120.0  # seconds a worker process has to carry out an order
CALL_TIMEOUT = 30.0  # each call the stable workers make


# ------------------------------------------------------------ a worker process


def _serve_orders(orders: Any, backend: str, init_method: str, options: dict[str, Any],
                  level: int) -> None:
    """A worker process: carry out the lead's orders (``("join", name, rank)``,
    ``("leave",)``, ``("exit",)``) one at a time, answering each."""
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s")
    while True:
        order = orders.recv()
        if order[0] == "join":
            try:
                rpcx.init_rpc(order[1], backend=backend, rank=order[2],
                              rpc_backend_options=_options(backend, init_method, options))
            except Exception as exc:
                orders.send(("refused", f"{type(exc).__name__}: {exc}"))
            else:
                orders.send(("joined",))
        elif order[0] == "leave":
            rpcx.shutdown()
            orders.send(("left",))
        else:
            return


class _Process:
    """A worker process and the pipe for its orders."""

    def __init__(self, backend: str, init_method: str, options: dict[str, Any]) -> None:
        context = worker_context()
        self.orders, theirs = context.Pipe()
        self.process = context.Process(
            target=_serve_orders, daemon=True,
            args=(theirs, backend, init_method, options,
                  max(logging.WARNING, logging.getLogger().getEffectiveLevel())))
        self.process.start()

    def order(self, *order: Any) -> tuple[Any, ...]:
        """Give an order and wait (bounded) for the answer."""
        self.orders.send(order)
        if not self.orders.poll(ORDER_TIMEOUT):
            raise TimeoutError(f"worker process {self.process.pid} did not carry out "
                               f"{order!r} within {ORDER_TIMEOUT:g} s")
        answer: tuple[Any, ...] = self.orders.recv()
        return answer

    def kill(self) -> None:
        """``kill -9``, and wait (bounded) until it is gone."""
        self.process.kill()
        self.process.join(ORDER_TIMEOUT)

    def end(self) -> None:
        """Tell it to exit (it left the world first, or never joined); kill it if it
        does not."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.orders.send(("exit",))
            self.process.join(10.0)
        if self.process.is_alive():
            self.kill()


# ------------------------------------------------------- what stable workers do

_activity: dict[str, Any] = {}


def start_activity(seed: int) -> None:
    """Run on a stable worker: start calling, creating RRefs and running backward
    passes against random members, until :func:`stop_activity`."""
    stop = threading.Event()
    counts: Counter[str] = Counter()
    problems: list[str] = []
    thread = threading.Thread(target=_keep_busy, args=(random.Random(seed), stop, counts,
                                                       problems),
                              name="rpcx-churn-activity", daemon=True)
    _activity.update(stop=stop, counts=counts, problems=problems, thread=thread)
    thread.start()


def stop_activity() -> dict[str, Any]:
    """Stop :func:`start_activity`'s thread; what it did and the problems it saw."""
    _activity["stop"].set()
    _activity["thread"].join(CALL_TIMEOUT * 3)
    if _activity["thread"].is_alive():
        _activity["problems"].append("the activity thread did not stop: a call hangs")
    return {"counts": dict(_activity["counts"]), "problems": list(_activity["problems"])}


def _keep_busy(rng: random.Random, stop: threading.Event, counts: Counter[str],
               problems: list[str]) -> None:
    me = rpcx.get_worker_info().name
    while not stop.is_set():
        peers = [w.name for w in rpcx.get_worker_infos() if w.name != me]
        peer = rng.choice(peers)
        what = rng.choice(("call", "rref", "fork", "backward", "step"))
        try:
            _once(what, peer)
            counts[what] += 1
        except (PeerLostError, UnknownWorkerError, RpcShutdownError) as exc:
            if f"'{peer}'" in str(exc):
                counts["failed, naming the departed worker"] += 1
            else:
                problems.append(f"{what} to {peer!r}: {type(exc).__name__} not naming it: "
                                f"{exc}\n{_where()}")
        except Exception as exc:
            problems.append(f"{what} to {peer!r}: {type(exc).__name__}: {exc}\n{_where()}")


def _where() -> str:
    """Where the exception being handled was raised (its last frames), for the report."""
    return "".join(traceback.format_exc(limit=-6).splitlines(keepends=True)[:-1])


def _once(what: str, peer: str) -> None:
    if what == "call":
        if rpcx.rpc_sync(peer, remote.add, args=(20, 22), timeout=CALL_TIMEOUT) != 42:
            raise AssertionError("wrong sum")
    elif what == "rref":
        counter = rpcx.remote(peer, remote.Counter, args=(5,), timeout=CALL_TIMEOUT)
        if counter.rpc_sync(timeout=CALL_TIMEOUT).increment(2) != 7:
            raise AssertionError("wrong count")
    elif what == "fork":
        mine = rpcx.RRef(remote.Counter(1))
        if rpcx.rpc_sync(peer, remote.rref_increment, args=(mine, 1),
                         timeout=CALL_TIMEOUT) != 2:
            raise AssertionError("wrong count through a fork")
    elif what == "step":  # a DistributedOptimizer step on a module the peer owns
        module = rpcx.remote(peer, torch.nn.Linear, args=(2, 1), timeout=CALL_TIMEOUT)
        (grads,) = training.train_against(module, torch.ones(1, 2), steps=1, lr=0.1)
        if any(grad is None for grad in grads):
            raise AssertionError("a parameter got no gradient")
    else:
        x = torch.ones(3, requires_grad=True)
        with dist_autograd.context() as ctx:
            y = rpcx.rpc_sync(peer, torch.mul, args=(x, 3.0), timeout=CALL_TIMEOUT)
            dist_autograd.backward(ctx, [y.sum()])
            if dist_autograd.get_gradients(ctx)[x].tolist() != [3.0, 3.0, 3.0]:
                raise AssertionError("wrong gradient")


# ------------------------------------------------------------------ the driver


@dataclass
class ChurnResult:
    """What a churn did and found; ``ok`` when nothing failed, hung or was left."""

    backend: str
    cycles: int
    kills: int = 0
    seconds: float = 0.0
    join_seconds: list[float] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    leftovers: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def run(backend: str = "auto", size: int = 8, slots: int = 4, cycles: int = 100,
        kill_every: int = 4, seed: int = 0,
        progress: Callable[[str], None] = log.info, **options: Any) -> ChurnResult:
    """Run the churn: ``size`` workers, the last ``slots`` ranks churning, ``cycles``
    departures and joins in a row, every ``kill_every``-th departure a ``kill -9``."""
    stable = size - 1 - slots
    if stable < 1 or slots < 1:
        raise ValueError(f"a churn needs a stable worker and a slot: size {size}, "
                         f"slots {slots}")
    result = ChurnResult(backend, cycles)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    options.setdefault("rpc_timeout", ORDER_TIMEOUT)
    started = time.monotonic()
    processes: list[_Process] = []

    def new_process() -> _Process:
        processes.append(_Process(backend, init_method, options))
        return processes[-1]

    rpcx.init_rpc("lead", backend=backend, rank=0,
                  rpc_backend_options=_options(backend, init_method, options))
    try:
        workers = {rank: new_process() for rank in range(1, size)}
        spare = new_process()
        names = {rank: f"stable{rank}" if rank <= stable else f"slot{rank}-0"
                 for rank in range(1, size)}
        for rank in range(1, size):
            _join(workers[rank], names[rank], rank, result)
        for rank in range(1, size):
            rpcx.rpc_sync(names[rank], start_activity, args=(seed * 100_000 - rank,))
        for cycle in range(1, cycles + 1):
            rank = stable + 1 + (cycle - 1) % slots
            if cycle % kill_every == 0:
                workers[rank].kill()
                result.kills += 1
                workers[rank], spare = spare, new_process()
            else:
                _stop_activity(names[rank], result)
                _expect(workers[rank].order("leave"), ("left",), names[rank], result)
            names[rank] = f"slot{rank}-{cycle}"
            _join(workers[rank], names[rank], rank, result)
            rpcx.rpc_sync(names[rank], start_activity, args=(seed * 100_000 + cycle,))
            if cycle % max(1, cycles // 10) == 0:
                progress(f"cycle {cycle}/{cycles}: {result.kills} killed, "
                         f"{time.monotonic() - started:.0f} s")
        for rank in range(1, size):
            _stop_activity(names[rank], result)
        result.leftovers = settled_leftovers("lead", sorted(names.values()), CALL_TIMEOUT)
        result.problems += leftover_problems(result.leftovers)
        for rank in range(size - 1, 0, -1):  # everyone leaves; the store's host last
            _expect(workers[rank].order("leave"), ("left",), names[rank], result)
    finally:
        rpcx.shutdown(timeout=ORDER_TIMEOUT)
        for process in processes:
            process.end()
    result.seconds = round(time.monotonic() - started, 1)
    return result


def _stop_activity(name: str, result: ChurnResult) -> None:
    done = rpcx.rpc_sync(name, stop_activity, timeout=CALL_TIMEOUT * 4)
    result.counts = dict(Counter(result.counts) + Counter(done["counts"]))
    result.problems += [f"{name}: {problem}" for problem in done["problems"]]


def _join(worker: _Process, name: str, rank: int, result: ChurnResult) -> None:
    started = time.monotonic()
    _expect(worker.order("join", name, rank), ("joined",), name, result)
    result.join_seconds.append(round(time.monotonic() - started, 2))


def _expect(answer: tuple[Any, ...], wanted: tuple[str], name: str,
            result: ChurnResult) -> None:
    if answer != wanted:
        result.problems.append(f"{name}: {' '.join(map(str, answer))}")
        raise RuntimeError(f"the churn stopped: worker {name!r} answered {answer!r}")


def main(argv: list[str] | None = None) -> int:
    """``python -m rpcx.testing.churn``: run, print progress and the summary."""
    parser = argparse.ArgumentParser(prog="python -m rpcx.testing.churn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--slots", type=int, default=4, help="ranks that churn")
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--kill-every", type=int, default=4,
                        help="every Nth departure is a kill -9 (the others shut down)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        stream=sys.stdout)
    result = run(args.backend, args.size, args.slots, args.cycles, args.kill_every,
                 args.seed)
    joins = sorted(result.join_seconds)
    log.info("churn %s: %s; join median %.2f s, slowest %.2f s",
             "passed" if result.ok else "FAILED",
             json.dumps({k: v for k, v in asdict(result).items() if k != "join_seconds"}),
             joins[len(joins) // 2], joins[-1])
    if args.json:
        with open(args.json, "w") as out:
            json.dump(asdict(result), out, indent=1)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
