"""Certificates as the root of the world key (rpcx._world.enrollment): which settings
are taken, and what a key server hands to whom. The key server is hit here with what a
stranger at its port could send: a certificate from another CA, none, plain bytes; the
conformance kit's ``TestCertificates`` runs whole worlds on every backend."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch._C._distributed_c10d import HashStore

import rpcx
from rpcx._wire import auth, cipher
from rpcx._world import enrollment
from rpcx._world.dynamic import DynamicWorld
from rpcx._world.store import BoundedStore
from rpcx.errors import AuthenticationError, RpcError
from rpcx.options import RpcBackendOptions
from rpcx.testing.certificates import Site, make_site

pytestmark = pytest.mark.skipif(not cipher.aead_available(),
                                reason="making certificates needs 'cryptography'")
BOUND = 10.0
KEY = bytes(range(32))


def _deadline() -> float:
    return time.monotonic() + BOUND


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> tuple[Site, Site]:
    directory = tmp_path_factory.mktemp("certificates")
    return (make_site(directory / "site", ["w0", "w1"]),
            make_site(directory / "other", ["stranger"], "another CA"))


def _certificates(site: Site, name: str) -> enrollment.Certificates:
    variables = site.worker(name)
    found = enrollment.resolve_certificates(RpcBackendOptions(
        tls_ca=variables["RPCX_TLS_CA"], tls_cert=variables["RPCX_TLS_CERT"],
        tls_key=variables["RPCX_TLS_KEY"]))
    assert found is not None
    return found


@pytest.fixture
def server(sites: tuple[Site, Site]) -> Iterator[enrollment.KeyServer]:
    served = enrollment.KeyServer(_certificates(sites[0], "w0"), KEY, "127.0.0.1", "w0")
    yield served
    served.close()


@pytest.fixture
def store() -> BoundedStore:
    return BoundedStore(HashStore(), "an in-process store")


def _clear(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in (enrollment.CA_ENV, enrollment.CERT_ENV, enrollment.KEY_ENV):
        monkeypatch.delenv(variable, raising=False)


def test_certificates_come_from_the_options_or_the_environment(
        sites: tuple[Site, Site], monkeypatch: pytest.MonkeyPatch) -> None:
    _clear(monkeypatch)
    assert enrollment.resolve_certificates(RpcBackendOptions()) is None
    site, _ = sites
    for variable, value in site.worker("w1").items():
        monkeypatch.setenv(variable, value)
    found = enrollment.resolve_certificates(RpcBackendOptions())
    assert found is not None and found.cert.endswith("w1.crt")
    # an option wins over its variable
    chosen = enrollment.resolve_certificates(RpcBackendOptions(
        tls_cert=str(site.directory / "w0.crt"), tls_key=str(site.directory / "w0.key")))
    assert chosen is not None and chosen.cert.endswith("w0.crt") and chosen.ca == str(site.ca)


def test_certificates_that_are_incomplete_or_do_not_load_are_refused(
        sites: tuple[Site, Site], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _clear(monkeypatch)
    site, other = sites
    with pytest.raises(ValueError, match="RPCX_TLS_CA and RPCX_TLS_KEY"):
        enrollment.resolve_certificates(RpcBackendOptions(tls_cert=str(site.ca)))
    broken = tmp_path / "broken.pem"
    broken.write_text("not a certificate")
    with pytest.raises(ValueError, match=r"do not load .*broken\.pem"):
        enrollment.resolve_certificates(RpcBackendOptions(
            tls_ca=str(site.ca), tls_cert=str(broken), tls_key=str(site.directory / "w0.key")))
    with pytest.raises(ValueError, match="do not load"):  # a key that is not the cert's
        enrollment.resolve_certificates(RpcBackendOptions(
            tls_ca=str(site.ca), tls_cert=str(site.directory / "w0.crt"),
            tls_key=str(other.directory / "stranger.key")))


def test_certificates_turn_encryption_on_between_hosts_unless_told_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cipher.ENCRYPT_ENV, raising=False)
    assert cipher.resolve_encrypt(RpcBackendOptions(), default="hosts") == "hosts"
    assert cipher.resolve_encrypt(RpcBackendOptions(encrypt=False), default="hosts") is None
    monkeypatch.setenv(cipher.ENCRYPT_ENV, "0")
    assert cipher.resolve_encrypt(RpcBackendOptions(), default="hosts") is None


def test_a_key_and_certificates_together_are_refused(
        sites: tuple[Site, Site], monkeypatch: pytest.MonkeyPatch) -> None:
    _clear(monkeypatch)
    variables = sites[0].worker("w0")
    options = rpcx.TensorPipeRpcBackendOptions(
        init_method="file:///nonexistent/never-opened", auth_key="a-shared-key-0123456789",
        tls_ca=variables["RPCX_TLS_CA"], tls_cert=variables["RPCX_TLS_CERT"],
        tls_key=variables["RPCX_TLS_KEY"])
    with pytest.raises(RpcError, match=r"both a world key .* and certificates"):
        rpcx.init_rpc("w0", backend="loopback", rank=0, world_size=1,
                      rpc_backend_options=options)


def test_a_worker_of_the_site_gets_the_key(sites: tuple[Site, Site],
                                           server: enrollment.KeyServer) -> None:
    assert enrollment.fetch_key(_certificates(sites[0], "w1"), server.address, _deadline(),
                                "w1", "rank 0") == KEY
    assert server.served == 1


def _raw_connection(server: enrollment.KeyServer) -> socket.socket:
    where = json.loads(server.address)
    return socket.create_connection((where["host"], where["port"]), timeout=BOUND)


def _received(connection: socket.socket) -> bytes:
    """What the server sends before it closes (nothing, for a stranger)."""
    data = b""
    try:
        while chunk := connection.recv(4096):
            data += chunk
    except OSError:
        pass
    return data


def test_strangers_at_a_key_server_get_nothing_and_it_goes_on(
        sites: tuple[Site, Site], server: enrollment.KeyServer,
        caplog: pytest.LogCaptureFixture) -> None:
    site, other = sites
    caplog.set_level(logging.WARNING, logger="rpcx.auth")
    # a TLS client whose certificate another CA signed
    with pytest.raises(AuthenticationError,
                       match="certificate verify failed: self-signed certificate"):
        enrollment.fetch_key(_certificates(other, "stranger"), server.address, _deadline(),
                             "stranger", "rank 0")
    # a TLS client that trusts anything and shows no certificate
    anything = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anything.check_hostname = False
    anything.verify_mode = ssl.CERT_NONE
    with _raw_connection(server) as connection:
        try:
            with anything.wrap_socket(connection) as tls:
                assert enrollment._GREETING not in _received(tls)
        except ssl.SSLError:
            pass  # (refused during the handshake)
    # plain bytes, and random ones
    rng = random.Random(53)
    for payload in (b"GET / HTTP/1.1\r\n\r\n", bytes(rng.randrange(256) for _ in range(600))):
        with _raw_connection(server) as connection:
            connection.sendall(payload)
            assert _received(connection) == b""
    # the server still hands the key to a worker of the site
    assert enrollment.fetch_key(_certificates(site, "w1"), server.address, _deadline(),
                                "w1", "rank 0") == KEY
    assert server.wait_refused(4, BOUND) and server.served == 1
    assert any("refused the world key" in record.getMessage()
               and enrollment.CA_ENV in record.getMessage() for record in caplog.records)


def test_a_client_that_trusts_the_site_but_shows_another_cas_certificate_is_refused(
        sites: tuple[Site, Site], server: enrollment.KeyServer) -> None:
    site, other = sites
    mixed = enrollment.Certificates(ca=str(site.ca),
                                    cert=str(other.directory / "stranger.crt"),
                                    key=str(other.directory / "stranger.key"))
    with pytest.raises(AuthenticationError, match="did not hand over the world key"):
        enrollment.fetch_key(mixed, server.address, _deadline(), "stranger", "rank 0")
    assert server.wait_refused(1, BOUND) and server.served == 0


def test_a_worker_refuses_a_key_server_of_another_ca(sites: tuple[Site, Site]) -> None:
    site, other = sites
    impostor = enrollment.KeyServer(_certificates(other, "stranger"), b"\x01" * 32,
                                    "127.0.0.1", "impostor")
    try:
        with pytest.raises(AuthenticationError, match="certificate verify failed"):
            enrollment.fetch_key(_certificates(site, "w1"), impostor.address, _deadline(),
                                 "w1", "rank 0")
        assert impostor.served == 0
    finally:
        impostor.close()


def test_an_address_that_is_none_is_named(sites: tuple[Site, Site]) -> None:
    with pytest.raises(AuthenticationError, match="is not one"):
        enrollment.fetch_key(_certificates(sites[0], "w1"), b"\x80pickle", _deadline(),
                             "w1", "rank 0")


def test_in_a_world_of_fixed_size_rank_0_draws_the_key_and_every_rank_gets_it(
        sites: tuple[Site, Site], store: BoundedStore) -> None:
    site, _ = sites
    got: dict[int, bytes] = {}

    def other() -> None:
        got[1], server = enrollment.static_world_key(
            store, 1, _certificates(site, "w1"), "127.0.0.1", BOUND, "w1")
        assert server is None

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    got[0], server = enrollment.static_world_key(
        store, 0, _certificates(site, "w0"), "127.0.0.1", BOUND, "w0")
    thread.join(BOUND)
    assert server is not None
    server.close()
    assert got[0] == got[1] and len(got[0]) == enrollment.KEY_BYTES
    with pytest.raises(ConnectionRefusedError):  # closed: nothing listens any more
        _raw_connection(server).close()


@contextlib.contextmanager
def _listed_server(store: BoundedStore, rank: int, site: Site, key: bytes
                   ) -> Iterator[enrollment.KeyServer]:
    """A key server of ``site``'s ``w0`` handing out ``key``, listed for ``rank``."""
    server = enrollment.KeyServer(_certificates(site, "w0"), key, "127.0.0.1", "w0")
    try:
        enrollment.list_server(store, rank, server.address, BOUND)
        yield server
    finally:
        server.close()


def test_a_dynamic_world_is_founded_then_joined_through_a_listed_server(
        sites: tuple[Site, Site], store: BoundedStore) -> None:
    site, _ = sites
    key = enrollment.dynamic_world_key(store, _certificates(site, "w0"), BOUND, "w0",
                                       has_roster=False)
    with _listed_server(store, 0, site, key):
        assert enrollment.dynamic_world_key(store, _certificates(site, "w1"), BOUND, "w1",
                                            has_roster=True) == key


def test_the_last_member_to_leave_takes_the_key_and_the_next_founds_anew(
        sites: tuple[Site, Site], store: BoundedStore) -> None:
    first = DynamicWorld(store, "w0", 0, BOUND)
    assert not first.has_members()
    first.use_seal(auth.ValueSeal(b"k" * 32))
    first.enter(first.roster())
    enrollment.list_server(first.store, 0, "{}", BOUND)
    assert first.has_members()
    first.leave()
    assert not first.has_members()  # (emptied, not a roster sealed under a lost key)
    assert enrollment._servers(first.store, BOUND, "w1") == {}
    later = DynamicWorld(store, "w1", 1, BOUND)
    later.use_seal(auth.ValueSeal(b"j" * 32))  # a new key
    assert later.roster() == {}
    later.enter(later.roster())
    assert later.roster() == {1: "w1"}


def test_a_list_of_servers_that_is_none_is_never_read_as_nobody_left(
        sites: tuple[Site, Site], store: BoundedStore) -> None:
    world = DynamicWorld(store, "w0", 0, BOUND)
    world.store.set(enrollment.SERVERS, b"{}")  # members (a roster) but no servers
    world.store.set("roster", b"sealed under a key this worker lacks")
    assert world.has_members()
    with pytest.raises(AuthenticationError, match="list no key server"):
        enrollment.dynamic_world_key(world.store, _certificates(sites[0], "w1"), BOUND,
                                     "w1", has_roster=True)
    world.store.set(enrollment.SERVERS, b"\x80 not json")
    with pytest.raises(AuthenticationError, match="is not one"):
        enrollment.dynamic_world_key(world.store, _certificates(sites[0], "w1"), BOUND,
                                     "w1", has_roster=True)


def test_a_joiner_passes_over_a_member_whose_server_is_gone(
        sites: tuple[Site, Site], store: BoundedStore) -> None:
    site, _ = sites
    with socket.socket() as gone:  # a port nobody listens on once closed
        gone.bind(("127.0.0.1", 0))
        port = gone.getsockname()[1]
    enrollment.list_server(store, 0, json.dumps({"host": "127.0.0.1", "port": port}), BOUND)
    with pytest.raises(RpcError, match="rank 0's key server") as caught:
        enrollment.dynamic_world_key(store, _certificates(site, "w1"), 1.0, "w1",
                                     has_roster=True)
    assert not isinstance(caught.value, AuthenticationError)  # unreachable, not refused
    with _listed_server(store, 1, site, KEY):
        assert enrollment.dynamic_world_key(store, _certificates(site, "w1"), BOUND, "w1",
                                            has_roster=True) == KEY


def test_a_dynamic_world_without_key_servers_is_named(
        sites: tuple[Site, Site], store: BoundedStore) -> None:
    with pytest.raises(AuthenticationError, match="list no key server"):
        enrollment.dynamic_world_key(store, _certificates(sites[0], "w1"), BOUND, "w1",
                                     has_roster=True)


def test_idle_connections_delay_a_worker_but_do_not_turn_it_away(
        sites: tuple[Site, Site], server: enrollment.KeyServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # every slot taken by a stranger that says nothing: the worker waits in the backlog
    # until a stranger's handshake time is up, then gets the key
    monkeypatch.setattr(enrollment, "_HANDSHAKE_TIMEOUT", 0.5)
    strangers = [_raw_connection(server) for _ in range(enrollment._MOST_AT_ONCE + 4)]
    try:
        assert enrollment.fetch_key(_certificates(sites[0], "w1"), server.address,
                                    _deadline(), "w1", "rank 0") == KEY
    finally:
        for stranger in strangers:
            stranger.close()


def test_an_intermediate_ca_admits_its_own_workers_only(tmp_path: Path) -> None:
    root = make_site(tmp_path / "root", ["direct"], "site root")
    job = make_site(tmp_path / "job", ["w0", "w1"], "the job's intermediate", parent=root)
    served = enrollment.KeyServer(_certificates(job, "w0"), KEY, "127.0.0.1", "w0")
    try:
        assert enrollment.fetch_key(_certificates(job, "w1"), served.address, _deadline(),
                                    "w1", "rank 0") == KEY
        # signed by the site's root, not by the job's intermediate: refused
        outsider = enrollment.Certificates(ca=str(job.ca),
                                           cert=str(root.directory / "direct.crt"),
                                           key=str(root.directory / "direct.key"))
        with pytest.raises(AuthenticationError, match="did not hand over"):
            enrollment.fetch_key(outsider, served.address, _deadline(), "direct", "rank 0")
    finally:
        served.close()
