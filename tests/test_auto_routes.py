"""The default backend, auto: each pair of workers gets the socket that reaches it.

Pairs on one host share memory, pairs on two hosts use TCP, in one world; the routes
are symmetric, visible in ``debug_info()``, and the shm backend refuses a world that
spans hosts. The mixed world runs three workers on two network namespaces ("hosts",
made as the conformance kit's two-host test makes them: needs root).
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

from rpcx.backends.socket_mesh import Policy, route_between
from rpcx.testing.conformance_hosts import run_on_hosts, two_hosts
from rpcx.testing.world import free_port


def test_one_host_shares_memory_two_hosts_use_tcp() -> None:
    here, there = "nodeA|boot1|mnt:[1]", "nodeB|boot2|mnt:[1]"
    assert route_between(Policy.AUTO, here, here).describe() == "shm (same host)"
    assert route_between(Policy.AUTO, here, there).describe() == "tcp (other host: nodeB)"
    tcp = route_between(Policy.TCP, here, here)
    assert not tcp.local and tcp.via == "tcp"


def test_routes_are_the_same_seen_from_either_end() -> None:
    hosts = ["a|1|m", "a|1|m", "b|1|m"]
    for policy in Policy:
        for mine in hosts:
            for theirs in hosts:
                assert (route_between(policy, mine, theirs).local
                        == route_between(policy, theirs, mine).local)


# Ranks given on the command line start as processes of this one, so that they share its
# mount namespace (``ip netns exec`` makes a new one per command): one "host" each run.
MIXED_WORKER = textwrap.dedent("""
    import subprocess, sys, torch, rpcx

    def main(rank, url):
        rpcx.init_rpc(f"w{rank}", rank=rank, world_size=3,
                      rpc_backend_options=rpcx.TensorPipeRpcBackendOptions(
                          init_method=url, rpc_timeout=60))
        if rank == 0:
            big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: shared memory or inline
            for peer in ("w1", "w2"):
                assert torch.equal(rpcx.rpc_sync(peer, torch.add, args=(big, 1)), big + 1)
            assert rpcx.rpc_sync("w1", rpcx.rpc_sync, args=("w2", torch.neg, (big,))
                                 ).equal(-big)
            for name in ("w0", "w1", "w2"):
                info = rpcx.rpc_sync(name, rpcx.debug_info)
                for peer, route in sorted(info["routes"].items()):
                    print(f"{name} -> {peer}: {route}", flush=True)
        rpcx.shutdown()

    if __name__ == "__main__":
        ranks, url = [int(r) for r in sys.argv[1].split(",")], sys.argv[2]
        if len(ranks) == 1:
            main(ranks[0], url)
        else:
            children = [subprocess.Popen([sys.executable, __file__, str(r), url])
                        for r in ranks]
            sys.exit(max(child.wait(120) for child in children))
""")


def test_a_world_on_two_hosts_shares_memory_within_one_and_tcp_across(
    tmp_path: Path,
) -> None:
    script = tmp_path / "mixed_worker.py"
    script.write_text(MIXED_WORKER)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RPCX_BACKEND")}
    with two_hosts() as hosts:
        url = f"tcp://{hosts.addresses[0]}:{free_port()}"
        results = run_on_hosts(
            [(namespace, [sys.executable, str(script), ranks, url])
             for namespace, ranks in zip(hosts.namespaces, ("0,1", "2"), strict=True)], env)
    for status, out, err in results:
        assert status == 0, f"{out}\n{err}"
    lines = set(results[0][1].splitlines())
    other_a = "tcp (other host: "
    expected_shm = {"w0 -> w1: shm (same host)", "w1 -> w0: shm (same host)"}
    assert expected_shm <= lines, lines
    for line in ("w0 -> w2", "w1 -> w2", "w2 -> w0", "w2 -> w1"):
        assert any(text.startswith(f"{line}: {other_a}") for text in lines), (line, lines)
