"""A worker started without its peers: the right error, at its timeout, and quiet.

Rank 0 alone waits for the others at the store it hosts and names the ranks missing
(torch's store used to time out first, and closing its listener again hid its error
behind ``EBADF``). Rank 1 alone waits for rank 0's store itself, within its timeout
(torch's client took two tries and a pause: 2.2 times it), names the address and what
to check, and no c10d retry line or C++ stack reaches the terminal.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rpcx.registry import resolve_backend
from rpcx.testing.world import free_port

TIMEOUT = 2.0  # the lone worker's rpc_timeout
# From init_rpc's call to its error (the backend importing, the world failing) on a
# busy machine; torch's client alone took 2 x TIMEOUT + 10 s.
SLACK = 6.0

_ALONE = """
import os, sys, time
import rpcx

rank, url, backend, timeout = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
started = time.monotonic()
try:
    rpcx.init_rpc(f"w{rank}", backend=backend, rank=rank, world_size=2,
                  rpc_backend_options=rpcx.RpcBackendOptions(init_method=url,
                                                            rpc_timeout=timeout))
except rpcx.RpcError as exc:
    print(type(exc).__name__, round(time.monotonic() - started, 2), exc, flush=True)
else:
    print("joined", flush=True)
"""

# What torch's C++ side writes when its store client retries or its server times out.
_NOISE = ("c10d", ".cpp:", "Exception raised from", "frame #", "Bad file descriptor",
          "DistStoreError")


def _alone(rank: int, url: str, backend: str, env: dict[str, str] | None = None
           ) -> tuple[str, float, str, str]:
    done = subprocess.run(
        [sys.executable, "-c", _ALONE, str(rank), url, backend, str(TIMEOUT)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kind, seconds, message = done.stdout.strip().split(" ", 2)
    return kind, float(seconds), message, done.stderr


def _multi_process(backend: str) -> None:
    caps = resolve_backend(backend).capabilities
    if not caps.multi_process or caps.in_process:
        pytest.skip("an in-process backend's workers are threads of one process")


@pytest.mark.parametrize("scheme", ["tcp", "env"])
def test_rank_0_alone_names_the_ranks_missing_at_its_timeout(
    rpcx_backend: str, scheme: str
) -> None:
    _multi_process(rpcx_backend)
    port = free_port()
    env = None
    url = f"tcp://127.0.0.1:{port}"
    if scheme == "env":
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        url = "env://"
    kind, seconds, message, stderr = _alone(0, url, rpcx_backend, env)
    assert kind == "RpcTimeoutError", (kind, message)
    assert "missing: ranks 1" in message, message
    assert "'w0'" in message, message
    assert TIMEOUT <= seconds < TIMEOUT + SLACK, (seconds, message)
    assert not [n for n in _NOISE if n in stderr + message], stderr[-3000:]


def test_rank_1_alone_names_the_store_address_within_its_timeout(rpcx_backend: str) -> None:
    _multi_process(rpcx_backend)
    port = free_port()
    kind, seconds, message, stderr = _alone(1, f"tcp://127.0.0.1:{port}", rpcx_backend)
    assert kind == "RpcTimeoutError", (kind, message)
    assert f"127.0.0.1:{port}" in message and "rank 0" in message, message
    assert TIMEOUT <= seconds < TIMEOUT + SLACK, (seconds, message)
    assert not [n for n in _NOISE if n in stderr + message], stderr[-3000:]
