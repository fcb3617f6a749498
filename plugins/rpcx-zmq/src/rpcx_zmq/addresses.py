"""Where a worker listens, and which peers share its host.

A worker listens on one address for peers on other hosts. By default that is the local
address that routes to the rendezvous host: on a cluster, the interface the rendezvous
traffic already uses, with no interface variables to set. Peers on the same host (same
hostname, same boot, same mount namespace, so the same ``/tmp``) talk over ``ipc://``.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

from rpcx.hosts import address_towards, host_identity, source_address

__all__ = ["address_towards", "default_address", "host_identity", "listen_host", "resolve"]

log = logging.getLogger("rpcx.backends.zmq")

# Any address outside this host will do: connecting a UDP socket sends nothing, it only
# asks the kernel for the route (and so the source address) towards it. TEST-NET-1 has no
# route of its own, so this finds the default route's address.
_PROBE = "192.0.2.1"


def default_address() -> str:
    """This host's address when the rendezvous does not say where peers are.

    The address the hostname resolves to, unless that is a loopback one (Debian maps the
    hostname to ``127.0.1.1``); then the default route's source address; then loopback.
    """
    try:
        address = socket.gethostbyname(socket.gethostname())
        if not ipaddress.ip_address(address).is_loopback and _is_local(address):
            return address
    except (OSError, ValueError):
        pass
    return source_address(socket.AF_INET, _PROBE) or "127.0.0.1"


def resolve(hostname: str) -> str:
    """``hostname`` as an IP address (ZeroMQ binds addresses and interfaces, not names)."""
    try:
        ipaddress.ip_address(hostname)
        return hostname
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(hostname, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise ValueError(f"hostname {hostname!r} does not resolve: {exc}") from None
    # Prefer IPv4, as most clusters' rendezvous does.
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def listen_host(hostname: str | None, interface: str | None, init_method: str) -> str:
    """The host part of the TCP endpoint to bind: an address or an interface name."""
    if interface:
        return interface  # ZeroMQ binds an interface name to that interface's address
    if hostname:
        return resolve(hostname)
    return address_towards(init_method) or default_address()


def _is_local(address: str) -> bool:
    """Whether this host can listen on ``address`` (a hosts file may say otherwise)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
            return True
    except OSError:
        return False
