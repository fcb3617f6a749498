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


class _Recorder:
    """Stands in for torch's gloo device factory: records how each device was asked for."""

    def __init__(self) -> None:
        self.calls: list[dict[str, str]] = []

    def create_device(self, **kwargs: str) -> dict[str, str]:
        self.calls.append(kwargs)
        return kwargs

    def create_default_device(self) -> dict[str, str]:
        self.calls.append({})
        return {}


def _gloo_devices(monkeypatch: pytest.MonkeyPatch, init_method: str, **options: str | None
                  ) -> list[dict[str, str]]:
    from types import SimpleNamespace

    from rpcx.backends import gloo

    recorder = _Recorder()
    monkeypatch.setattr(gloo.dist, "ProcessGroupGloo", recorder)
    ctx = SimpleNamespace(options=SimpleNamespace(**options), init_method=init_method)
    gloo._devices(ctx)  # type: ignore[arg-type]
    return recorder.calls


def test_gloo_device_follows_option_then_variable_then_route(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """rpcx builds gloo's options itself, so torch never reads $GLOO_SOCKET_IFNAME for it:
    the backend must (one device per name, as torch does), below the ``interface`` option
    and above the address that routes to the rendezvous host."""
    local = "tcp://127.0.0.1:29500"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert _gloo_devices(monkeypatch, local) == [{"hostname": "127.0.0.1"}]
    assert _gloo_devices(monkeypatch, local, hostname="10.1.2.3") == [{"hostname": "10.1.2.3"}]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1,eth2")
    assert _gloo_devices(monkeypatch, local) == [{"interface": "eth1"}, {"interface": "eth2"}]
    assert _gloo_devices(monkeypatch, local, interface="ib0") == [{"interface": "ib0"}]
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert _gloo_devices(monkeypatch, "file:///tmp/x") == [{}]  # torch's default: host name


def test_gloo_socket_ifname_reaches_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: a world on gloo asked for an interface this host lacks fails, naming it
    (the variable was ignored before: the world started on the routed address)."""
    import rpcx
    from rpcx.testing.world import free_port

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "rpcx-nonesuch0")
    options = rpcx.RpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}",
                                     rpc_timeout=20)
    with pytest.raises(Exception, match="rpcx-nonesuch0"):
        rpcx.init_rpc("solo", backend="gloo", rank=0, world_size=1,
                      rpc_backend_options=options)
    # The failed start left nothing behind: a world starts here again.
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    options.init_method = f"tcp://127.0.0.1:{free_port()}"
    rpcx.init_rpc("solo", backend="gloo", rank=0, world_size=1, rpc_backend_options=options)
    try:
        assert rpcx.rpc_sync("solo", max, args=(1, 2)) == 2
    finally:
        rpcx.shutdown()


def test_tensorpipe_interface_is_set_only_while_the_agent_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorPipe reads $TP_SOCKET_IFNAME when its agent is built; rpcx sets it for that
    moment only, so processes started later and a later world towards another host do
    not inherit this world's interface. A value the user set is left as it is."""
    from types import SimpleNamespace

    tensorpipe = pytest.importorskip("rpcx.backends.tensorpipe")
    ctx = SimpleNamespace(init_method="tcp://127.0.0.1:29500", names=["w0"], rank=0)
    loopback = interface_with("127.0.0.1")
    assert loopback is not None
    monkeypatch.delenv("TP_SOCKET_IFNAME", raising=False)
    with tensorpipe._interface_for_agent(ctx):
        assert os.environ.get("TP_SOCKET_IFNAME") == loopback
    assert "TP_SOCKET_IFNAME" not in os.environ
    with pytest.raises(RuntimeError), tensorpipe._interface_for_agent(ctx):
        raise RuntimeError("the agent failed to start")
    assert "TP_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("TP_SOCKET_IFNAME", "eth7")
    with tensorpipe._interface_for_agent(ctx):
        assert os.environ["TP_SOCKET_IFNAME"] == "eth7"
    assert os.environ["TP_SOCKET_IFNAME"] == "eth7"
