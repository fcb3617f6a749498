"""Per-iteration time of the RPC tutorial's distributed RNN, rpcx against torch.

The program is the second half of the "Getting started with Distributed RPC Framework"
tutorial (see ``rnn_model.py``): a parameter server holds the embedding table and the
decoder, the trainer runs the LSTM, and every iteration is a forward pass through two
remote calls, a distributed backward pass and a ``DistributedOptimizer`` step. The same
code runs on torch.distributed.rpc and on each rpcx backend; the trainer reports
milliseconds per iteration, the median of alternating rounds (ratio >1: faster than
torch), written to ``bench/results/rnn-<stamp>.json``. This is ``bench/run.py --only
rnn``. Usage::

    python bench/bench_rnn.py [--systems torch,gloo,loopback] [--iterations 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys

import run
import systems


def main(argv: list[str] | None = None) -> int:
    """Translate this script's options into ``run.py``'s and run the RNN workload."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--systems", default=systems.default_systems())
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternate the systems this many times; report medians")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    forwarded = ["--only", "rnn", "--systems", args.systems, "--rounds", str(args.rounds),
                 "--rnn-iterations", str(args.iterations), "--json-prefix", "rnn-"]
    return run.main(forwarded + (["--quick"] if args.quick else []))


if __name__ == "__main__":
    sys.exit(main())
