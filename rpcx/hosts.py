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

__all__ = [
    "address_towards", "default_address", "host_identity", "interface_with", "resolve",
    "source_address",
]

log = logging.getLogger("rpcx.hosts")

# Any address outside this host will do: connecting a UDP socket sends nothing, it only
# asks the kernel for the route (and so the source address) towards it. TEST-NET-1 has no
# route of its own, so this finds the default route's address.
_PROBE = "192.0.2.1"


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


def default_address() -> str:
    """This host's address when the rendezvous does not say where peers are.

    The address the hostname resolves to, unless that is a loopback one (Debian maps the
    hostname to ``127.0.1.1``); then the default route's source address; then loopback.
    """
    try:
        address = socket.gethostbyname(socket.gethostname())
        if not ipaddress.ip_address(address).is_loopback and _can_bind(address):
            return address
    except (OSError, ValueError):
        pass
    return source_address(socket.AF_INET, _PROBE) or "127.0.0.1"


def _can_bind(address: str) -> bool:
    """Whether this host can listen on ``address`` (a hosts file may say otherwise)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
            return True
    except OSError:
        return False


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
