"""rpcx.tracing for real: a traced DDP + RPC step merges into one causal timeline, clocks
skewed by a time namespace (and on two "hosts") are aligned, and the trace ring and its
switch behave.

The multi-process tests run on the default backend (where users run the examples) and
skip elsewhere; the in-process ones run on loopback.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

import rpcx
import rpcx.tracing
from rpcx._core.label import CallLabel
from rpcx.messages import MessageKind
from rpcx.registry import DEFAULT_BACKEND
from rpcx.testing.conformance_hosts import INTERFACE_VARIABLES, run_on_hosts, two_hosts
from rpcx.testing.world import free_port
from rpcx.tracing.merge import causality_violations, load_traces, match_calls
from rpcx.tracing.plot import plot_timeline
from rpcx.tracing.ring import TraceRing

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
BOUND = 240.0


def _multi_process_default(rpcx_backend: str) -> None:
    if rpcx_backend != DEFAULT_BACKEND:
        pytest.skip(f"traced worlds run on the default backend ({DEFAULT_BACKEND}); the "
                    "trace policy is the same object on every backend")


def _errors(traces: list) -> dict[int, int | None]:  # type: ignore[type-arg]
    return {t.rank: max((s.error_ns for s in t.clock), default=None) for t in traces}


def _complete(calls: list) -> list:  # type: ignore[type-arg]
    return [c for c in calls if None not in (c.send_ns, c.serve_start_ns, c.serve_end_ns,
                                             c.complete_ns)]


# ------------------------------------------------------------ a traced DDP + RPC step

@pytest.mark.program
def test_traced_ddp_rpc_is_one_causal_timeline(rpcx_backend: str, tmp_path: pathlib.Path
                                               ) -> None:
    _multi_process_default(rpcx_backend)
    trace_dir = tmp_path / "trace"
    env = {**os.environ, "RPCX_BACKEND": rpcx_backend, "RPCX_TRACE": str(trace_dir)}
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "ddp_rpc" / "main.py"), "--epochs", "2",
         "--batches", "2"], capture_output=True, text=True, timeout=BOUND, env=env,
        cwd=EXAMPLES / "ddp_rpc")
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"

    traces = load_traces(trace_dir)
    assert sorted(t.worker for t in traces) == ["master", "ps", "trainer0", "trainer1"]
    assert all(t.dropped == 0 for t in traces)
    for t in traces:  # every worker was aligned to the reference (the master)
        assert t.reference == "master"
        assert len(t.clock) >= 2, t.worker  # at start and at shutdown
    calls = match_calls(traces)
    done = _complete(calls)
    assert len(done) >= 20, f"only {len(done)} complete calls"
    # Each call's events are on the workers it names: the send and the completion on the
    # caller's trace, the serve on the callee's (match_calls joins them by the caller's
    # rank and request id; a mismatch would leave the call without a serve).
    by_rank = {t.rank: t for t in traces}
    for call in done:
        caller, callee = by_rank[call.caller_rank], by_rank[call.callee_rank]
        assert any(e.kind == "send" and e.peer == call.callee_rank and e.call_id == call.call_id
                   for e in caller.events)
        assert any(e.kind == "serve_start" and e.peer == call.caller_rank
                   and e.call_id == call.call_id for e in callee.events)
    # Causal order for every call, once clocks are aligned.
    assert causality_violations(calls, _errors(traces)) == []
    labels = {c.label.split("#")[0] for c in done}
    assert {"rpc_sync", "rpc_async"} <= labels, labels  # lookups, parameter RRefs, steps

    def instants(t: object, label: str) -> int:
        return sum(1 for e in t.events if e.kind == "instant" and e.label == label)  # type: ignore[attr-defined]

    ps = next(t for t in traces if t.worker == "ps")
    for t in traces:
        if t.worker.startswith("trainer"):
            # 2 epochs of 2 batches: one backward hop to the parameter server and one
            # optimizer step (here, for the dense layer) per batch
            assert instants(t, "sent AUTOGRAD_CHAIN") == 4, t.worker
            assert instants(t, "optimizer step") == 4, t.worker
    assert instants(ps, "received AUTOGRAD_CHAIN") == 8
    assert instants(ps, "optimizer step") == 8  # the embedding's, for both trainers

    summary = plot_timeline(trace_dir, tmp_path / "step.png")
    assert {row.split(" / ")[0] for row in summary.rows} == {
        "master", "ps", "trainer0", "trainer1"}
    assert summary.spans >= 2 * len(done) - 10
    assert summary.arrows >= len(done)


@pytest.mark.program
def test_one_traced_step_keeps_the_set_up_out(rpcx_backend: str, tmp_path: pathlib.Path
                                              ) -> None:
    """examples/ddp_rpc --trace: trainer0 wraps its last step in rpcx.tracing.trace()."""
    _multi_process_default(rpcx_backend)
    trace_dir = tmp_path / "step"
    env = {**os.environ, "RPCX_BACKEND": rpcx_backend}
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "ddp_rpc" / "main.py"), "--epochs", "2",
         "--batches", "3", "--trace", str(trace_dir)], capture_output=True, text=True,
        timeout=BOUND, env=env, cwd=EXAMPLES / "ddp_rpc")
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    traces = load_traces(trace_dir)
    assert sorted(t.worker for t in traces) == ["master", "ps", "trainer0", "trainer1"]
    calls = match_calls(traces)
    # trace()'s own calls (start, stop, clock probes) are not in the step's trace: every
    # call of trainer0's in it was recorded from its send (an orphan arrival or serve of
    # a set-up call would show as one without)
    assert [c for c in calls if c.caller == "trainer0" and c.send_ns is None] == []
    assert not [c for c in calls if "tracing" in c.label]
    trainer0 = next(t for t in traces if t.worker == "trainer0")
    steps = [e for e in trainer0.events if e.kind == "instant" and e.label == "optimizer step"]
    assert len(steps) == 1  # one step, its optimizer step
    sent = [c for c in calls if c.caller == "trainer0"]
    assert any(c.label.startswith("rpc_sync#") and c.callee == "ps" for c in sent)  # lookup
    assert causality_violations(calls, _errors(traces)) == []


# ------------------------------------------------------------------- skewed clocks

SKEWED_WORKER = textwrap.dedent("""
    import sys, time, torch, rpcx
    rank, backend, url, trace_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    print("monotonic", time.monotonic(), flush=True)
    rpcx.init_rpc(f"clock{rank}", rank=rank, world_size=2, backend=backend,
                  rpc_backend_options=rpcx.TensorPipeRpcBackendOptions(
                      init_method=url, rpc_timeout=60, trace_dir=trace_dir))
    peer = f"clock{1 - rank}"
    for i in range(20):
        assert rpcx.rpc_sync(peer, torch.add, args=(torch.ones(4), i))[0] == i + 1
        rpcx.rpc_async(peer, torch.mul, args=(torch.ones(4), i)).wait()
    rpcx.shutdown()
""")

SKEW_S = 4000  # worker 1's monotonic clock runs this far ahead of worker 0's


def _time_namespaces_work() -> str | None:
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare"
    probe = subprocess.run(["unshare", "--time", "--monotonic", str(SKEW_S), sys.executable,
                            "-c", "import time; print(time.monotonic())"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return f"cannot make a time namespace here (needs root, Linux 5.6+): {probe.stderr}"
    return None


def _check_alignment(trace_dir: pathlib.Path) -> None:
    traces = load_traces(trace_dir)
    assert [t.worker for t in traces] == ["clock0", "clock1"]
    offset = traces[1].clock[0].offset_ns
    assert abs(offset + SKEW_S * 10**9) < 10**9 // 10, offset  # found within 0.1 s
    calls = _complete(match_calls(traces))
    assert len(calls) == 80  # 40 each way; the clock probes are not recorded
    assert causality_violations(calls, _errors(traces)) == []
    # The same trace without the clock samples: every call now looks served long
    # before (or after) it was sent. The alignment is what makes the order right.
    for path in trace_dir.glob("*.rpcx-trace.json"):
        record = json.loads(path.read_text())
        record["clock"] = []
        path.write_text(json.dumps(record))
    unaligned = load_traces(trace_dir)
    violations = causality_violations(match_calls(unaligned), _errors(unaligned))
    assert len(violations) >= 40, violations[:3]


@pytest.fixture(name="skewed_worker")
def skewed_worker_fixture(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    why = _time_namespaces_work()
    if why is not None:
        pytest.skip(why)
    script = tmp_path / "skewed_worker.py"
    script.write_text(SKEWED_WORKER)
    yield script


def test_a_skewed_monotonic_clock_is_aligned(rpcx_backend: str, tmp_path: pathlib.Path,
                                             skewed_worker: pathlib.Path) -> None:
    _multi_process_default(rpcx_backend)
    url = f"tcp://127.0.0.1:{free_port()}"
    trace_dir = tmp_path / "trace"
    runs = [subprocess.Popen(
        [*(["unshare", "--time", "--monotonic", str(SKEW_S)] if rank else []),
         sys.executable, str(skewed_worker), str(rank), rpcx_backend, url, str(trace_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    for run in runs:
        out, err = run.communicate(timeout=BOUND)
        assert run.returncode == 0, f"{out}\n{err}"
    _check_alignment(trace_dir)


def test_skewed_clocks_on_two_hosts_are_aligned(rpcx_backend: str, tmp_path: pathlib.Path,
                                                skewed_worker: pathlib.Path) -> None:
    _multi_process_default(rpcx_backend)
    trace_dir = tmp_path / "trace"
    with two_hosts() as hosts:
        url = f"tcp://{hosts.addresses[0]}:{free_port()}"
        env = {k: v for k, v in os.environ.items() if k not in INTERFACE_VARIABLES}
        results = run_on_hosts(
            [(namespace, [*(["unshare", "--time", "--monotonic", str(SKEW_S)] if rank else []),
                          sys.executable, str(skewed_worker), str(rank), rpcx_backend, url,
                          str(trace_dir)])
             for rank, namespace in enumerate(hosts.namespaces)], env)
    for status, out, err in results:
        assert status == 0, f"{out}\n{err}"
    _check_alignment(trace_dir)


def test_a_worker_that_exits_without_shutdown_still_writes_its_trace(
        rpcx_backend: str, tmp_path: pathlib.Path) -> None:
    _multi_process_default(rpcx_backend)
    script = tmp_path / "no_shutdown.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, rpcx
        rpcx.init_rpc("alone", rank=0, world_size=1, backend=sys.argv[1],
                      rpc_backend_options=rpcx.TensorPipeRpcBackendOptions(
                          init_method=sys.argv[2], trace_dir=sys.argv[3]))
        rpcx.rpc_sync("alone", torch.add, args=(torch.ones(1), 1))
        # no rpcx.shutdown(): the exit hook leaves, and writes the trace
    """))
    out = subprocess.run(
        [sys.executable, str(script), rpcx_backend, f"tcp://127.0.0.1:{free_port()}",
         str(tmp_path / "trace")], capture_output=True, text=True, timeout=BOUND)
    assert out.returncode == 0, out.stderr
    assert "exits without rpcx.shutdown()" in out.stderr  # (the warning says so)
    calls = _complete(match_calls(load_traces(tmp_path / "trace")))
    assert [c.label for c in calls] == ["rpc_sync#torch._VariableFunctionsClass.add"]


# ------------------------------------------------------------------- the ring itself

def test_the_ring_keeps_the_newest_events_and_counts_the_rest() -> None:
    ring = TraceRing(capacity=3)
    for rid in range(5):
        ring.instant(f"step {rid}")
    assert [event[5] for event in ring.snapshot()] == ["step 2", "step 3", "step 4"]
    assert ring.dropped == 2
    with pytest.raises(ValueError, match="positive capacity"):
        TraceRing(capacity=0)


def test_a_call_is_recorded_from_its_start_only() -> None:
    ring = TraceRing()
    call, clock = int(MessageKind.CALL), int(MessageKind.CLOCK)
    # Ends of calls that began before the ring was on: nothing recorded.
    ring.completed(1, 7, "ok")
    ring.served(2, 8)
    ring.replied(2, 8, True)
    # Neither clock probes nor one-way messages served (those are instants).
    ring.sent(1, 5, clock, CallLabel("clock probe", "w1", str))
    ring.arrived(2, 6, clock)
    ring.serving(2, 6, clock)
    ring.serving(2, 0, call)
    ring.served(2, 0)
    assert ring.snapshot() == []
    # A whole call on each side.
    ring.sent(1, 9, call, CallLabel("rpc_sync", _add, lambda f: f.__name__))
    ring.completed(1, 9, "ok")
    ring.arrived(2, 10, call)
    ring.serving(2, 10, call)
    ring.served(2, 10)
    ring.replied(2, 10, False)
    assert [(e[1], e[3], e[4], e[5]) for e in ring.snapshot()] == [
        ("send", 1, 9, "rpc_sync#_add"), ("complete", 1, 9, "ok"), ("arrive", 2, 10, ""),
        ("serve_start", 2, 10, "3"), ("serve_end", 2, 10, ""), ("reply", 2, 10, "error")]
    # Switched off inside a serve (a trace() block ending): its arrival and start go
    # too, as does an arrival not yet served; a call in flight stays.
    ring.arrived(2, 11, call)
    ring.serving(2, 11, call)
    ring.arrived(2, 13, call)
    ring.sent(1, 12, call, CallLabel("rpc_async", _add, lambda f: f.__name__))
    ring.close()
    kept = [(e[1], e[4]) for e in ring.snapshot()]
    assert ("send", 12) in kept and ("arrive", 10) in kept
    assert not {("arrive", 11), ("serve_start", 11), ("arrive", 13)} & set(kept)


def test_recording_never_fails_a_call() -> None:
    class Unnamed:
        pass

    def broken(_: object) -> str:
        raise RuntimeError("no name")

    ring = TraceRing()
    ring.sent(1, 1, int(MessageKind.CALL), CallLabel("rpc_sync", Unnamed(), broken))
    assert ring.snapshot()[0][5] == "rpc_sync#Unnamed"


def _add(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def test_a_trace_block_records_every_worker_and_writes_their_files(
        tmp_path: pathlib.Path) -> None:
    def body(rank: int, world_size: int, url: str) -> None:
        rpcx.init_rpc(f"w{rank}", rank=rank, world_size=world_size, backend="loopback",
                      rpc_backend_options=rpcx.RpcBackendOptions(init_method=url))
        if rank == 0:
            rpcx.rpc_sync("w1", _add, args=(torch.ones(1),))  # before: not recorded
            with rpcx.tracing.trace(tmp_path) as files:
                assert rpcx.tracing.is_tracing()
                for dst in ("w1", "w2"):
                    rpcx.rpc_sync(dst, _add, args=(torch.ones(1),))
                rref = rpcx.remote("w2", _add, args=(torch.ones(1),))
                rref.to_here()
                # remote()'s own reply may come after to_here()'s: wait for it too, so
                # that its serve (which ends before that reply) is whole in the trace.
                rref._get_future().wait()
            assert not rpcx.tracing.is_tracing()
            assert sorted(path.name for path in files) == [
                f"w{r}.rpcx-trace.json" for r in range(3)]
        rpcx.shutdown()

    rpcx.spawn(body, args=(3, f"tcp://127.0.0.1:{free_port()}"), nprocs=3,
               backend="loopback")
    traces = load_traces(tmp_path)
    calls = _complete(match_calls(traces))
    labels = sorted(c.label for c in calls)
    assert labels.count(f"rpc_sync#{__name__}._add") == 2, labels
    assert any(c.label.startswith("remote#") for c in calls), labels
    assert any(label.startswith("to_here#") for label in labels)
    assert causality_violations(match_calls(traces), _errors(traces)) == []
    # The call made before the block is in no trace.
    assert len([c for c in calls if c.label == f"rpc_sync#{__name__}._add"]) == 2


def test_start_twice_is_refused_and_stop_without_start_is_none(tmp_path: pathlib.Path
                                                               ) -> None:
    def body(rank: int, url: str) -> None:
        rpcx.init_rpc(f"s{rank}", rank=rank, world_size=1, backend="loopback",
                      rpc_backend_options=rpcx.RpcBackendOptions(init_method=url))
        assert rpcx.tracing.stop() is None
        rpcx.tracing.start(tmp_path, capacity=10)
        with pytest.raises(RuntimeError, match="already tracing"):
            rpcx.tracing.start(tmp_path)
        path = rpcx.tracing.stop()
        assert path == tmp_path / "s0.rpcx-trace.json"
        rpcx.shutdown()

    rpcx.spawn(body, args=(f"tcp://127.0.0.1:{free_port()}",), nprocs=1, backend="loopback")
    record = json.loads((tmp_path / "s0.rpcx-trace.json").read_text())
    assert record["format"] == "rpcx-trace/1" and record["capacity"] == 10
    assert record["clock"][0]["offset_ns"] == 0  # the reference is itself
