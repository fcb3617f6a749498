"""Where one small ``rpc_sync`` round trip spends its time, step by step.

Two worker processes; rank 0 calls ``rpc_sync("w1", add, (1, 2))`` many times while
both processes stamp ``time.perf_counter_ns()`` (CLOCK_MONOTONIC, the same clock in
every process on Linux) at each step of the call path. The steps are stamped by
wrapping rpcx's own functions in the worker processes, so nothing in the library
changes for this. Prints the median duration of each step. Usage::

    python bench/profile_rtt.py [--backend gloo] [--calls 2000]

The wrappers themselves cost ~1 us each, so the steps add up to a little more than an
unwrapped round trip.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# (step name, process) in the order a round trip passes them.
STEPS = [
    ("c.call", "client: rpc_sync entered"),
    ("c.encoded", "client: request encoded"),
    ("c.send_in", "client: transport.send entered"),
    ("c.post_in", "client: slot built"),
    ("c.pg_in", "client: peer lock taken"),
    ("c.pg_out", "client: pg.send returned"),
    ("c.posted", "client: gloo send posted"),
    ("c.send_out", "client: transport.send returned"),
    ("s.deliver", "server: frame delivered by the transport"),
    ("s.serve", "server: request being served (decode starts)"),
    ("s.handler_in", "server: handler entered"),
    ("s.handler_out", "server: handler returned"),
    ("s.send_in", "server: reply send entered"),
    ("s.post_in", "server: slot built"),
    ("s.pg_in", "server: peer lock taken"),
    ("s.pg_out", "server: pg.send returned"),
    ("s.posted", "server: gloo send posted"),
    ("s.send_out", "server: reply send returned"),
    ("c.deliver", "client: reply delivered by the transport"),
    ("c.done", "client: rpc_sync returned"),
]


def add(a: int, b: int) -> int:
    stamp("s.handler_in")
    out = a + b
    stamp("s.handler_out")
    return out


_stamps: dict[str, list[int]] = {}


def stamp(step: str) -> None:
    _stamps.setdefault(step, []).append(time.perf_counter_ns())


def _wrap(owner: Any, name: str, before: str | None, after: str | None = None) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before:
            stamp(before)
        try:
            return original(*args, **kwargs)
        finally:
            if after:
                stamp(after)

    setattr(owner, name, wrapper)


def _instrument(rank: int, backend: str) -> None:
    import rpcx._core.call_path as call_path_module
    from rpcx.registry import resolve_backend

    side = "c" if rank == 0 else "s"
    transport_cls = resolve_backend(backend).factory
    _wrap(transport_cls, "send", f"{side}.send_in", f"{side}.send_out")
    if os.environ.get("RPCX_PROFILE_GLOO"):
        _wrap(transport_cls, "_post", f"{side}.post_in", f"{side}.posted")
        import rpcx.backends.gloo as gloo_module
        pg_send = None

        def traced_send(self: Any, *args: Any) -> Any:
            stamp(f"{side}.pg_in")
            try:
                return pg_send(*args)  # type: ignore[misc]
            finally:
                stamp(f"{side}.pg_out")

        original_start = gloo_module.GlooTransport.start

        def start(self: Any, ctx: Any) -> None:
            nonlocal pg_send
            original_start(self, ctx)
            pg_send = self._pg.send
            pg = self._pg

            class Traced:
                def __getattr__(self, name: str) -> Any:
                    return getattr(pg, name)

                def send(self, *args: Any) -> Any:
                    return traced_send(None, *args)

            self._pg = Traced()

        gloo_module.GlooTransport.start = start  # type: ignore[method-assign]
    _wrap(call_path_module, "encode", None, "c.encoded" if side == "c" else None)
    _wrap(call_path_module.CallPath, "on_frame", f"{side}.deliver")
    if side == "s":
        _wrap(call_path_module.CallPath, "serve", "s.serve")


def _worker(rank: int, backend: str, init_method: str, calls: int, out: str) -> None:
    import rpcx

    _instrument(rank, backend)
    rpcx.init_rpc(f"w{rank}", rank=rank, world_size=2, backend=backend,
                  rpc_backend_options=rpcx.TensorPipeRpcBackendOptions(init_method=init_method))
    if rank == 0:
        for _ in range(300):  # warm up
            rpcx.rpc_sync("w1", add, args=(1, 2))
        _stamps.clear()
        for _ in range(calls):
            stamp("c.call")
            rpcx.rpc_sync("w1", add, args=(1, 2))
            stamp("c.done")
        client = {step: values[:calls] for step, values in _stamps.items()}
        server = rpcx.rpc_sync("w1", _collect)
        pathlib.Path(out).write_text(json.dumps({"client": client, "server": server}))
    rpcx.shutdown()


def _collect() -> dict[str, list[int]]:
    for step in ("s.deliver", "s.serve"):  # this call's own stamps
        _stamps[step].pop()
    return {step: values[-_calls():] for step, values in _stamps.items()}


def _calls() -> int:
    return int(os.environ["RPCX_PROFILE_CALLS"])


def _report(data: dict[str, dict[str, list[int]]], calls: int) -> str:
    merged = {**data["server"], **data["client"]}
    lines = [f"{'step':<52}{'median us':>10}{'p90 us':>10}"]
    total = 0.0
    previous = STEPS[0][0]
    for step, label in STEPS[1:]:
        if step not in merged or previous not in merged:
            continue
        a, b = merged[previous][-calls:], merged[step][-calls:]
        gaps = sorted((y - x) / 1000 for x, y in zip(a, b, strict=True))
        med = statistics.median(gaps)
        total += med
        lines.append(f"{label:<52}{med:>10.1f}{gaps[int(0.9 * len(gaps))]:>10.1f}")
        previous = step
    rtt = [(y - x) / 1000 for x, y in zip(merged["c.call"], merged["c.done"], strict=True)]
    lines.append(f"{'sum of step medians':<52}{total:>10.1f}")
    lines.append(f"{'round trip (median)':<52}{statistics.median(rtt):>10.1f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    os.environ["RPCX_PROFILE_CALLS"] = str(args.calls)
    with tempfile.TemporaryDirectory() as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        out = os.path.join(tmp, "stamps.json")
        mp.start_processes(_worker, args=(args.backend, init_method, args.calls, out),
                           nprocs=2, start_method="spawn")
        data = json.loads(pathlib.Path(out).read_text())
    print(f"backend {args.backend}, {args.calls} calls")
    print(_report(data, args.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
