"""Where a worker listens, and which peers share its host.

A worker listens on one address for peers on other hosts. By default that is the local
address that routes to the rendezvous host: on a cluster, the interface the rendezvous
traffic already uses, with no interface variables to set. Peers on the same host (same
hostname, same boot, same mount namespace, so the same ``/tmp``) talk over ``ipc://``.
"""

from __future__ import annotations

import logging

from rpcx.hosts import address_towards, default_address, host_identity, resolve

__all__ = ["address_towards", "default_address", "host_identity", "listen_host", "resolve"]

log = logging.getLogger("rpcx.backends.zmq")


def listen_host(hostname: str | None, interface: str | None, init_method: str) -> str:
    """The host part of the TCP endpoint to bind: an address or an interface name."""
    if interface:
        return interface  # ZeroMQ binds an interface name to that interface's address
    if hostname:
        return resolve(hostname)
    return address_towards(init_method) or default_address()
