"""The RPC microbenchmarks alone: rpcx backends against torch.distributed.rpc.

Runs the two-worker workloads of ``bench/run.py`` (small ``rpc_sync`` round trip, small
``rpc_async`` throughput, 1 MiB and 64 MiB tensor echoes, ``remote().to_here()``, an
RRef proxy call) and nothing else; every option of ``run.py`` applies (a later
``--only`` wins). Results print as a table with each figure's ratio to
torch.distributed.rpc (>1 is faster) and go to ``bench/results/<stamp>.json``. Usage::

    python bench/bench_rpc.py [--systems torch,gloo,tensorpipe,loopback] [--quick]
                              [--rounds 3]
"""

from __future__ import annotations

import sys

import run

MICRO = "rpc_sync,rpc_async,echo_1m,echo_64m,remote,rref_proxy"


def main(argv: list[str] | None = None) -> int:
    """``run.py --only <the microbenchmarks>`` plus the given arguments."""
    return run.main(["--only", MICRO, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
