"""rpcx.hosts: the address a transport binds, and which peers share this host."""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest

from rpcx.hosts import address_towards, host_identity, interface_with


def test_a_local_rendezvous_gives_its_loopback_address() -> None:
    assert address_towards("tcp://127.0.0.1:29500") == "127.0.0.1"
    assert ipaddress.ip_address(address_towards("tcp://localhost:29500") or "").is_loopback


def test_env_rendezvous_reads_master_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert address_towards("env://") == "127.0.0.1"
    monkeypatch.delenv("MASTER_ADDR")
    assert address_towards("env://") is None


def test_unknown_host_or_scheme_gives_none() -> None:
    assert address_towards("file:///tmp/rendezvous") is None
    assert address_towards("tcp://no-such-host.invalid:1") is None


def test_a_remote_rendezvous_gives_this_hosts_routing_address() -> None:
    # TEST-NET-3: nothing answers, but the kernel names the source address of its route.
    address = address_towards("tcp://203.0.113.7:29500")
    if address is None:
        pytest.skip("this machine has no route off the host")
    assert not ipaddress.ip_address(address).is_loopback
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))  # one of this host's own addresses


def test_host_identity_names_host_boot_and_mounts() -> None:
    identity = host_identity()
    assert identity == host_identity()
    assert identity.startswith(f"{os.uname().nodename}|")
    if os.path.exists("/proc/sys/kernel/random/boot_id"):
        with open("/proc/sys/kernel/random/boot_id") as file:
            assert file.read().strip() in identity
    if os.path.exists("/proc/self/ns/mnt"):
        assert identity.endswith(os.readlink("/proc/self/ns/mnt"))


def test_the_interface_holding_an_address_is_found() -> None:
    assert interface_with("127.0.0.1") == "lo"
    routed = address_towards("tcp://192.0.2.1:29500")  # TEST-NET-1: a route, no traffic
    if routed is None:
        pytest.skip("no route off this host")
    name = interface_with(routed)
    assert name is not None and name != "lo"
    assert any(n == name for _, n in socket.if_nameindex())
    assert interface_with("192.0.2.254") is None  # nobody here holds it
    assert interface_with("not an address") is None
