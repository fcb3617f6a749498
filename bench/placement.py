"""Where a world's workers run: ``one-host`` (the default) or ``two-hosts``.

``one-host``: every worker a process (or, on loopback, a thread) of this machine, as
the rest of the suite describes. ``two-hosts``: issue 27's "the default, across hosts":
two network namespaces joined by a veth pair, made by the conformance kit's own helper
(:func:`rpcx.testing.conformance_hosts.two_namespaces`, the one its two-host test uses),
stand in for two machines on a LAN. Rank ``r`` runs on host ``r % 2``: the pair world's
``w0`` on host a, ``w1`` on host b; the hybrid's trainer0 and master on a, trainer1 and
ps on b (so the trainers' DDP group, master -> ps and trainer0 -> ps cross the veth,
master -> trainer0 and trainer1 -> ps do not); the clients world's server and odd
clients on a, the others on b.

Each host is one ``ip netns exec <ns> unshare --pid --fork`` command (:mod:`host`), and
its ranks are processes it starts: ranks on one host share its mount namespace (what
rpcx's ``host_identity`` compares), ranks on two hosts do not. Each host also gets a PID
namespace of its own because torch's TensorPipe would otherwise copy tensors between
the namespaces with ``process_vm_readv`` (its CMA channel's domain descriptor compares
the boot id, the PID and user namespaces and ids, not the network namespace): a copy
two real hosts cannot make. With a PID namespace each, TensorPipe sends tensors over
the veth (``mpt_uv``), as it would between machines.

Every world rendezvous with ``tcp://`` on host a's address (a port the OS gives out in
host a). torch is given what it needs there, ``TP_SOCKET_IFNAME`` and
``GLOO_SOCKET_IFNAME`` (its agent's gloo group connects to 127.0.0.1 without the
latter); rpcx's systems get none of the interface variables (they are removed from their
environment). The hybrid's DDP group is torch's gloo in every system; it is told the
veth only while it connects (see hybrid.py). The namespaces are made once per run and
removed at its end, on error and Ctrl-C too (the kit's helper deletes them in a
``finally``). Workloads that cannot run across hosts are left out of that placement's
table with the reason (:data:`NOT_ACROSS_HOSTS`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

ONE_HOST, TWO_HOSTS = "one-host", "two-hosts"
PLACEMENTS = (ONE_HOST, TWO_HOSTS)
DESCRIPTION = {
    ONE_HOST: "one host: every worker on this machine",
    TWO_HOSTS: "two hosts: two network namespaces joined by a veth pair, rank r on host r % 2",
}
# What the two-hosts placement does not measure, and why.
NOT_ACROSS_HOSTS = {
    "idle": "w0 reads w1's /proc: another host's",
    "idle_sleep": "measured with idle",
    "floors": "the machine's own floors; the same in either placement",
}
# Variables the bench sets on a host for its own use (hybrid.py's DDP group); rpcx reads
# none of them.
HOST_IFNAME_VAR = "BENCH_HOST_IFNAME"
PROBE_TIMEOUT_S = 30.0


class PlacementUnavailable(RuntimeError):
    """The placement cannot be made on this machine (the reason is the message)."""


def parse(text: str) -> list[str]:
    """``"one-host,two-hosts"`` -> the names, in :data:`PLACEMENTS` order; raises
    ``ValueError`` on an unknown one."""
    names = [p for p in (part.strip() for part in text.split(",")) if p]
    unknown = [p for p in names if p not in PLACEMENTS]
    if unknown or not names:
        raise ValueError(f"unknown placement(s) {unknown or [text]}; known: "
                         f"{', '.join(PLACEMENTS)}")
    return [p for p in PLACEMENTS if p in names]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A placement as made: ``hosts`` is ``None`` on one host, else the namespaces."""

    name: str
    hosts: Any = None  # rpcx.testing.conformance_hosts.Hosts

    @property
    def across(self) -> bool:
        """Whether the workers are spread over two hosts."""
        return self.hosts is not None

    def host_of(self, rank: int) -> int:
        """The host (0: a, 1: b) that runs ``rank``."""
        return rank % 2 if self.across else 0

    def address(self, host: int = 0) -> str:
        """The address of ``host`` (the rendezvous and DDP's store are on host 0's)."""
        return str(self.hosts.addresses[host]) if self.across else "127.0.0.1"

    def free_port(self, host: int = 0) -> int:
        """A TCP port the OS hands out on ``host`` (in its namespace), now free there."""
        if not self.across:
            import socket

            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                return int(sock.getsockname()[1])
        probe = (f"import socket; s = socket.socket(); s.bind(({self.address(host)!r}, 0)); "
                 "print(s.getsockname()[1])")
        out = subprocess.run(
            ["ip", "netns", "exec", self.hosts.namespaces[host], sys.executable, "-c", probe],
            capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=True)
        return int(out.stdout.strip())

    def init_method(self) -> str | None:
        """The rendezvous URL of a world across hosts (``None``: the usual ``file://``)."""
        return f"tcp://{self.address(0)}:{self.free_port(0)}" if self.across else None

    def host_command(self, host: int, argv: list[str]) -> list[str]:
        """``argv`` run on ``host``: in its network namespace, with a PID namespace of its
        own (see the module docstring); ``--kill-child``: nothing outlives ``unshare``."""
        return ["ip", "netns", "exec", self.hosts.namespaces[host],
                "unshare", "--pid", "--fork", "--kill-child", *argv]

    def host_environment(self, host: int, variables: dict[str, str]) -> dict[str, str]:
        """The environment of ``host``'s processes: this one without any interface
        variable, plus ``variables`` (torch's, see systems.interface_variables) and the
        bench's own :data:`HOST_IFNAME_VAR`."""
        from rpcx.testing.conformance_hosts import INTERFACE_VARIABLES

        dropped = (*INTERFACE_VARIABLES, "RPCX_BACKEND")
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        env.update(variables)
        env[HOST_IFNAME_VAR] = self.hosts.interfaces[host]
        return env

    def facts(self) -> dict[str, Any]:
        """For the JSON."""
        facts: dict[str, Any] = {"placement": self.name, "description": DESCRIPTION[self.name]}
        if self.across:
            facts.update(namespaces=list(self.hosts.namespaces),
                         addresses=list(self.hosts.addresses),
                         interfaces=list(self.hosts.interfaces), pid_namespace_per_host=True,
                         rank_to_host="rank % 2")
        return facts


@contextlib.contextmanager
def placed(name: str) -> Iterator[Layout]:
    """Make placement ``name`` for the body and remove it afterwards (also on error and
    Ctrl-C); raises :class:`PlacementUnavailable` where it cannot be made."""
    if name == ONE_HOST:
        yield Layout(name)
        return
    if shutil.which("unshare") is None:
        raise PlacementUnavailable("needs util-linux's unshare command (a PID namespace "
                                   "per host)")
    try:
        from rpcx.testing.conformance_hosts import NamespacesUnavailable, two_namespaces
    except ImportError as exc:  # rpcx.testing needs pytest
        raise PlacementUnavailable(f"rpcx.testing.conformance_hosts does not import: "
                                   f"{exc}") from exc
    with contextlib.ExitStack() as stack:
        try:
            hosts = stack.enter_context(two_namespaces())
        except NamespacesUnavailable as exc:
            raise PlacementUnavailable(str(exc)) from exc
        print(f"{name}: namespaces {hosts.namespaces[0]} ({hosts.addresses[0]}, "
              f"{hosts.interfaces[0]}) and {hosts.namespaces[1]} ({hosts.addresses[1]}, "
              f"{hosts.interfaces[1]})", file=sys.stderr, flush=True)
        try:
            yield Layout(name, hosts)
        finally:
            print(f"{name}: removing the namespaces", file=sys.stderr, flush=True)


def unsupported(system: str, layout: Layout) -> str | None:
    """Why ``system`` cannot run in ``layout``, or ``None``."""
    if not layout.across or system == "torch":
        return None
    import systems

    from rpcx.registry import resolve_backend

    if not resolve_backend(systems.backend_of(system)).capabilities.multi_host:
        return f"{systems.backend_of(system)}'s workers share one host"
    return None


# ----------------------------------------------------------------------- comparison


def comparison_table(rows: list[tuple[str, str]], systems: list[str],
                     ratios: dict[str, dict[str, dict[str, float | None]]],
                     placements: list[str], default: str | None) -> str:
    """Markdown: per workload and rpcx system, the ratio vs torch in each placement and
    the last placement's over the first's. ``ratios[placement][system][workload]``."""
    first, last = placements[0], placements[-1]
    rpcx_systems = [s for s in systems if s != "torch"]
    head = ["workload"]
    for system in rpcx_systems:
        name = system + (" (default)" if system == default else "")
        head.extend(f"{name} {p}" for p in placements)
        head.append(f"{name} {last} / {first}")
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for key, label in rows:
        cells = [label]
        for system in rpcx_systems:
            values = [ratios.get(p, {}).get(system, {}).get(key) for p in placements]
            cells.extend("-" if v is None else f"{v:.2f}x" + (" !" if v < 1 else "")
                         for v in values)
            a, b = values[0], values[-1]
            cells.append("-" if not a or b is None else f"{b / a:.2f}")
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    out.append(f"Ratios: each rpcx backend vs torch in the same placement, >1 is better; "
               f"'!' marks a ratio below 1 (issue 27's target across hosts: >= 1x torch on "
               f"every line for the default). The last column: the {last} ratio / the "
               f"{first} ratio (below 1: the backend's lead over torch shrinks across "
               f"hosts).")
    return "\n".join(out)
