"""What a sleep costs the Python that runs after it: rpcx's codec, warm and cold.

Every hop of a distributed program sleeps between messages. This times one
``decode_payload`` and one ``encode`` of a small call (one 4-element tensor) after
each of several things, in one process: nothing (a tight loop), a spin, a sleep, a
small LSTM's forward and backward, a pass over 64 MiB. The wall and CPU time of the
pair are printed (median of ``--repeats``); where the CPU time grows with the wall time
the code itself ran slower (cold caches), not waited. Usage::

    python bench/cold_caches.py [--repeats 2000] [--pause-us 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from rpcx._wire.codec import decode_payload, encode
from rpcx._wire.contexts import DecodeContext, EncodeContext


def _befores(pause: float) -> dict[str, Callable[[], None]]:
    big = torch.empty(64 << 20, dtype=torch.uint8)
    lstm = torch.nn.LSTM(64, 64)
    inputs = torch.randn(20, 4, 64)

    def spin() -> None:
        end = time.perf_counter() + pause
        while time.perf_counter() < end:
            pass

    def lstm_step() -> None:
        outputs, _ = lstm(inputs)
        outputs.sum().backward()

    return {
        "nothing": lambda: None,
        f"a {pause * 1e6:.0f} us spin": spin,
        f"a {pause * 1e6:.0f} us sleep": lambda: time.sleep(pause),
        "an LSTM forward and backward": lstm_step,
        "a 64 MiB fill_": lambda: big.fill_(1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--pause-us", type=float, default=200.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    payload = ((torch.ones(4),), {})
    frame = encode(1, 7, payload, EncodeContext(None))
    print(f"{'before each decode + encode':<32}{'wall us':>9}{'cpu us':>9}")
    for name, before in _befores(args.pause_us * 1e-6).items():
        walls, cpus = [], []
        for _ in range(args.repeats):
            before()
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            decode_payload(frame, DecodeContext(0))
            encode(1, 7, payload, EncodeContext(None))
            walls.append(time.perf_counter_ns() - wall)
            cpus.append(time.thread_time_ns() - cpu)
        print(f"{name:<32}{statistics.median(walls) / 1e3:>9.1f}"
              f"{statistics.median(cpus) / 1e3:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
