"""The rendezvous store listens on the address its URL names, not on every interface.

torch's own ``tcp://`` and ``env://`` handlers host the store on all interfaces, so a
world started on ``tcp://127.0.0.1:port`` took store connections from other hosts; rank
0 of rpcx now hosts it on the named address alone when that address is this host's.
"""

from __future__ import annotations

from pathlib import Path

from rpcx._world import rendezvous
from rpcx.testing.world import free_port

TIMEOUT = 30.0



def _listeners(port: int) -> set[str]:
    """Local addresses (hex, as /proc shows them) listening on TCP ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if int(port_hex, 16) == port and fields[3] == "0A":  # LISTEN
                found.add(address)
    return found


LOOPBACK_V4 = "0100007F"  # 127.0.0.1 in /proc/net/tcp's byte order


def test_a_loopback_url_hosts_the_store_on_loopback_only(
    loopback_rendezvous: tuple[str, int],
) -> None:
    url, port = loopback_rendezvous
    store = rendezvous.open_store(url, 0, 1, TIMEOUT)
    try:
        assert _listeners(port) == {LOOPBACK_V4}
        store.set("key", b"value")
        client = rendezvous.open_store(url, 1, 2, TIMEOUT)  # a worker still gets in
        assert client.get("key") == b"value"
    finally:
        del store


def test_an_address_this_host_cannot_bind_is_left_to_torch() -> None:
    # 192.0.2.1 (TEST-NET-1) is nobody's: torch's handler would wait for it; rpcx does
    # not try to bind it (and so does not fail differently from torch).
    assert rendezvous._host_on_named_address(
        f"tcp://192.0.2.1:{free_port()}", 1, rendezvous._NO_LIMIT) is None


def test_urls_rpcx_leaves_to_torch() -> None:
    for url in ("file:///tmp/x", f"tcp://127.0.0.1:{free_port()}?use_libuv=0"):
        assert rendezvous._host_on_named_address(url, 1, rendezvous._NO_LIMIT) is None
