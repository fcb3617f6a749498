"""Conformance: worlds keyed by certificates (``RPCX_TLS_CA``, ``RPCX_TLS_CERT``,
``RPCX_TLS_KEY``, or the ``tls_*`` options) instead of a shared key.

One worker draws the world's key and hands it over mutual TLS to each worker whose
certificate the CA signed (:mod:`rpcx._world.enrollment`). What must hold: such a world
forms, calls, and encrypts as one with a shared key does; a worker whose certificate
another CA signed gets no key, so it never joins (its ``init_rpc`` fails naming the
certificate check), nothing of it runs, and a dynamic world goes on and admits genuine
workers after it; a worker with a shared key instead, or neither, is refused too.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import rpcx
from rpcx._wire import cipher
from rpcx.errors import RpcError
from rpcx.testing import remote
from rpcx.testing.certificates import Site, make_site
from rpcx.testing.conformance_auth import _Outsider
from rpcx.testing.conformance_cipher import PATTERN, patterned
from rpcx.testing.fixtures import WorldKeeper
from rpcx.testing.world import DynamicWorld, _options, dynamic_world, world

__all__ = ["TestCertificates"]

BOUND = 60.0
SHORT = 8.0  # rpc_timeout of a worker whose world cannot form (it waits that long)
_VARIABLES = ("RPCX_AUTH_KEY", cipher.ENCRYPT_ENV, "RPCX_TLS_CA", "RPCX_TLS_CERT",
              "RPCX_TLS_KEY")


def certificate_options(site: Site, name: str, trusting: Site | None = None
                        ) -> dict[str, str]:
    """The ``tls_*`` options of the worker ``site`` issued ``name`` to; ``trusting``:
    with another site's CA file instead of its own (a stranger that trusts the world's
    CA, so that the world's key server is what refuses it)."""
    variables = site.worker(name)
    return {"tls_ca": str((trusting or site).ca), "tls_cert": variables["RPCX_TLS_CERT"],
            "tls_key": variables["RPCX_TLS_KEY"]}


@pytest.mark.skipif(not cipher.aead_available(),
                    reason="certificates and encryption need the 'cryptography' package")
class TestCertificates:
    """Workers keyed by certificates of one site's CA; strangers by another's."""

    @pytest.fixture
    def sites(self, rpc_world_keeper: WorldKeeper, monkeypatch: pytest.MonkeyPatch
              ) -> Iterator[tuple[Site, Site]]:
        """The world's site (``member``, ``late1``, ``late2``) and another
        (``stranger``); no key or certificate in the environment (the options decide),
        and no other world in this process meanwhile."""
        for variable in _VARIABLES:
            monkeypatch.delenv(variable, raising=False)
        rpc_world_keeper.close()
        with tempfile.TemporaryDirectory(prefix="rpcx-certificates-") as directory:
            yield (make_site(Path(directory) / "site", ["member", "late1", "late2"]),
                   make_site(Path(directory) / "other", ["stranger"], "another CA"))

    def test_a_world_keyed_by_certificates_forms_calls_and_encrypts(
            self, rpcx_backend: str, sites: tuple[Site, Site]) -> None:
        site, _ = sites
        with world(rpcx_backend, size=3, rpc_timeout=BOUND, encrypt="always",
                   **certificate_options(site, "member")):
            names = [f"worker{rank}" for rank in range(3)]
            for name in names:
                rpcx.rpc_sync(name, remote.spy_on_the_wire)
            tensor = patterned(4096)
            assert torch.equal(rpcx.rpc_sync("worker1", remote.echo, args=(tensor,)), tensor)
            relayed = rpcx.rpc_sync("worker2", remote.call_and_wait, args=(
                rpcx.rpc_async, "worker1", remote.echo, (tensor,)), timeout=BOUND)
            assert torch.equal(relayed, tensor)
            for name in names:
                info = rpcx.rpc_sync(name, rpcx.debug_info)
                assert info["authenticated"] and info["encrypted_peers"] == 2, (name, info)
                parts, found = rpcx.rpc_sync(name, remote.wire_has, args=(PATTERN,))
                assert parts > 0 and not found, f"{name} sent the tensor's bytes in clear"

    def test_without_encrypt_frames_are_authenticated_between_hosts_only(
            self, rpcx_backend: str, sites: tuple[Site, Site]) -> None:
        # certificates turn encryption on between hosts by default: on one host, the
        # world's key seals every frame and nothing is encrypted
        site, _ = sites
        with world(rpcx_backend, size=2, rpc_timeout=BOUND,
                   **certificate_options(site, "member")):
            info = rpcx.rpc_sync("worker1", rpcx.debug_info)
            assert info["authenticated"] and info["encrypted_peers"] == 0, info
            assert rpcx.rpc_sync("worker1", remote.add, args=(2, 3)) == 5

    @pytest.mark.parametrize("trusts", ["the-world's-ca", "its-own-ca"])
    def test_a_worker_with_a_certificate_from_another_ca_never_joins(
            self, rpcx_backend: str, sites: tuple[Site, Site], trusts: str) -> None:
        # trusting the world's CA, it is rank 0's key server that refuses it; trusting
        # its own, it refuses rank 0's server first
        site, other = sites
        stranger = certificate_options(
            other, "stranger", trusting=site if trusts == "the-world's-ca" else None)
        with tempfile.TemporaryDirectory(prefix="rpcx-certificates-") as directory:
            init_method = "file://" + os.path.join(directory, "rendezvous")
            outsider = _Outsider(rpcx_backend, init_method,
                                      {"rpc_timeout": BOUND, **stranger})
            options = _options(rpcx_backend, init_method, {
                "rpc_timeout": SHORT, **certificate_options(site, "member")})
            with pytest.raises(RpcError, match="waiting for workers to join") as caught:
                rpcx.init_rpc("worker0", backend=rpcx_backend, rank=0, world_size=2,
                              rpc_backend_options=options)
            answer = outsider.answer()
        assert answer.startswith("AuthenticationError"), answer
        assert "did not hand over the world key" in answer, answer
        if trusts == "the-world's-ca":
            assert "alert unknown ca" in answer, answer
            assert "its key server refused 1 connection(s)" in str(caught.value)
        else:
            assert "certificate verify failed" in answer, answer

    @pytest.mark.rpcx_requires(
        "dynamic", reason="it cannot admit workers after the world started")
    def test_a_dynamic_world_admits_its_site_and_refuses_strangers(
            self, rpcx_backend: str, sites: tuple[Site, Site]) -> None:
        site, other = sites
        with dynamic_world(rpcx_backend, name="lead", rpc_timeout=BOUND, encrypt="always",
                           **certificate_options(site, "member")) as started:
            assert _join(started, "late1", 1, site) == ("joined", "late1")
            refusals = [
                (_join(started, "stranger", 2, other, "stranger", trusting=site),
                 "AuthenticationError", "no member handed over the dynamic world's key"),
                (started.join("keyed", 2, auth_key="a-shared-key-0123456789abcdef",
                              tls_ca=None, tls_cert=None, tls_key=None),
                 "RpcError", "not sealed with this worker's world key"),
                (started.join("open", 2, encrypt=False, tls_ca=None, tls_cert=None,
                              tls_key=None),
                 "RpcError", "this worker has none"),
            ]
            for outcome, kind, reason in refusals:
                assert outcome[:2] == ("refused", kind), outcome
                assert reason in outcome[2], outcome
            # the world is as it was, and a worker of the site joins after them
            assert [w.name for w in rpcx.get_worker_infos()] == ["lead", "late1"]
            assert _join(started, "late2", 2, site) == ("joined", "late2")
            rpcx.rpc_sync("late2", remote.spy_on_the_wire)
            tensor = patterned(4096)
            assert torch.equal(rpcx.rpc_sync("late2", remote.call_and_wait, args=(
                rpcx.rpc_async, "late1", remote.echo, (tensor,)), timeout=BOUND), tensor)
            parts, found = rpcx.rpc_sync("late2", remote.wire_has, args=(PATTERN, 1))
            assert parts > 0 and not found
            for name in ("lead", "late1", "late2"):
                assert rpcx.rpc_sync(name, rpcx.debug_info)["encrypted_peers"] == 2, name
            # late1 leaves (its key server with it); a joiner enrols from another member
            started.leave("late1")
            assert rpcx.rpc_sync("late2", remote.wait_lost, args=(1, BOUND))
            assert _join(started, "late3", 3, site, "late1") == ("joined", "late3")
            assert rpcx.rpc_sync("late3", remote.call_and_wait, args=(
                rpcx.rpc_async, "late2", remote.add, (2, 3)), timeout=BOUND) == 5


def _join(started: DynamicWorld, name: str, rank: int, site: Site,
          certificate: str | None = None, trusting: Site | None = None) -> tuple[str, ...]:
    """``name`` joins at ``rank`` with the certificate ``site`` issued to ``certificate``
    (default: ``name``), trusting ``trusting``'s CA (default: ``site``'s)."""
    options: dict[str, Any] = certificate_options(site, certificate or name, trusting)
    return started.join(name, rank, **options)
