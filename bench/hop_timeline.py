"""Where one step of a two-worker program spends its time, across both processes.

``profile_rtt.py`` follows one small round trip; this follows any short exchange of
frames: a 1 MiB ``rpc_sync`` echo (``echo_1m``), a 16-byte one (``echo_small``), or one
``rpcx.autograd.backward`` of
the example RNN (``rnn_backward``: examples/rnn, trainer and parameter server). Both
worker processes stamp ``time.perf_counter()`` (CLOCK_MONOTONIC, one clock for every
process of a host) at the same points of rpcx's socket transport and call path, by
wrapping rpcx's own functions in the worker processes (nothing in the library changes):

* ``send`` / ``sent``: the transport's ``send`` entered / returned (for a tensor in
  shared memory, its copy into the segment and the ``sendmsg`` are between the two);
* ``woke``: a receiving thread's blocking read returned with bytes;
* ``parsed``: the transport has the frame (segments mapped, buffers read);
* ``deliver`` / ``delivered``: the call path's ``on_frame`` entered / returned (decode,
  serve or complete);
* ``pass`` / ``pass_end``: a local backward pass of distributed autograd;
* ``handler``: the echoed function runs;
* with ``--fine``: ``decode``/``decoded`` (a payload's unpickling), ``encode``/``encoded``
  (the call path's encode of a frame), ``chain``/``chain_end`` (the autograd chain's
  handlers start), ``plan``/``planned`` (a pass's planning), ``settle``/``settled``.

Each step (``--steps``, after a warm-up) is a window of stamps from both processes in
time order. The most common sequence of stamps over the windows is printed with the
median time of each stamp from the step's start and the gap from the stamp before, so
each hop reads as: encode, send, wake, parse, decode and dispatch, work. Where a stamp
follows one made by the same thread, ``cpu us`` is the CPU time that thread spent in
the gap (``time.thread_time``): a gap much longer than its CPU time was spent waiting. Only
``auto``/``shm``/``tcp`` (the socket transports) are wrapped. The wrappers cost about
0.5 us a stamp. Usage::

    python bench/hop_timeline.py [--workload echo_1m|echo_small|rnn_backward] [--steps 300]
                                 [--fine]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
WARMUP = 30
_FINE = "RPCX_HOP_TIMELINE_FINE"  # (set by --fine, read in the worker processes)

_events: list[tuple[float, str, str, float, int]] = []
_side = "?"


def stamp(what: str) -> None:
    # The calling thread's CPU time beside the wall clock: a gap between two stamps of
    # one thread that took far more wall time than CPU time was spent waiting (for the
    # GIL, for the processor), not running Python.
    _events.append((time.perf_counter(), _side, what, time.thread_time(),
                    threading.get_ident()))


def _wrap(owner: Any, name: str, before: str | None, after: str | None,
          when: Callable[..., bool] | None = None) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if when is not None and not when(*args, **kwargs):
            return original(*args, **kwargs)
        if before:
            stamp(before)
        try:
            return original(*args, **kwargs)
        finally:
            if after:
                stamp(after)

    setattr(owner, name, wrapper)


def _instrument() -> None:
    from rpcx._core.call_path import CallPath
    from rpcx.autograd.engine import LocalEngine
    from rpcx.backends.sockets import SocketTransport
    from rpcx.transport_kit.socket_link import SocketReader

    _wrap(SocketTransport, "send", "send", "sent")
    _wrap(SocketTransport, "read_one", None, "parsed")
    # Only reads that had to wait for bytes: the wake-up of a receiving thread.
    _wrap(SocketReader, "fill", None, "woke",
          when=lambda reader, needed, exact=False: reader.buffered < needed)
    _wrap(CallPath, "on_frame", "deliver", "delivered")
    _wrap(LocalEngine, "run_plan", "pass", "pass_end")
    if os.environ.get(_FINE):
        _instrument_finely()


def _instrument_finely() -> None:
    """``--fine``: decode, the autograd chain's handler, planning, settling, encode."""
    import rpcx._core.call_path as call_path
    from rpcx.autograd.rounds import Rounds
    from rpcx.autograd.share import Share

    _wrap(Rounds, "handle_chain", "chain", None)
    _wrap(Rounds, "handle_chain_end", "chain_end", None)
    _wrap(Share, "plans", "plan", "planned")
    _wrap(Share, "settle", "settle", "settled")
    _wrap(call_path.CallPath, "_encode", "encode", "encoded")
    _wrap(call_path, "decode_payload", "decode", "decoded")  # (as call_path calls it)


def echo(tensor: Any) -> Any:
    stamp("handler")
    return tensor


def _echo_steps(steps: int, nbytes: int = 1 << 20) -> None:
    import torch

    import rpcx

    tensor = torch.ones(nbytes // 4)
    for step in range(WARMUP + steps):
        stamp("STEP")
        rpcx.rpc_sync("w1", echo, args=(tensor,))
        stamp("STEP_END")
        if step == WARMUP - 1:
            _events.clear()


def _rnn_steps(steps: int) -> None:
    import main as rnn  # examples/rnn/main.py (on the path of both workers)
    import torch

    import rpcx.autograd as dist_autograd

    model = rnn.SplitLanguageModel("w1")
    criterion = torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(0)
    for step in range(WARMUP + steps):
        inputs, targets = rnn.batch(generator)
        with dist_autograd.context() as context_id:
            loss = criterion(model(inputs).reshape(-1, rnn.VOCAB), targets.reshape(-1))
            stamp("STEP")
            dist_autograd.backward(context_id, [loss])
            stamp("STEP_END")
        if step == WARMUP - 1:
            _events.clear()


def _worker(rank: int, workload: str, init_method: str, steps: int, out: str) -> None:
    import torch

    import rpcx

    global _side
    _side = "A" if rank == 0 else "B"
    torch.set_num_threads(1)
    if workload == "rnn_backward":  # the parameter server unpickles its modules
        sys.path.insert(0, str(HERE.parent / "examples" / "rnn"))
    _instrument()
    rpcx.init_rpc(f"w{rank}", rank=rank, world_size=2,
                  rpc_backend_options=rpcx.TensorPipeRpcBackendOptions(init_method=init_method))
    if rank == 0:
        if workload == "rnn_backward":
            _rnn_steps(steps)
        else:
            _echo_steps(steps, 16 if workload == "echo_small" else 1 << 20)
    rpcx.shutdown()
    pathlib.Path(f"{out}.{rank}").write_text(json.dumps(_events))


Event = tuple[float, str, str, float, int]


def report(events: list[Event]) -> str:
    """The most common sequence of stamps per step, with median times (us).

    ``cpu us``: where a stamp follows one made by the same thread, the median CPU time
    that thread spent between them (the rest of the gap it waited).
    """
    windows: list[list[Event]] = []
    current: list[Event] | None = None
    for event in sorted(events):
        if event[2] == "STEP":
            current = [event]
        elif current is not None:
            current.append(event)
            if event[2] == "STEP_END":
                windows.append(current)
                current = None
    by_sequence: dict[tuple[str, ...], list[list[Event]]] = collections.defaultdict(list)
    for window in windows:
        by_sequence[tuple(f"{e[1]}.{e[2]}" for e in window)].append(window)
    key, runs = max(by_sequence.items(), key=lambda item: len(item[1]))
    lines = [f"{len(runs)} of {len(windows)} steps took this sequence "
             "(A: rank 0, the caller; B: rank 1)",
             f"{'stamp':<16}{'at us':>9}{'gap us':>9}{'cpu us':>9}"]
    previous = 0.0
    for index, name in enumerate(key):
        at = statistics.median((run[index][0] - run[0][0]) * 1e6 for run in runs)
        cpu = ""
        if index and all(_same_thread(run[index - 1], run[index]) for run in runs):
            spent = statistics.median((run[index][3] - run[index - 1][3]) * 1e6 for run in runs)
            cpu = f"{spent:>9.0f}"
        lines.append(f"{name:<16}{at:>9.0f}{at - previous:>9.0f}{cpu}")
        previous = at
    return "\n".join(lines)


def _same_thread(first: Event, second: Event) -> bool:
    return len(first) > 4 and first[1] == second[1] and first[4] == second[4]


def main() -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--workload", choices=("echo_1m", "echo_small", "rnn_backward"),
                        default="echo_1m")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--fine", action="store_true",
                        help="also stamp decode, the autograd chain's handler, planning, "
                        "settling and encode")
    args = parser.parse_args()
    if args.fine:
        os.environ[_FINE] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "events")
        mp.start_processes(_worker, args=(args.workload, "file://" + os.path.join(tmp, "rdv"),
                                          args.steps, out), nprocs=2, start_method="spawn")
        events = [tuple(e) for rank in (0, 1)
                  for e in json.loads(pathlib.Path(f"{out}.{rank}").read_text())]
    print(f"{args.workload} on the default backend, {args.steps} steps")
    print(report(events))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
