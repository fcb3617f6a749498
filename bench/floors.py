"""Raw floors, measured in the same run as the systems: what the machine itself can do.

* ``unix_rtt``: an 8-byte ping-pong over a Unix-domain stream socket between this
  process and a child process, microseconds per round trip;
* ``tcp_rtt``: the same over TCP on 127.0.0.1 (``TCP_NODELAY``, a port from the OS);
* ``memcpy``: ``dst.copy_(src)`` of two 64 MiB CPU tensors, GB/s of bytes copied.

No RPC layer can beat the first two for a small call between processes, or the third for
a large tensor that is copied at least once. The child is a plain Python process
(``python floors.py echo ...``), not a multiprocessing one, so it starts in a fraction of
a second and never imports torch. Every socket operation has a timeout and the child is
killed if it does not exit.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

MESSAGE = b"pingpong"  # 8 bytes
SOCKET_TIMEOUT_S = 30.0


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed the socket")
        data += chunk
    return data


def _echo_child(family: str, address: str) -> None:
    """The child: connect, and send back every message until the parent closes."""
    if family == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(SOCKET_TIMEOUT_S)
        sock.connect(address)
    else:
        sock = socket.create_connection(("127.0.0.1", int(address)), timeout=SOCKET_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with sock:
        while True:
            try:
                data = _recv_exactly(sock, len(MESSAGE))
            except ConnectionError:
                return
            sock.sendall(data)


def _ping_pong(family: str, iterations: int) -> dict[str, Any]:
    """Microseconds per round trip with a child process, median of batches of 1000."""
    with tempfile.TemporaryDirectory(prefix="rpcx-bench-floor-") as tmp:
        if family == "unix":
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address = os.path.join(tmp, "sock")
            server.bind(address)
        else:
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.bind(("127.0.0.1", 0))  # a port from the OS
            address = str(server.getsockname()[1])
        server.listen(1)
        server.settimeout(SOCKET_TIMEOUT_S)
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "echo", family,
                                  address])
        try:
            conn, _ = server.accept()
            conn.settimeout(SOCKET_TIMEOUT_S)
            if family == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with conn:
                for _ in range(1000):
                    conn.sendall(MESSAGE)
                    _recv_exactly(conn, len(MESSAGE))
                batches = []
                batch = 1000
                for _ in range(max(1, iterations // batch)):
                    start = time.perf_counter()
                    for _ in range(batch):
                        conn.sendall(MESSAGE)
                        _recv_exactly(conn, len(MESSAGE))
                    batches.append((time.perf_counter() - start) / batch * 1e6)
        finally:
            server.close()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(timeout=10)
    return {"value": statistics.median(batches), "samples": batches}


def measure_unix_rtt(quick: bool) -> dict[str, Any]:
    """8-byte round trip over a Unix-domain socket between two processes (us)."""
    return _ping_pong("unix", 5000 if quick else 20000)


def measure_tcp_rtt(quick: bool) -> dict[str, Any]:
    """8-byte round trip over TCP loopback between two processes (us)."""
    return _ping_pong("tcp", 5000 if quick else 20000)


def measure_memcpy(quick: bool) -> dict[str, Any]:
    """GB/s of ``copy_`` between two 64 MiB CPU tensors (bytes copied per second)."""
    import torch

    nbytes = 64 << 20
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    rates = []
    for _ in range(10 if quick else 30):
        start = time.perf_counter()
        dst.copy_(src)
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return {"value": statistics.median(rates), "samples": rates,
            "torch_threads": torch.get_num_threads()}


FLOORS = {
    "unix_rtt": ("Unix socket ping-pong, 8 B", "us", measure_unix_rtt),
    "tcp_rtt": ("TCP loopback ping-pong, 8 B", "us", measure_tcp_rtt),
    "memcpy": ("memcpy (tensor copy_), 64 MiB", "GB/s", measure_memcpy),
}


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "echo":
    _echo_child(sys.argv[2], sys.argv[3])
