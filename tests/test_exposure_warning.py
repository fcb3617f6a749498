"""Without authentication, a world that listens beyond loopback says so once at init_rpc."""

from __future__ import annotations

import logging
import socket

import pytest

import rpcx
from rpcx import api
from rpcx.hosts import source_address
from rpcx.registry import resolve_backend
from rpcx.testing.world import free_port, world


def _non_loopback_address() -> str:
    address = source_address(socket.AF_INET, "192.0.2.1")  # TEST-NET-1: routing only
    if address is None or address.startswith("127."):
        pytest.skip("this host has no route beyond loopback")
    return address


def test_loopback_and_file_worlds_are_not_reported() -> None:
    gloo, loopback = resolve_backend("gloo"), resolve_backend("loopback")
    assert api._exposed_address("tcp://127.0.0.1:29500", gloo) is None
    assert api._exposed_address("tcp://localhost:29500", gloo) is None
    assert api._exposed_address("file:///tmp/rendezvous", loopback) is None


def test_a_world_on_a_network_address_is_exposed() -> None:
    address = _non_loopback_address()
    gloo = resolve_backend("gloo")
    assert api._exposed_address(f"tcp://{address}:29500", gloo) == address
    assert api._exposed_address("file:///tmp/r", gloo) is None  # a one-host launch


def test_the_warning_is_given_once_and_names_the_address(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    address = _non_loopback_address()
    monkeypatch.setattr(api, "_exposure_warned", False)
    gloo = resolve_backend("gloo")
    with caplog.at_level(logging.WARNING, logger="rpcx"):
        api._warn_if_exposed("w0", f"tcp://{address}:29500", gloo)
        api._warn_if_exposed("w0", f"tcp://{address}:29500", gloo)
    warnings = [r.getMessage() for r in caplog.records
                if "without authentication" in r.getMessage()]
    assert len(warnings) == 1 and address in warnings[0] and "RPCX_AUTH_KEY" in warnings[0]


def test_a_world_with_a_key_is_not_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # init_rpc stops at the rendezvous (nobody listens there), after the warning's place.
    address = _non_loopback_address()
    monkeypatch.setattr(api, "_exposure_warned", False)
    monkeypatch.setenv("RPCX_AUTH_KEY", "a-key-for-this-test-0123456789")
    options = rpcx.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{address}:{free_port()}", rpc_timeout=0.5)
    with caplog.at_level(logging.WARNING, logger="rpcx"), pytest.raises(rpcx.RpcError):
        rpcx.init_rpc("w0", backend="gloo", rank=1, world_size=2, rpc_backend_options=options)
    assert not [r for r in caplog.records if "without authentication" in r.getMessage()]


def test_a_loopback_world_starts_without_the_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(api, "_exposure_warned", False)
    with caplog.at_level(logging.WARNING, logger="rpcx"), world("loopback", size=2):
        pass
    assert not [r for r in caplog.records if "without authentication" in r.getMessage()]
