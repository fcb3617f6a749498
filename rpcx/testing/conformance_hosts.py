"""Conformance: a world across two hosts, with no interface variable set.

Two network namespaces joined by a veth pair stand in for two hosts: each has its own
interfaces (loopback included) and one address on a private /24, as two machines on a
LAN see each other. Worker 0 runs in one and hosts the rendezvous on its address,
worker 1 in the other; neither has ``GLOO_SOCKET_IFNAME``, ``TP_SOCKET_IFNAME`` or any
other interface variable. They exchange calls, a tensor of 12 MiB and an RRef.

Needs root and ``ip netns`` (iproute2); skips with the reason where namespaces cannot
be made. Traffic stays inside the namespaces the test makes. :func:`two_namespaces` is
the same pair of hosts outside pytest (the benchmark's across-hosts placement): it
raises :class:`NamespacesUnavailable` where :func:`two_hosts` skips.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from rpcx.registry import DEFAULT_BACKEND
from rpcx.testing.world import free_port

# (Hosts, two_hosts, two_namespaces, NamespacesUnavailable and INTERFACE_VARIABLES are for
# rpcx's own tests and bench/, imported by name)
__all__ = ["TestTwoHosts"]

BOUND = 120.0
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
                       "MASTER_ADDR", "MASTER_PORT")

# Three workers, a world key and RPCX_ENCRYPT=1: host0 and host2 on one host (host2 is
# host0's child, so it shares its mount namespace: the same host by rpcx.hosts'
# reckoning), host1 on the other. Prints how many peers each encrypts for, and whether
# a tensor's bytes went in clear to each peer.
ENCRYPTED_WORKER = textwrap.dedent("""
    import subprocess, sys, torch, rpcx
    from rpcx.testing import remote
    rank, backend, url = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    child = None
    if rank == 0:
        child = subprocess.Popen([sys.executable, sys.argv[0], "2", backend, url])
    rpcx.init_rpc(f"host{rank}", rank=rank, world_size=3, backend=backend,
                  rpc_backend_options=rpcx.TensorPipeRpcBackendOptions(
                      init_method=url, rpc_timeout=60))
    if rank == 0:
        pattern = bytes(range(7, 71))
        big = torch.frombuffer(bytearray(pattern * 4096), dtype=torch.uint8)
        names = ("host0", "host1", "host2")
        for name in names:
            rpcx.rpc_sync(name, remote.spy_on_the_wire)
        for name in names[1:]:
            assert torch.equal(rpcx.rpc_sync(name, remote.echo, args=(big,)), big)
        peers = [rpcx.rpc_sync(name, rpcx.debug_info)["encrypted_peers"] for name in names]
        print("encrypted peers:", *peers, flush=True)
        for src, dst in ((0, 1), (1, 0), (0, 2), (2, 0)):
            parts, clear = rpcx.rpc_sync(names[src], remote.wire_has, args=(pattern, dst))
            assert parts, (src, dst)
            print(f"host{src} -> host{dst}:", "clear" if clear else "encrypted", flush=True)
    rpcx.shutdown()
    if child is not None:
        assert child.wait(60) == 0
""")

# A process with a certificate another CA signed, trusting the world's CA (so that the
# key server's own check is what refuses it): it reads rank 0's key server address from
# the store and asks it for the world key, then opens the gate.
STRANGER = textwrap.dedent("""
    import sys, time
    from rpcx._world import enrollment, rendezvous
    from rpcx.errors import AuthenticationError
    from rpcx.options import RpcBackendOptions
    url, ca, cert, key, gate = sys.argv[1:6]
    try:
        session = rendezvous.open_store(url, 1, 3, 60).prefixed("rpcx/s0")
        assert not session.wait_for([enrollment.SERVER], time.monotonic() + 60)
        mine = enrollment.resolve_certificates(RpcBackendOptions(
            tls_ca=ca, tls_cert=cert, tls_key=key))
        enrollment.fetch_key(mine, session.get(enrollment.SERVER), time.monotonic() + 30,
                             "stranger", "rank 0")
        print("stranger got the key", flush=True)
    except AuthenticationError as exc:
        print("stranger refused:", exc, flush=True)
    finally:
        open(gate, "w").close()
""")

# A worker of ENCRYPTED_WORKER's world that waits (bounded) for a file to exist before it
# starts: the STRANGER above has then tried rank 0's key server while the world forms.
GATED_WORKER = textwrap.dedent("""
    import os, runpy, sys, time
    gate = sys.argv.pop()
    deadline = time.monotonic() + 60
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)  # (another process's file: no event to wait on)
    sys.argv[0] = os.path.join(os.path.dirname(sys.argv[0]), "encrypted_worker.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
""")

WORKER = textwrap.dedent("""
    import sys, torch, rpcx
    rank, backend, url = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    rpcx.init_rpc(f"host{rank}", rank=rank, world_size=2, backend=backend,
                  rpc_backend_options=rpcx.TensorPipeRpcBackendOptions(
                      init_method=url, rpc_timeout=60))
    if rank == 0:
        big = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB
        assert torch.equal(rpcx.rpc_sync("host1", torch.add, args=(big, 1)), big + 1)
        rref = rpcx.remote("host1", torch.full, args=((3,), 7.0))
        assert rref.to_here().tolist() == [7.0, 7.0, 7.0]
        where = rpcx.rpc_sync("host1", rpcx.get_worker_info).name
        print(f"two hosts: ok ({where})", flush=True)
    rpcx.shutdown()
""")


@dataclass
class Hosts:
    """Two network namespaces standing in for two hosts, each one's address and the name
    of its end of the veth pair (what ``TP_SOCKET_IFNAME`` would name there)."""

    namespaces: tuple[str, str]
    addresses: tuple[str, str]
    interfaces: tuple[str, str]


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be made here (no ``ip`` command, not root, ...)."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def two_namespaces() -> Iterator[Hosts]:
    """Two namespaces, a veth pair between them, an address on each end; removed at the
    end. Raises :class:`NamespacesUnavailable` (with the reason) where namespaces cannot
    be made."""
    if shutil.which("ip") is None:
        raise NamespacesUnavailable("needs iproute2's ip command")
    tag = uuid.uuid4().hex[:6]
    names = (f"rpcx{tag}a", f"rpcx{tag}b")
    subnet = f"10.{random.randrange(64, 250)}.{random.randrange(1, 250)}"
    addresses = (f"{subnet}.1", f"{subnet}.2")
    links = (f"rx{tag}a", f"rx{tag}b")
    made: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for name, link, address in zip(names, links, addresses, strict=True):
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        detail = getattr(exc, "stderr", "") or exc
        raise NamespacesUnavailable(
            f"cannot make network namespaces here (needs root): {detail}") from exc
    try:
        yield Hosts(names, addresses, links)
    finally:
        for name in names:  # (the veth pair goes with them)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@contextlib.contextmanager
def two_hosts() -> Iterator[Hosts]:
    """:func:`two_namespaces` for a test: skips it (with the reason) where namespaces
    cannot be made."""
    with contextlib.ExitStack() as stack:
        try:
            hosts = stack.enter_context(two_namespaces())
        except NamespacesUnavailable as exc:
            pytest.skip(str(exc))
        yield hosts


def run_on_hosts(commands: list[tuple[str, list[str]]], env: dict[str, str]
                 ) -> list[tuple[int, str, str]]:
    """Run each ``(namespace, argv)`` in its namespace at once; each one's exit status,
    stdout and stderr, in order. Killed at ``BOUND`` seconds if still running."""
    runs = [subprocess.Popen(["ip", "netns", "exec", namespace, *argv],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
            for namespace, argv in commands]
    outputs = []
    try:
        for run in runs:
            outputs.append(run.communicate(timeout=BOUND))
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait(BOUND)
    return [(run.returncode, out, err) for run, (out, err) in zip(runs, outputs, strict=True)]


@pytest.mark.rpcx_requires("multi_host", reason="workers of this backend share one host")
class TestTwoHosts:
    """Worker 0 and worker 1 on two "hosts" (network namespaces)."""

    @pytest.fixture(name="two_hosts")
    def two_hosts_fixture(self) -> Iterator[Hosts]:
        """Two namespaces, a veth pair between them, an address on each end."""
        with two_hosts() as hosts:
            yield hosts

    def test_calls_tensors_and_rrefs_cross_hosts_with_no_interface_variable(
        self, rpcx_backend: str, two_hosts: Hosts, tmp_path: object
    ) -> None:
        script = os.path.join(str(tmp_path), "host_worker.py")
        with open(script, "w") as file:
            file.write(WORKER)
        url = f"tcp://{two_hosts.addresses[0]}:{free_port()}"
        env = {k: v for k, v in os.environ.items() if k not in INTERFACE_VARIABLES}
        results = run_on_hosts(
            [(namespace, [sys.executable, script, str(rank), rpcx_backend, url])
             for rank, namespace in enumerate(two_hosts.namespaces)], env)
        for status, out, err in results:
            assert status == 0, f"{rpcx_backend} across hosts:\n{out}\n{err}"
        assert "two hosts: ok (host1)" in results[0][1]

    def test_rpcx_encrypt_encrypts_between_hosts_and_only_seals_within_one(
        self, rpcx_backend: str, two_hosts: Hosts, tmp_path: object
    ) -> None:
        if rpcx_backend != DEFAULT_BACKEND:
            # Which pairs encrypt is decided above the transport (the world's hosts, the
            # cipher wrapping every backend alike): three processes per backend would
            # check the same code again.
            pytest.skip("the cipher wraps every backend alike: checked once, on the "
                        f"default backend ({DEFAULT_BACKEND})")
        pytest.importorskip("cryptography")
        script = os.path.join(str(tmp_path), "encrypted_worker.py")
        with open(script, "w") as file:
            file.write(ENCRYPTED_WORKER)
        url = f"tcp://{two_hosts.addresses[0]}:{free_port()}"
        env = {k: v for k, v in os.environ.items() if k not in INTERFACE_VARIABLES}
        env.update(RPCX_AUTH_KEY="two-hosts-key-0123456789abcdef", RPCX_ENCRYPT="1")
        results = run_on_hosts(
            [(namespace, [sys.executable, script, str(rank), rpcx_backend, url])
             for rank, namespace in enumerate(two_hosts.namespaces)], env)
        for status, out, err in results:
            assert status == 0, f"{rpcx_backend} encrypted across hosts:\n{out}\n{err}"
        _assert_encrypted_between_hosts_only(results[0][1])

    def test_certificates_key_a_world_across_hosts_and_a_stranger_gets_nothing(
        self, rpcx_backend: str, two_hosts: Hosts, tmp_path: object
    ) -> None:
        if rpcx_backend != DEFAULT_BACKEND:
            pytest.skip("the key server and the cipher sit above every backend alike: "
                        f"checked once, on the default backend ({DEFAULT_BACKEND})")
        pytest.importorskip("cryptography")
        from rpcx.testing.certificates import make_site

        directory = str(tmp_path)
        site = make_site(os.path.join(directory, "site"), ["member"])
        other = make_site(os.path.join(directory, "other"), ["stranger"], "another CA")
        scripts = {}
        for name, text in (("encrypted_worker.py", ENCRYPTED_WORKER),
                           ("gated_worker.py", GATED_WORKER), ("stranger.py", STRANGER)):
            scripts[name] = os.path.join(directory, name)
            with open(scripts[name], "w") as file:
                file.write(text)
        gate = os.path.join(directory, "stranger-tried")
        url = f"tcp://{two_hosts.addresses[0]}:{free_port()}"
        env = {k: v for k, v in os.environ.items() if k not in INTERFACE_VARIABLES}
        for variable in ("RPCX_AUTH_KEY", "RPCX_ENCRYPT"):  # (certificates alone)
            env.pop(variable, None)
        env.update(site.worker("member"))
        strange = other.worker("stranger")
        host0, host1 = two_hosts.namespaces
        results = run_on_hosts([
            (host0, [sys.executable, scripts["encrypted_worker.py"], "0", rpcx_backend, url]),
            (host1, [sys.executable, scripts["gated_worker.py"], "1", rpcx_backend, url,
                     gate]),
            (host1, [sys.executable, scripts["stranger.py"], url, str(site.ca),
                     strange["RPCX_TLS_CERT"], strange["RPCX_TLS_KEY"], gate]),
        ], env)
        for status, out, err in results:
            assert status == 0, f"{rpcx_backend} with certificates across hosts:\n{out}\n{err}"
        stranger = results[2][1]
        assert "stranger refused:" in stranger and "alert unknown ca" in stranger, stranger
        assert f"refused the world key to a connection from {two_hosts.addresses[1]}" in \
            results[0][2], results[0][2]
        # (certificates encrypt between hosts by default)
        _assert_encrypted_between_hosts_only(results[0][1])


def _assert_encrypted_between_hosts_only(out: str) -> None:
    """ENCRYPTED_WORKER's rank 0 printed that host0 and host2 encrypt for host1 only,
    host1 for both, and that no tensor crossed between hosts in clear."""
    assert "encrypted peers: 1 2 1" in out, out
    for pair, how in (("host0 -> host1", "encrypted"), ("host1 -> host0", "encrypted"),
                      ("host0 -> host2", "clear"), ("host2 -> host0", "clear")):
        assert f"{pair}: {how}" in out, out
