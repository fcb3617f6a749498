"""Reaching rank 0's TCP store: dialing it quietly, and connecting to it again.

torch's ``TCPStore`` client retries a connection for its whole timeout and writes each
retry (and a C++ stack) to the terminal. rpcx dials the address itself first, with a
plain socket, so that a worker waiting for rank 0 (or for a link to come back) waits
quietly and within its own bound (:func:`dial_until`). When a partition broke or
stalled a worker's store connection, :func:`reopener` makes a new one and ends the old,
and :func:`retransmitting` tells a stalled connection (TCP sending its data again) from
a store host that is only slow; :mod:`rpcx._world.store` decides when to use them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch._C._distributed_c10d import TCPStore
from torch.distributed import DistNetworkError

__all__ = ["DIAL_EVERY", "dial_until", "reopener", "retransmitting"]

DIAL_EVERY = 0.1  # seconds between dials of a store that is not up (yet, or again)
REDIAL_S = 5.0  # how long a broken store connection dials before the operation fails


def dial_until(host: str, port: int, deadline: float) -> OSError | None:
    """Dial ``host:port`` every :data:`DIAL_EVERY` s until something takes the
    connection (``None``) or ``deadline`` (a ``time.monotonic()`` value) passes: the last
    dial's error then. The connection is closed at once (a store's server takes that
    quietly)."""
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.01, min(DIAL_EVERY, left))):
                return None
        except OSError as exc:  # refused (nobody listens yet), unreachable, timed out
            last = exc
        left = deadline - time.monotonic()
        if left <= 0:
            return last
        time.sleep(min(DIAL_EVERY, left))  # (a refused dial returns at once: pace them)


def reopener(host: str, port: int, timeout: timedelta) -> Callable[[], Any]:
    """How a worker connects to rank 0's store at ``host:port`` again when its
    connection breaks or stalls (see :mod:`rpcx._world.store`).

    It dials first, quietly, for :data:`REDIAL_S` at most: a host still cut off raises
    ``DistNetworkError`` (the operation fails as before, and the next one tries again),
    instead of torch's client retrying for the whole store timeout, out loud."""

    def connect() -> Any:
        failure = dial_until(host, port, time.monotonic() + REDIAL_S)
        if failure is not None:
            raise DistNetworkError(f"rank 0's store at {host}:{port} cannot be reached: "
                                   f"{failure}")
        old = _sockets_to(host, port)
        store = TCPStore(host, port, None, False, timeout, wait_for_workers=False)
        store.set_timeout(timeout)
        for descriptor in old:
            # End the old connection, so that a call still waiting on it fails now, on a
            # live interpreter, rather than when the store's host exits (at our exit,
            # c10d's exception in that thread would abort the process).
            with contextlib.suppress(OSError), socket.fromfd(
                    descriptor, socket.AF_INET, socket.SOCK_STREAM) as duplicate:
                duplicate.shutdown(socket.SHUT_RDWR)
        return store

    return connect


def retransmitting(host: str, port: int) -> bool:
    """Whether TCP is sending data again on one of this process's connections to
    ``host:port`` (``TCP_INFO``'s retransmits or backoff): the network lost it, the peer
    did not merely not answer yet."""
    for descriptor in _sockets_to(host, port):
        with contextlib.suppress(OSError), socket.fromfd(
                descriptor, socket.AF_INET, socket.SOCK_STREAM) as duplicate:
            info = duplicate.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
            if info[2] or info[4]:  # tcpi_retransmits, tcpi_backoff
                return True
    return False


def _sockets_to(host: str, port: int) -> list[int]:
    """This process's descriptors of TCP connections to ``host:port`` (from ``/proc``;
    none where it cannot say)."""
    try:
        wanted = {ipaddress.ip_address(info[4][0])
                  for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except (OSError, ValueError):
        return []
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                rows = lines.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            address, _, port_hex = fields[2].partition(":")
            if int(port_hex, 16) == port and _proc_address(address) in wanted:
                inodes.add(fields[9])
    found = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    for name in names:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}")[8:-1] in inodes:  # socket:[inode]
                found.append(int(name))
    return found


def _proc_address(hexed: str) -> Any:
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host order, hex)."""
    raw = b"".join(bytes.fromhex(hexed[i:i + 8])[::-1] for i in range(0, len(hexed), 8))
    address = ipaddress.ip_address(raw)
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address
