"""A worker slow to start is not taken for a dead one.

While a world starts, its workers import torch and connect (64 of them on 2 cores: a
minute and more), so a peer that says nothing then is busy, not hung; the ``ready``
barrier bounds that wait. The heartbeat watches peers only once the world is ready:
before, on a 64-worker gloo world, it took starved workers for dead and the world fell
apart ("unresponsive: silent for 10.4 s").

Here worker 1 stops itself (``SIGSTOP``) at the ``ready`` barrier for several heartbeat
timeouts, while worker 0 waits there: stopped, the kernel cannot vouch for it either,
so only the heartbeat's start decides.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rpcx.registry import DEFAULT_BACKEND
from rpcx.testing.world import free_port

BOUND = 60.0
HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT = 0.1, 0.5
STOPPED_FOR = 4 * HEARTBEAT_TIMEOUT  # the silence under test (not a wait for state)

_PROGRAM = f"""
import os, signal, sys
import rpcx
from rpcx._core import agent
from rpcx.testing import remote

rank = int(os.environ["RANK"])
barrier = agent.RpcAgent.barrier


def at_ready(self, tag, timeout):
    if tag == "ready":
        print("at-ready", flush=True)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # the test continues it
    barrier(self, tag, timeout)


agent.RpcAgent.barrier = at_ready
rpcx.init_rpc(f"w{{rank}}", rank=rank, world_size=2, backend="{DEFAULT_BACKEND}",
              rpc_backend_options=rpcx.RpcBackendOptions(
                  init_method="env://", rpc_timeout={BOUND},
                  heartbeat_interval={HEARTBEAT_INTERVAL},
                  heartbeat_timeout={HEARTBEAT_TIMEOUT}))
print(rpcx.rpc_sync(f"w{{1 - rank}}", remote.worker_name), flush=True)
rpcx.shutdown()
"""


@pytest.mark.skipif(not hasattr(os, "WUNTRACED"), reason="needs POSIX job control")
@pytest.mark.timeout(120)
def test_a_worker_stopped_before_the_world_is_ready_is_not_reported_unresponsive(
    rpcx_backend: str,
) -> None:
    if rpcx_backend != DEFAULT_BACKEND:
        pytest.skip("when the heartbeat starts is the agent's, the same on every backend: "
                    f"checked once, on the default backend ({DEFAULT_BACKEND})")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2"}
    workers = [subprocess.Popen([sys.executable, "-c", _PROGRAM], env={**env, "RANK": str(r)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for r in range(2)]
    try:
        for worker in workers:  # both reached the barrier: worker 0 waits there
            assert worker.stdout is not None
            assert worker.stdout.readline().strip() == "at-ready"
        slow = workers[1]
        os.waitpid(slow.pid, os.WUNTRACED)  # returns once it is stopped
        time.sleep(STOPPED_FOR)  # (the silence under test: nothing to wait on)
        os.kill(slow.pid, signal.SIGCONT)
        outputs = [w.communicate(timeout=BOUND) for w in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                os.kill(worker.pid, signal.SIGCONT)
                worker.kill()
                worker.wait(BOUND)
    for rank, (worker, (out, err)) in enumerate(zip(workers, outputs, strict=True)):
        assert worker.returncode == 0, err
        assert out.split()[-1] == f"w{1 - rank}", (out, err)
        assert "unresponsive" not in err, err
