"""Test configuration: the rpcx conformance fixtures (--rpcx-backend, rpc_world), and a
loopback rendezvous URL of either network scheme."""

from __future__ import annotations

import pytest

from rpcx.testing.world import free_port

pytest_plugins = ["rpcx.testing.fixtures"]


@pytest.fixture(params=["tcp", "env"])
def loopback_rendezvous(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
                        ) -> tuple[str, int]:
    """``(init_method, port)`` on 127.0.0.1 and a free port: ``tcp://127.0.0.1:port``,
    or ``env://`` with ``MASTER_ADDR``/``MASTER_PORT`` set for the test."""
    port = free_port()
    if request.param == "env":
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        return "env://", port
    return f"tcp://127.0.0.1:{port}", port
