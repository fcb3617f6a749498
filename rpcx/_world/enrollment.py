"""Certificates as the root of a world's key: mutual TLS hands the key to each worker.

A site with a PKI gives every worker a certificate, its private key and the site's CA
(``RPCX_TLS_CA``, ``RPCX_TLS_CERT``, ``RPCX_TLS_KEY``, or the options ``tls_ca``,
``tls_cert``, ``tls_key``) instead of a shared secret. One worker draws the world's key
(rank 0 of a world of fixed size; the first member of a dynamic world) and a *key server*
hands it, over TLS 1.3 with both ends' certificates checked against the CA, to every
worker that proves a certificate the CA signed. Everything the world key does then
applies unchanged (sealed store values, connection proofs, per-pair keys, encryption).

Where the key servers listen is the one value in the store that cannot be sealed (no
worker holds the key yet); a forged address fails the TLS handshake (its holder has no
certificate of the CA), so it can stop a worker from joining, not give it a wrong key.

- A world of fixed size: rank 0 serves until every worker has published its name
  (which needs the key), then stops (:func:`static_world_key`).
- A dynamic world: every member serves for as long as it is in the world, so a joiner
  can enrol while any member is left; the servers are listed, by rank, under
  :data:`SERVERS` (:func:`dynamic_world_key`, :func:`list_server`, :func:`unlist_server`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

from rpcx import hosts
from rpcx.errors import AuthenticationError, RpcError

__all__ = ["CA_ENV", "CERT_ENV", "KEY_ENV", "SERVER", "SERVERS", "Certificates",
           "KeyServer", "dynamic_world_key", "fetch_key", "key_server_host", "list_server",
           "resolve_certificates", "static_world_key", "unlist_server"]

log = logging.getLogger("rpcx.auth")

CA_ENV, CERT_ENV, KEY_ENV = "RPCX_TLS_CA", "RPCX_TLS_CERT", "RPCX_TLS_KEY"
SERVER = "tls/server"  # a world of fixed size: rank 0's key server (session store)
SERVERS = "tls/servers"  # a dynamic world: every member's, {rank: address}
KEY_BYTES = 32
_GREETING = b"rpcx-world-key-v1\x00"  # what the key follows, so a stray reply is not a key
_HANDSHAKE_TIMEOUT = 5.0  # seconds a connection to a key server may take to prove itself
_CONNECT_TIMEOUT = 5.0  # seconds a worker gives one try to reach a key server
# Connections a key server serves at once; more wait in the listen backlog (first come,
# first served), so idle strangers can delay a worker's turn, not take it away.
_MOST_AT_ONCE = 16
_LOG_EVERY = 10.0  # seconds between log lines about refused connections


@dataclass(frozen=True)
class Certificates:
    """This worker's certificate (``cert``, a PEM chain), its private key (``key``) and
    the CA that signs every worker's (``ca``): paths, checked by
    :func:`resolve_certificates`."""

    ca: str
    cert: str
    key: str

    def context(self, *, server: bool) -> ssl.SSLContext:
        """A TLS 1.3 context that presents this worker's certificate and requires the
        other end's, signed by the CA. Host names are not checked: addresses come from
        the rendezvous store, and membership is the CA's signature."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=self.ca)
        # The CA file is the trust anchor even when it holds an intermediate: a site
        # can give a job an intermediate of its own, and only that job's workers get in.
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        context.load_cert_chain(self.cert, self.key)
        return context


def resolve_certificates(options: Any) -> Certificates | None:
    """The certificates ``options`` (``tls_ca``, ``tls_cert``, ``tls_key``) or the
    environment (:data:`CA_ENV`, :data:`CERT_ENV`, :data:`KEY_ENV`) name, each option
    winning over its variable; ``None`` when none is set. ``ValueError`` naming what is
    missing (all three are needed) or which file does not load, and why."""
    named = {}
    for field, env in (("tls_ca", CA_ENV), ("tls_cert", CERT_ENV), ("tls_key", KEY_ENV)):
        value = getattr(options, field, None) or os.environ.get(env) or None
        named[env] = None if value is None else os.fspath(value)
    if not any(named.values()):
        return None
    missing = [env for env, value in named.items() if value is None]
    if missing:
        raise ValueError(
            f"certificates need the CA, this worker's certificate and its key; "
            f"{' and '.join(missing)} (or the options tls_ca, tls_cert, tls_key) not set")
    certificates = Certificates(ca=str(named[CA_ENV]), cert=str(named[CERT_ENV]),
                                key=str(named[KEY_ENV]))
    try:
        certificates.context(server=True)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise ValueError(f"the certificates do not load ({CA_ENV}={certificates.ca}, "
                         f"{CERT_ENV}={certificates.cert}, {KEY_ENV}={certificates.key}): "
                         f"{exc}") from None
    return certificates


def key_server_host(options: Any, in_process: bool = False) -> str:
    """Where a key server listens: loopback for a world of threads of one process
    (``in_process``); the backend's ``hostname`` option if it has one; else the address
    that routes to the rendezvous host (as the transports pick theirs)."""
    if in_process:
        return "127.0.0.1"
    given = getattr(options, "hostname", None)
    if given:
        return str(given)
    return hosts.address_towards(options.init_method) or hosts.default_address()


class KeyServer:
    """Hands ``key`` to each connection whose certificate the CA signed, until
    :meth:`close`; refuses (and logs) every other. Listens on ``host``, a port the OS
    picks; :attr:`address` is what to publish."""

    def __init__(self, certificates: Certificates, key: bytes, host: str, who: str) -> None:
        self._context = certificates.context(server=True)
        self._reply = _GREETING + key
        self._who = who
        self._closed = threading.Event()
        self._slots = threading.BoundedSemaphore(_MOST_AT_ONCE)
        self._logged_at = -_LOG_EVERY
        self._counted = threading.Condition()
        self.served = 0
        self.refused = 0
        self.last_refusal = ""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._socket.bind((host, 0))
            self._socket.listen(256)
        except OSError as exc:
            self._socket.close()
            raise RpcError(f"{who}: cannot listen for its key server on {host}: {exc} (set "
                           "the backend's hostname option to an address of this host)"
                           ) from None
        self.address = json.dumps({"host": host, "port": self._socket.getsockname()[1]})
        self._thread = threading.Thread(target=self._accept, name="rpcx-key-server",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop listening (connections being served finish on their own, bounded)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)  # (wakes the accepting thread)
        self._socket.close()
        self._thread.join(timeout=_HANDSHAKE_TIMEOUT)

    def _accept(self) -> None:
        while not self._closed.is_set():
            # (a free slot first: until then connections wait in the backlog, in order)
            if not self._slots.acquire(timeout=_HANDSHAKE_TIMEOUT):
                continue
            try:
                connection, peer = self._socket.accept()
            except OSError:
                self._slots.release()
                return  # closed
            threading.Thread(target=self._serve, args=(connection, peer),
                             name="rpcx-key-server-connection", daemon=True).start()

    def _serve(self, connection: socket.socket, peer: Any) -> None:
        try:
            connection.settimeout(_HANDSHAKE_TIMEOUT)
            with self._context.wrap_socket(connection, server_side=True) as tls:
                # (the handshake is done: the client's certificate is the CA's)
                tls.sendall(self._reply)
                with self._counted:
                    self.served += 1
                    self._counted.notify_all()
                log.debug("%s: handed the world key to %s (%s)", self._who, peer,
                          _subject(tls.getpeercert()))
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._refuse(peer, _reason(exc))
        finally:
            connection.close()
            self._slots.release()

    def wait_refused(self, count: int, timeout: float) -> bool:
        """Whether :attr:`refused` reaches ``count`` within ``timeout`` seconds."""
        with self._counted:
            return self._counted.wait_for(lambda: self.refused >= count, timeout)

    def _refuse(self, peer: Any, why: str) -> None:
        with self._counted:
            self.refused += 1
            self.last_refusal = f"{why} (from {peer[0] if peer else '?'})"
            self._counted.notify_all()
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY:
            self._logged_at = now
            log.warning("%s: refused the world key to a connection from %s: %s (a worker "
                        "needs a certificate signed by the CA in %s; %d refused so far)",
                        self._who, peer[0] if peer else "?", why, CA_ENV, self.refused)


def fetch_key(certificates: Certificates, address: bytes | str, deadline: float | None,
              who: str, whose: str, *, patient: bool = True) -> bytes:
    """The world key from the key server at ``address`` (a published
    :attr:`KeyServer.address`). ``AuthenticationError`` as soon as TLS refuses a
    certificate (either end's); a connection refused, reset or closed before the key (a
    busy server) is tried again until ``deadline`` (a ``time.monotonic()`` value;
    ``None``: a minute), then ``RpcError``; with ``patient`` false, tried once."""
    try:
        where = json.loads(address)
        host, port = str(where["host"]), int(where["port"])
    except (ValueError, KeyError, TypeError):
        raise AuthenticationError(
            f"{who}: {whose}'s key server address in the rendezvous store is not one "
            f"({bytes(address if isinstance(address, bytes) else address.encode())[:80]!r})"
            "; something other than rpcx wrote it") from None
    if deadline is None:
        deadline = time.monotonic() + 60.0
    pause = 0.05
    while True:
        bound = max(0.1, min(_CONNECT_TIMEOUT, deadline - time.monotonic()))
        try:
            reply = _ask(certificates, host, port, bound)
        except OSError as exc:  # (ssl.SSLError included)
            if _refused_certificate(exc):
                raise AuthenticationError(
                    f"{who}: {whose}'s key server at {host}:{port} did not hand over the "
                    f"world key: {_reason(exc)}{_hint(certificates)}") from None
            if not patient or time.monotonic() + pause >= deadline:
                raise RpcError(f"{who}: could not get the world key from {whose}'s key "
                               f"server at {host}:{port}: {_reason(exc)}") from None
            log.debug("%s: %s's key server at %s:%d: %s; trying again", who, whose, host,
                      port, exc)
            time.sleep(pause)  # (pacing the next try; nothing to wait on)
            pause = min(pause * 2, 1.0)
            continue
        if not reply.startswith(_GREETING) or len(reply) != len(_GREETING) + KEY_BYTES:
            raise AuthenticationError(f"{who}: {whose}'s key server at {host}:{port} sent "
                                      "something that is not a world key")
        return reply[len(_GREETING):]


def _ask(certificates: Certificates, host: str, port: int, bound: float) -> bytes:
    """One try: connect, prove both certificates, read the reply. ``OSError`` for a
    connection that fails, is refused by TLS, or closes before the whole reply."""
    with socket.create_connection((host, port), timeout=bound) as connection, \
            certificates.context(server=False).wrap_socket(connection) as tls:
        reply = _read(tls, len(_GREETING) + KEY_BYTES)
    if not reply:
        raise ConnectionResetError("the key server closed the connection (busy?)")
    return reply


def _refused_certificate(exc: OSError) -> bool:
    """Whether TLS refused a certificate (this end checking the server's, or the server
    this one's, which it says with an alert), as opposed to a connection that broke."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return True
    return isinstance(exc, ssl.SSLError) and "ALERT" in str(getattr(exc, "reason", "")).upper()


def static_world_key(session: Any, rank: int, certificates: Certificates, host: str,
                     timeout: float | None, who: str) -> tuple[bytes, KeyServer | None]:
    """A world of fixed size: rank 0 draws the key and serves it (the server returned:
    close it once every worker's name is in); every other rank fetches it from rank 0's
    server. ``session``: the session's store view (unsealed)."""
    if rank == 0:
        key = secrets.token_bytes(KEY_BYTES)
        server = KeyServer(certificates, key, host, who)
        try:
            session.set(SERVER, server.address, timeout)
        except BaseException:
            server.close()
            raise
        return key, server
    deadline = None if timeout is None else time.monotonic() + timeout
    if session.wait_for([SERVER], deadline):
        raise RpcError(f"{who}: rank 0 published no key server within {timeout:g} s "
                       f"(rpc_timeout): is it running, with certificates ({CERT_ENV})?")
    return fetch_key(certificates, session.get(SERVER, timeout), deadline, who, "rank 0"), None


def dynamic_world_key(store: Any, certificates: Certificates, timeout: float | None,
                      who: str, has_roster: bool) -> bytes:
    """A dynamic world with members (``has_roster``), under its membership token: the
    key from the first listed member's server that hands it over. Each server is tried
    once, then those not reached again, all within ``timeout``. ``AuthenticationError``
    with every server's answer if none does and TLS refused this worker (``RpcError`` if
    none could be reached: members that died stay listed until struck off), or if the
    members list no servers (they run without certificates), or a list that is not one.
    Nobody in the world (no roster): a new key."""
    if not has_roster:
        return secrets.token_bytes(KEY_BYTES)
    deadline = None if timeout is None else time.monotonic() + timeout
    servers = _servers(store, timeout, who)
    if not servers:
        raise AuthenticationError(
            f"{who}: the dynamic world's members list no key server: they were started "
            f"without certificates ({CERT_ENV}), with a shared key (RPCX_AUTH_KEY) or "
            "none, or a store client emptied the list")
    failures: dict[int, str] = {}
    unreached = sorted(servers)
    for patient in (False, True):
        for rank in list(unreached):
            try:
                return fetch_key(certificates, servers[rank], deadline, who, f"rank {rank}",
                                 patient=patient)
            except AuthenticationError as exc:
                unreached.remove(rank)
                failures[rank] = str(exc)
            except RpcError as exc:
                failures[rank] = str(exc)
    reasons = [failures[rank].removeprefix(f"{who}: ").removesuffix(_hint(certificates))
               for rank in sorted(failures)]
    refused = len(unreached) < len(servers)  # (TLS refused at least one: certificates)
    raise (AuthenticationError if refused else RpcError)(
        f"{who}: no member handed over the dynamic world's key: " + "; ".join(reasons)
        + (_hint(certificates) if refused else ""))


def list_server(store: Any, rank: int, address: str, timeout: float | None) -> None:
    """List ``rank``'s key server (under the membership token)."""
    servers = _servers(store, timeout, "listing its key server")
    servers[rank] = address
    store.set(SERVERS, json.dumps(servers), timeout)


def unlist_server(store: Any, rank: int, timeout: float | None) -> None:
    """Take ``rank``'s key server off the list, if listed (under the token)."""
    servers = _servers(store, timeout, "taking its key server off the list")
    if servers.pop(rank, None) is not None:
        store.set(SERVERS, json.dumps(servers), timeout)


def _servers(store: Any, timeout: float | None, who: str) -> dict[int, str]:
    """The listed key servers (none listed: empty). ``AuthenticationError`` for a list
    that is not one: a stray's value is never taken for "nobody is left"."""
    if not store.check([SERVERS], timeout):
        return {}
    value = store.get(SERVERS, timeout)
    try:
        listed = json.loads(value)
        return {int(rank): str(address) for rank, address in listed.items()}
    except (ValueError, AttributeError, TypeError):
        raise AuthenticationError(
            f"{who}: the dynamic world's list of key servers in the store is not one "
            f"({bytes(value)[:80]!r}); something other than rpcx wrote it") from None


def _hint(certificates: Certificates) -> str:
    """What a refused certificate means, for errors."""
    return (f". Every worker needs a certificate signed by the CA in {CA_ENV} (usable "
            "for TLS servers and clients alike) and the same CA file (this worker's: "
            f"{certificates.ca})")


def _read(tls: ssl.SSLSocket, size: int) -> bytes:
    """Up to ``size`` bytes, fewer only if the other end closes first."""
    data = bytearray()
    while len(data) < size:
        chunk = tls.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _reason(exc: BaseException) -> str:
    """An ssl or socket error as one line (OpenSSL's reason, and for a certificate
    this end refused, why: "unsupported certificate purpose", ...)."""
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return f"certificate verify failed: {exc.verify_message}"
    reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc)
    return str(reason).replace("_", " ").lower() if isinstance(exc, ssl.SSLError) else str(reason)


def _subject(certificate: Any) -> str:
    """A peer certificate's common name, for log lines."""
    for field in (certificate or {}).get("subject", ()):
        for name, value in field:
            if name == "commonName":
                return str(value)
    return "no common name"
