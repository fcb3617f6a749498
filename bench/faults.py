"""Faults between hosts and at start-up, torch.distributed.rpc beside rpcx in one run.

Issue 50's three tables, measured the same way for every system, systems alternating
case by case:

- ``slow``: two "hosts" (network namespaces joined by a veth pair, the conformance
  kit's) on a link shaped to ``--slow-rate`` (20 Mbit/s). Rank 0 sends rank 1 a
  ``--slow-mib`` MiB tensor (``rpc_async(torch.sum)``), with a small ``rpc_sync`` every
  0.5 s beside it; ``rpc_timeout`` 120 s, the default heartbeat. Reported: the big
  call's outcome and time, the small calls answered and failed, the lines printed.
- ``partition``: the same two hosts, unshaped; the link of host ``--cut-side`` (1: the
  server's, 0: the store host's) is brought down, so packets vanish with no reset.
  Rank 1 is a server (in ``shutdown()`` from the start). Rank 0 makes a call across a
  ``--short-cut`` s cut (timeout 30 s), then a ``timeout=3`` call in a ``--long-cut`` s
  cut; once the link is back, how long until a call is answered; then
  ``shutdown(timeout=5)`` and how long it took. Reported with the lines printed.
- ``lone``: on one host, a worker of a world of two started without its peer:
  rank 0 alone through ``tcp://``, ``env://`` and ``file://``, and rank 1 alone through
  ``tcp://``, each with ``rpc_timeout`` ``--lone-timeout`` (15 s), killed after
  ``--lone-limit`` (60 s). Reported: when ``init_rpc`` failed (timed from its call), with
  what, and the lines printed.

torch runs with TCP-only channels (``_transports=["uv"], _channels=["basic"]``, with
``TP_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME`` naming the host's interface, which it needs
there) as between real hosts. "Printed" counts every line either worker wrote to its
terminal beyond the benchmark's own, rpcx's own one-line notes (an unauthenticated world,
a peer silent or answering again) apart from the rest; the first of the rest is shown.
``--conditions busy`` runs the cases beside one CPU-bound process per core
(``conditions.py``).

Needs root, ``ip`` and ``tc`` for ``slow`` and ``partition``.

    python bench/faults.py                                   # torch,auto,tcp,gloo,zmq
    python bench/faults.py --cases slow --slow-mib 256 --systems auto,gloo
    python bench/faults.py --conditions busy --cut-side 0
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
CASES = ("slow", "partition", "lone")
LONE_SCHEMES = (("rank 0 alone, tcp://", 0, "tcp"), ("rank 0 alone, env://", 0, "env"),
                ("rank 0 alone, file://", 0, "file"), ("rank 1 alone, tcp://", 1, "tcp"))
PROTOCOL = ("RESULT ", "STEP ")  # the benchmark's own lines; anything else is "printed"


# ------------------------------------------------------------------------- the workers


def _module(system: str) -> Any:
    """torch.distributed.rpc for ``torch``, else rpcx (imported before any clock starts)."""
    import systems

    return systems.api(system).rpc


def _init(system: str, rank: int, url: str, timeout: float) -> Any:
    """``init_rpc`` as ``h{rank}`` of a world of two on ``system``; the module used.
    (Not ``systems.init_worker``: the timeout differs per case, and torch is given the
    TCP-only channels two real hosts would leave it.)"""
    rpc = _module(system)
    if system == "torch":
        options: Any = rpc.TensorPipeRpcBackendOptions(
            init_method=url, rpc_timeout=timeout, _transports=["uv"], _channels=["basic"])
        rpc.init_rpc(f"h{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    else:
        import systems

        options = rpc.TensorPipeRpcBackendOptions(init_method=url, rpc_timeout=timeout)
        rpc.init_rpc(f"h{rank}", rank=rank, world_size=2, backend=systems.backend_of(system),
                     rpc_backend_options=options)
    return rpc


def _say(kind: str, **facts: Any) -> None:
    print(kind + json.dumps(facts), flush=True)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: " + " ".join(str(exc).split())


def _slow_worker(rank: int, system: str, url: str, mib: int) -> None:
    import torch

    rpc = _init(system, rank, url, 120)
    if rank == 0:
        big = torch.ones(mib << 18)  # mib MiB of float32
        small: dict[str, Any] = {"ok": 0, "failed": []}
        done = threading.Event()

        def beside() -> None:
            while not done.wait(0.5):
                try:
                    rpc.rpc_sync("h1", len, args=("x",), timeout=120)
                    small["ok"] += 1
                except Exception as exc:
                    small["failed"].append(_error(exc))

        helper = threading.Thread(target=beside, daemon=True)
        started = time.monotonic()
        helper.start()
        try:
            total = rpc.rpc_async("h1", torch.sum, args=(big,)).wait()
            outcome = "ok" if int(total) == big.numel() else f"wrong sum {total}"
        except Exception as exc:
            outcome = _error(exc)
        seconds = time.monotonic() - started
        done.set()
        helper.join(130)
        _say("RESULT ", big=outcome, big_s=seconds, small_ok=small["ok"],
             small_failed=len(small["failed"]), small_errors=small["failed"][:1])
    rpc.shutdown()


def _partition_worker(rank: int, system: str, url: str) -> None:
    rpc = _init(system, rank, url, 60)
    if rank == 1:  # a server: in shutdown() from the start, waiting for rank 0
        rpc.shutdown()
        _say("STEP ", server_down_at=time.monotonic())
        return

    def call(timeout: float) -> None:
        if rpc.rpc_sync("h1", len, args=("abc",), timeout=timeout) != 3:
            raise AssertionError("wrong answer")

    facts: dict[str, Any] = {}

    def timed(key: str, timeout: float) -> None:
        """One call: its outcome as ``facts[key]``, its seconds as ``facts[key_s]``."""
        started = time.monotonic()
        try:
            call(timeout)
            facts[key] = "ok"
        except Exception as exc:
            facts[key] = _error(exc)
        facts[f"{key}_s"] = time.monotonic() - started

    _say("STEP ", ready=True)
    sys.stdin.readline()  # the link is down, for less than the call's timeout
    timed("short", 30)
    _say("STEP ", short=facts["short"])
    sys.stdin.readline()  # down again, for longer than the next call's timeout
    timed("long", 3)
    facts["long_names_peer"] = "h1" in facts["long"]
    _say("STEP ", long=facts["long"])
    sys.stdin.readline()  # the link is back
    started = time.monotonic()
    while True:
        try:
            call(2)
            facts["back_s"] = time.monotonic() - started
            break
        except Exception as exc:
            if time.monotonic() - started > 30:
                facts["back_s"] = None
                facts["back_error"] = _error(exc)
                break
    started = time.monotonic()
    facts["shutdown_started_at"] = started
    try:
        rpc.shutdown(graceful=True, timeout=5)
        facts["shutdown"] = "ok"
    except Exception as exc:
        facts["shutdown"] = _error(exc)
    facts["shutdown_s"] = time.monotonic() - started
    _say("RESULT ", **facts)


def _lone_worker(rank: int, system: str, url: str, timeout: float) -> None:
    _module(system)
    started = time.monotonic()
    try:
        rpc = _init(system, rank, url, timeout)
        rpc.shutdown(graceful=False)
        outcome = "started (no peer?)"
    except BaseException as exc:  # (what init_rpc raised is what is measured)
        outcome = _error(exc)
    _say("RESULT ", outcome=outcome, seconds=time.monotonic() - started)


# --------------------------------------------------------------------- the orchestra


class _World:
    """Two worker processes (or one), their output gathered by reader threads, killed
    at ``limit`` seconds."""

    def __init__(self, commands: list[list[str]], envs: list[dict[str, str]], limit: float,
                 stdin: bool = False) -> None:
        self.runs = [subprocess.Popen(argv, env=env, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT,
                                      stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)
                     for argv, env in zip(commands, envs, strict=True)]
        self.lines: list[list[str]] = [[] for _ in self.runs]
        self._seen = threading.Condition()
        self._readers = [threading.Thread(target=self._read, args=(i,), daemon=True)
                         for i in range(len(self.runs))]
        for reader in self._readers:
            reader.start()
        self._killer = threading.Timer(limit, self.kill)
        self._killer.start()
        self.limit = limit

    def _read(self, index: int) -> None:
        stream = self.runs[index].stdout
        assert stream is not None
        for line in stream:
            with self._seen:
                self.lines[index].append(line.rstrip("\n"))
                self._seen.notify_all()
        with self._seen:
            self.lines[index].append("")  # (end of output)
            self._seen.notify_all()

    def step(self, rank: int, key: str) -> dict[str, Any] | None:
        """The facts of rank's next ``STEP``/``RESULT`` line holding ``key`` (None if
        the worker ended first)."""
        with self._seen:
            while True:
                for line in self.lines[rank]:
                    if line.startswith(PROTOCOL):
                        facts: dict[str, Any] = json.loads(line.split(" ", 1)[1])
                        if key in facts:
                            return facts
                if self.lines[rank] and self.lines[rank][-1] == "" \
                        and self.runs[rank].poll() is not None:
                    return None
                self._seen.wait(1.0)

    def tell(self, rank: int) -> None:
        stream = self.runs[rank].stdin
        assert stream is not None
        with contextlib.suppress(OSError):
            stream.write("go\n")
            stream.flush()

    def finish(self) -> list[str]:
        """Wait for the workers; the lines they printed beyond the protocol."""
        for run in self.runs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                run.wait(self.limit)
        for reader in self._readers:
            reader.join(10)
        self._killer.cancel()
        return [line for lines in self.lines for line in lines
                if line.strip() and not line.startswith(PROTOCOL)]

    def kill(self) -> None:
        for run in self.runs:
            if run.poll() is None:
                run.kill()


def _env(system: str, interface: str | None = None) -> dict[str, str]:
    import systems

    from rpcx.testing.conformance_hosts import INTERFACE_VARIABLES

    env = {k: v for k, v in os.environ.items() if k not in INTERFACE_VARIABLES}
    env.setdefault("OMP_NUM_THREADS", "1")
    if interface:
        env.update(systems.interface_variables(system, interface))
    return env


def _me(*args: str) -> list[str]:
    return [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", *args]


@contextlib.contextmanager
def _hosts(rate: str | None) -> Iterator[Any]:
    from rpcx.testing.conformance_hosts import two_namespaces
    from rpcx.testing.conformance_links import shape

    with two_namespaces() as hosts:
        if rate:
            shape(hosts, rate)
        yield hosts


def _on_hosts(hosts: Any, system: str, *args: str) -> tuple[list[list[str]], list[dict[str, str]]]:
    commands = [["ip", "netns", "exec", ns, *_me(*args[:1], str(rank), system, *args[1:])]
                for rank, ns in enumerate(hosts.namespaces)]
    return commands, [_env(system, iface) for iface in hosts.interfaces]


def _noise(printed: list[str]) -> dict[str, Any]:
    """What the workers printed: rpcx's own one-line notes apart from everything else."""
    from rpcx.testing.conformance_links import OWN_NOTES

    notes = [line for line in printed if any(note in line for note in OWN_NOTES)]
    other = [line for line in printed if line not in notes]
    return {"notes": len(notes), "printed": len(other), "printed_lines": other[:40]}


def run_slow(system: str, args: argparse.Namespace) -> dict[str, Any]:
    """The slow-link case for one system."""
    from rpcx.testing.world import free_port

    with _hosts(args.slow_rate) as hosts:
        url = f"tcp://{hosts.addresses[0]}:{free_port()}"
        commands, envs = _on_hosts(hosts, system, "slow", url, str(args.slow_mib))
        world = _World(commands, envs, limit=300)
        result = world.step(0, "big") or {"big": "no result"}
        return {**result, **_noise(world.finish())}


def run_partition(system: str, args: argparse.Namespace) -> dict[str, Any]:
    """The partition case for one system."""
    from rpcx.testing.conformance_links import set_link
    from rpcx.testing.world import free_port

    side = args.cut_side
    with _hosts(None) as hosts:
        url = f"tcp://{hosts.addresses[0]}:{free_port()}"  # (rank 0 hosts the store)
        commands, envs = _on_hosts(hosts, system, "partition", url)
        world = _World(commands, envs, limit=180, stdin=True)
        result: dict[str, Any] = {"short": "did not start"}
        try:
            if world.step(0, "ready") is not None:
                result = _cut_and_restore(world, hosts, side, args)
        finally:
            set_link(hosts, side, up=True)
            printed = world.finish()
        return {**result, **_noise(printed)}


def _cut_and_restore(world: _World, hosts: Any, side: int, args: argparse.Namespace
                     ) -> dict[str, Any]:
    """Drive rank 0 through the cuts (it waits for a line on stdin before each step)."""
    from rpcx.testing.conformance_links import set_link

    set_link(hosts, side, up=False)
    world.tell(0)
    time.sleep(args.short_cut)  # (the cut itself: how long the link stays down)
    set_link(hosts, side, up=True)
    world.step(0, "short")
    set_link(hosts, side, up=False)
    cut_at = time.monotonic()
    world.tell(0)
    world.step(0, "long")
    time.sleep(max(0.0, args.long_cut - (time.monotonic() - cut_at)))
    set_link(hosts, side, up=True)
    world.tell(0)
    result = world.step(0, "shutdown_s") or {"short": "no result"}
    server = world.step(1, "server_down_at")
    if server and "shutdown_started_at" in result:
        result["server_down_s"] = server["server_down_at"] - result["shutdown_started_at"]
    return result


def run_lone(system: str, args: argparse.Namespace) -> dict[str, Any]:
    """The lone-worker cases for one system (on one host)."""
    from rpcx.testing.world import free_port

    out: dict[str, Any] = {}
    for label, rank, scheme in LONE_SCHEMES:
        env = _env(system)
        with tempfile.TemporaryDirectory() as tmp:
            port = str(free_port())
            if scheme == "env":
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                url = "env://"
            elif scheme == "file":
                url = f"file://{tmp}/rendezvous"
            else:
                url = f"tcp://127.0.0.1:{port}"
            world = _World([_me("lone", str(rank), system, url, str(args.lone_timeout))],
                           [env], limit=args.lone_limit)
            result = world.step(0, "outcome") or {
                "outcome": f"still waiting after {world.limit:.0f} s (killed)",
                "seconds": world.limit}
            out[label] = {**result, **_noise(world.finish())}
    return out


RUNNERS = {"slow": run_slow, "partition": run_partition, "lone": run_lone}


# ------------------------------------------------------------------------- the tables


def _s(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f} s"


def _printed(r: dict[str, Any]) -> str:
    notes = f"{r['notes']} rpcx notes" if r.get("notes") else ""
    if not r.get("printed"):
        return notes or "nothing"
    first = r["printed_lines"][0][:90].replace("|", "/")
    return f"**{r['printed']} lines** (`{first}`)" + (f", {notes}" if notes else "")


def tables(results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    """Markdown: one table per case, a row per condition and system."""
    out: list[str] = []
    rows = [(c, s, r) for c, by_system in results.items() for s, r in by_system.items()]
    if "slow" in args.cases:
        out += [f"\n### A slow link ({args.slow_rate}), a {args.slow_mib} MiB call, small "
                "calls every 0.5 s\n",
                "| condition | system | big call | small calls | printed |",
                "|---|---|---|---|---|"]
        for condition, system, r in rows:
            s = r.get("slow", {})
            big = s.get("big", "-")
            big = f"ok, {_s(s.get('big_s'))}" if big == "ok" else \
                f"**{big[:80]}** after {_s(s.get('big_s'))}"
            out.append(f"| {condition} | {system} | {big} | {s.get('small_ok', '-')} ok, "
                       f"{s.get('small_failed', '-')} failed | {_printed(s)} |")
    if "partition" in args.cases:
        where = "the server's (rank 1)" if args.cut_side == 1 else "the store host's (rank 0)"
        out += [f"\n### A partition: the link cut on {where} side\n",
                f"| condition | system | call across a {args.short_cut:g} s cut | timeout=3 "
                f"call in a {args.long_cut:g} s cut | after the link returns | "
                "shutdown(timeout=5): rank 0 / server | printed |",
                "|---|---|---|---|---|---|---|"]
        for condition, system, r in rows:
            p = r.get("partition", {})
            short = p.get("short", "-")
            short = f"ok ({_s(p.get('short_s'))})" if short == "ok" else short[:80]
            long = p.get("long", "-")
            long = "ok (not cut?)" if long == "ok" else (
                f"fails at {_s(p.get('long_s'), 2)}, "
                + ("names h1" if p.get("long_names_peer") else "does not name the peer"))
            back = _s(p.get("back_s")) if p.get("back_s") is not None else \
                f"never: {p.get('back_error', '-')[:60]}"
            down = _s(p.get("shutdown_s"), 2)
            if p.get("shutdown", "ok") != "ok":
                down += f" ({p['shutdown'][:60]})"
            out.append(f"| {condition} | {system} | {short} | {long} | answers in {back} | "
                       f"{down} / {_s(p.get('server_down_s'), 2)} | {_printed(p)} |")
    if "lone" in args.cases:
        out += [f"\n### A lone worker (rpc_timeout {args.lone_timeout:g} s)\n",
                "| condition | system | case | fails after | with | printed |",
                "|---|---|---|---|---|---|"]
        for condition, system, r in rows:
            for label, one in r.get("lone", {}).items():
                out.append(f"| {condition} | {system} | {label} | {_s(one.get('seconds'))} "
                           f"| `{one.get('outcome', '-')[:150]}` | {_printed(one)} |")
    return "\n".join(out)


def main() -> None:
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    import conditions as machine_conditions

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="torch,auto,tcp,gloo,zmq")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--conditions", default="quiet")
    parser.add_argument("--slow-rate", default="20mbit")
    parser.add_argument("--slow-mib", type=int, default=32)
    parser.add_argument("--cut-side", type=int, choices=(0, 1), default=1)
    parser.add_argument("--short-cut", type=float, default=2.0)
    parser.add_argument("--long-cut", type=float, default=15.0)
    parser.add_argument("--lone-timeout", type=float, default=15.0)
    parser.add_argument("--lone-limit", type=float, default=60.0,
                        help="seconds a lone worker may wait before it is killed")
    parser.add_argument("--out-dir", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = set(args.cases) - set(CASES)
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; known: {', '.join(CASES)}")
    systems = args.systems.split(",")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for condition in machine_conditions.parse(args.conditions):
        with machine_conditions.condition(condition):
            results[condition] = {s: {} for s in systems}
            for case in args.cases:  # (systems alternate within each case)
                for system in systems:
                    print(f"{condition}: {case} on {system} ...", file=sys.stderr, flush=True)
                    started = time.monotonic()
                    results[condition][system][case] = RUNNERS[case](system, args)
                    print(f"  ({time.monotonic() - started:.0f} s)", file=sys.stderr,
                          flush=True)
    print(tables(results, args))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"faults-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"argv": sys.argv, "results": results}, indent=1))
    print(f"\nwritten: {out}")


def _worker(argv: list[str]) -> None:
    case, rank, system, url, *rest = argv
    if case == "slow":
        _slow_worker(int(rank), system, url, int(rest[0]))
    elif case == "partition":
        _partition_worker(int(rank), system, url)
    else:
        _lone_worker(int(rank), system, url, float(rest[0]))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2:])
    else:
        main()
