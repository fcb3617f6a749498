"""Facts about this host that transports need: which address to use, which peers share it.

Public so that backends, built in or plugins, answer these questions alike: gloo and
zmq bind the address :func:`address_towards` picks (on a cluster, the interface the
rendezvous traffic already uses, with no interface variables to set), and shm and zmq
tell peers on this host from others by :func:`host_identity`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from urllib.parse import urlparse

__all__ = ["address_towards", "host_identity", "interface_with", "source_address"]

log = logging.getLogger("rpcx.hosts")


def address_towards(init_method: str) -> str | None:
    """The local address that routes to the rendezvous host of ``init_method``.

    ``tcp://host:port`` names the host; ``env://`` takes ``$MASTER_ADDR``. Returns the
    host's own address when it is a loopback one (every worker is then on this host), and
    ``None`` for other schemes (``file://``) or when the host does not resolve.
    """
    url = urlparse(init_method)
    if url.scheme == "tcp":
        host = url.hostname
    elif url.scheme == "env":
        host = os.environ.get("MASTER_ADDR")
    else:
        return None
    if not host:
        return None
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, None, proto=socket.IPPROTO_UDP)[0]
        target = str(sockaddr[0])
        if ipaddress.ip_address(target.split("%", 1)[0]).is_loopback:
            return target
    except (OSError, ValueError, IndexError):
        return None
    return source_address(family, target)


def source_address(family: int, target: str) -> str | None:
    """The local address the kernel would send from towards ``target``, or None."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))  # UDP connect sends nothing; it picks a route
            return str(probe.getsockname()[0])
    except OSError:
        log.debug("no route towards %s", target)
        return None


def interface_with(address: str) -> str | None:
    """The name of this host's network interface that holds ``address`` (Linux), or None.

    For transports that choose by interface name (TensorPipe reads ``TP_SOCKET_IFNAME``):
    the interface of :func:`address_towards`'s answer is the one the rendezvous traffic
    uses. IPv4 addresses are looked up with ``SIOCGIFADDR``, IPv6 ones in
    ``/proc/net/if_inet6``.
    """
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if ip.version == 6:
        try:
            with open("/proc/net/if_inet6") as table:
                for line in table:
                    fields = line.split()
                    if len(fields) >= 6 and ipaddress.ip_address(
                            ":".join(fields[0][i:i + 4] for i in range(0, 32, 4))) == ip:
                        return fields[5]
        except (OSError, ValueError):
            pass
        return None
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            for _, name in socket.if_nameindex():
                request = struct.pack("256s", name.encode()[:15])
                try:
                    reply = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
                except OSError:
                    continue  # no IPv4 address on it
                if socket.inet_ntoa(reply[20:24]) == str(ip):
                    return name
    except (OSError, ImportError):
        pass
    return None


def host_identity() -> str:
    """A string equal on two workers exactly when they share this host's files.

    The hostname, the kernel's boot id (a reused hostname on another machine, or after a
    reboot, differs) and the mount namespace (containers on one host with their own
    ``/tmp`` differ): two workers with equal identities can reach each other's socket
    files and shared memory.
    """
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            parts.append(file.read().strip())
    except OSError:
        parts.append("")
    try:
        parts.append(os.readlink("/proc/self/ns/mnt"))
    except OSError:
        parts.append("")
    return "|".join(parts)
