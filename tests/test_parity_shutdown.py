"""Graceful shutdown past its timeout, where rpcx deliberately differs from torch.

torch's test_wait_all_workers_timeout and test_shutdown_errors expect a graceful
``shutdown(timeout=t)`` that cannot finish in time to raise (after closing locally).
rpcx closes locally and logs a WARNING instead (docs/migration.md says why). What
torch's tests protect, that the program learns the shutdown was not graceful and that
nothing hangs, is checked here on every selected backend.
"""

from __future__ import annotations

import logging
import time
import uuid

import pytest

import rpcx
from rpcx.testing import remote
from rpcx.testing.world import world


def test_graceful_shutdown_past_its_timeout_warns_and_closes(
    rpcx_backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    key = uuid.uuid4().hex
    with world(rpcx_backend, size=2) as w, caplog.at_level(logging.WARNING, logger="rpcx.agent"):
        pending = rpcx.rpc_async("worker1", remote.wait_for_release, args=(key, 3.0))
        started = time.monotonic()
        rpcx.shutdown(graceful=True, timeout=0.2)  # our own call cannot finish in time
        elapsed = time.monotonic() - started
        warnings = [r.getMessage() for r in caplog.records
                    if r.levelno == logging.WARNING and r.name == "rpcx.agent"]
        assert any("graceful shutdown incomplete" in m and "1 calls still pending" in m
                   for m in warnings), warnings
        # Closed locally all the same: the call is cancelled, later calls refused.
        with pytest.raises(rpcx.RpcShutdownError, match="cancelled"):
            pending.wait()
        with pytest.raises(rpcx.RpcShutdownError, match="has shut down"):
            rpcx.rpc_sync("worker1", remote.add, args=(1, 1))
        # A generous bound: the deadline plus the goodbye's own minimum (2 s) and slack.
        assert elapsed < 15.0, elapsed
        w.close()
