"""rpcx's local backward pass and torch's thread-local state.

``torch.autograd.backward`` stashes the caller's ``contextvars`` context (a Python object)
in a C++ thread-local for the length of a pass. Collectives that DDP starts from inside
the pass capture it, and gloo's worker thread then needs the GIL to retire them: dropping
the process group right after (a DDP trainer returning) froze whole processes, timers
and all (the DDP + RPC conformance test, about once in 200-900 runs on a busy machine).
rpcx's passes must leave nothing Python in that state; torch's own ``backward()`` is the
control, so the test notices if torch stops stashing (the workaround could then go).
"""

from __future__ import annotations

import torch

import rpcx
from rpcx import autograd as dist_autograd
from rpcx.testing.world import world

_KEY = "context"  # the key torch.autograd.graph._engine_run_backward stashes under


def _stash_seen_by_leaf_hook(run_pass: object) -> list[bool]:
    seen: list[bool] = []
    leaf = torch.ones(3, requires_grad=True)
    leaf.register_hook(lambda grad: seen.append(torch._C._is_key_in_tls(_KEY)))
    run_pass(leaf)  # type: ignore[operator]
    return seen


def test_a_distributed_pass_stashes_no_python_object_in_thread_local_state() -> None:
    with world("loopback", 2):
        def distributed(leaf: torch.Tensor) -> None:
            with dist_autograd.context() as context_id:
                loss = rpcx.rpc_sync("worker1", torch.mul, args=(leaf, 2.0)).sum()
                dist_autograd.backward(context_id, [loss])

        assert _stash_seen_by_leaf_hook(distributed) == [False]
    assert not torch._C._is_key_in_tls(_KEY)


def test_control_torchs_own_backward_does_stash() -> None:
    def local(leaf: torch.Tensor) -> None:
        (leaf * 2).sum().backward()

    assert _stash_seen_by_leaf_hook(local) == [True]
    assert not torch._C._is_key_in_tls(_KEY)  # (and removes it after)
