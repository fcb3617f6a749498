"""Tests of torch's suite known to fail on rpcx, each with its reason.

Keys are ``Suite.test`` (torch's suite name, without the backend prefix). Categories:

- ``private``: the test calls or patches torch's internals (``rpc.api._*``,
  ``rpc._get_debug_info``, ``dist_autograd._retrieve_context``, ``_RemoteModule``, ...),
  which a migrated program does not use and rpcx does not provide;
- ``torchscript``: TorchScript functions or module interfaces;
- ``profiler``: torch's RPC profiling events;
- ``difference``: rpcx deliberately behaves otherwise (keeps a remote error's type, words
  its errors differently, accepts any options on any backend...);
- ``bug``: an rpcx bug, with what tracks it.

docs/compatibility.md is the readable version of this list; keep the two in step.
"""

from __future__ import annotations

from typing import NamedTuple

PRIVATE = "private"
TORCHSCRIPT = "torchscript"
PROFILER = "profiler"
DIFFERENCE = "difference"
BUG = "bug"


class Known(NamedTuple):
    category: str
    reason: str
    backends: frozenset[str] | None = None  # None: every rpcx backend


def _each(
    names: str, category: str, reason: str, backends: frozenset[str] | None = None
) -> dict[str, Known]:
    return {name: Known(category, reason, backends) for name in names.split()}


# rpcx's tensorpipe backend runs torch's own agent underneath, so torch's private helpers
# that only need *an* agent (rpc.api._all_gather, _barrier, _get_current_rpc_agent) find
# one there and pass: they then test torch's agent, not rpcx.
NOT_TENSORPIPE = frozenset({"auto", "gloo", "loopback"})


KNOWN: dict[str, Known] = {
    # ------------------------------------------------------------------ private
    **_each(
        """DistAutogradTest.test_autograd_context
        DistAutogradTest.test_clean_context_during_backward
        DistAutogradTest.test_debug_info
        DistAutogradTest.test_graph_for_builtin_call
        DistAutogradTest.test_graph_for_builtin_remote_call
        DistAutogradTest.test_graph_for_py_nested_call
        DistAutogradTest.test_graph_for_py_nested_call_itself
        DistAutogradTest.test_graph_for_py_nested_remote_call
        DistAutogradTest.test_graph_for_py_nested_remote_call_itself
        DistAutogradTest.test_graph_for_python_call
        DistAutogradTest.test_graph_for_python_remote_call
        DistAutogradTest.test_no_graph_with_tensors_not_require_grad
        DistAutogradTest.test_no_graph_with_tensors_not_require_grad_remote
        DistAutogradTest.test_remote_complex_args
        DistAutogradTest.test_rpc_complex_args
        DistAutogradTest.test_worker_ids_recorded
        TensorPipeAgentDistAutogradTest.test_graph_for_builtin_call_sparse
        TensorPipeAgentDistAutogradTest.test_graph_for_builtin_remote_call_sparse
        TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_call_sparse
        TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_call_itself_sparse
        TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_remote_call_sparse
        TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_remote_call_itself_sparse
        TensorPipeAgentDistAutogradTest.test_graph_for_python_call_sparse
        TensorPipeAgentDistAutogradTest.test_graph_for_python_remote_call_sparse
        TensorPipeAgentDistAutogradTest.test_no_graph_with_tensors_not_require_grad_sparse
        TensorPipeAgentDistAutogradTest.test_no_graph_with_tensors_not_require_grad_remote_sparse
        TensorPipeAgentDistAutogradTest.test_remote_complex_args_sparse
        TensorPipeAgentDistAutogradTest.test_rpc_complex_args_sparse""",
        PRIVATE,
        "inspects torch's autograd context objects (dist_autograd._retrieve_context, "
        "_current_context, _get_debug_info: send/recv functions, known worker ids)",
    ),
    **_each(
        """RpcTest.test_all_gather
        RpcTest.test_rpc_barrier_all
        RpcTest.test_rpc_barrier_multithreaded
        RpcTest.test_rpc_barrier_partial_subset
        RpcTest.test_rpc_barrier_subset""",
        PRIVATE, "torch's rpc.api._all_gather / _barrier", NOT_TENSORPIPE,
    ),
    "RpcTest.test_all_gather_timeout": Known(
        PRIVATE, "torch's rpc.api._all_gather (on tensorpipe it reaches torch's agent, whose "
        "timeout message is not rpcx's)"),
    "RpcTest.test_wait_all": Known(
        PRIVATE, "torch's rpc.api._wait_all(), which collects futures that torch's own "
        "rpc_async registers in a thread-local. On gloo there are none. On tensorpipe rpcx "
        "sends through torch's rpc_async from the caller's thread, so _wait_all finds and "
        "waits for torch's transport-level future. rpcx's own future completes a moment "
        "later, once rpcx has decoded the reply, and the test's fut.done() right after "
        "_wait_all sees it not done yet"),
    **_each(
        """RpcTest.test_wait_all_multiple_call
        RpcTest.test_wait_all_raise_in_user_func
        RpcTest.test_wait_all_timeout""",
        PRIVATE,
        "torch's rpc.api._wait_all(), which collects futures that torch's own rpc_async "
        "registers in a thread-local",
    ),
    **_each(
        """RpcTest.test_wait_all_workers_dense
        RpcTest.test_wait_all_workers_twice_dense
        TensorPipeAgentRpcTest.test_wait_all_workers_sparse
        TensorPipeAgentRpcTest.test_wait_all_workers_twice_sparse""",
        PRIVATE, "torch's rpc.api._wait_all_workers()", NOT_TENSORPIPE,
    ),
    **_each(
        """RpcTest.test_debug_info
        RpcTest.test_get_worker_infos
        RpcTest.test_disable_gil_profiling
        TensorPipeAgentRpcTest.test_set_and_get_num_worker_threads""",
        PRIVATE,
        "torch's agent object (rpc.api._get_current_rpc_agent(), rpc._get_debug_info); "
        "rpcx.debug_info() is the public counterpart",
        NOT_TENSORPIPE,
    ),
    **_each(
        """RpcTest.test_rref_context_debug_info
        RpcTest.test_rref_timeout
        TensorPipeAgentRpcTest.test_infer_backend_from_options""",
        PRIVATE,
        "torch's RRef context or agent type (_rref_context_get_debug_info, "
        "isinstance(rpc.api._get_current_rpc_agent(), rpc.TensorPipeAgent))",
    ),
    "RpcTest.test_worker_info_pickle": Known(
        PRIVATE, "pickles with torch's rpc.api._use_rpc_pickler / internal pickler",
        NOT_TENSORPIPE),
    "RpcTest.test_duplicate_name": Known(
        PRIVATE, "starts torch's agent through rpc.backend_registry.init_backend"),
    "RpcTest.test_register_rpc_backend_and_set_and_start_rpc_backend": Known(
        PRIVATE, "registers a stub agent in torch's rpc.backend_registry (rpcx's backends "
        "register through its pluggy hook)"),
    "RpcTest.test_rref_leak": Known(
        PRIVATE, "mocks rpc.api._delete_all_user_and_unforked_owner_rrefs and sets "
        "api._ignore_rref_leak"),
    "RpcTest.test_shutdown_errors": Known(
        PRIVATE, "monkey-patches rpc.api._broadcast_to_followers and "
        "_delete_all_user_and_unforked_owner_rrefs to make shutdown fail"),
    "RpcTest.test_wait_all_workers_timeout": Known(
        PRIVATE, "monkey-patches rpc.api._wait_all_workers to make shutdown slow (and rpcx's "
        "graceful shutdown logs a timeout instead of raising)"),
    "RpcTest.test_rref_type_non_blocking": Known(
        PRIVATE, "RRef._get_type(blocking=False): rpcx's private _get_type ignores blocking "
        "and returns the type, not a future"),
    "RpcTest.test_rref_type_owner_non_blocking": Known(
        PRIVATE, "RRef._get_type(blocking=False) (see test_rref_type_non_blocking)"),
    "RpcTest.test_rref_type_with_error_non_blocking": Known(
        PRIVATE, "RRef._get_type(blocking=False) (see test_rref_type_non_blocking)"),
    "TensorPipeAgentRpcTest.test_rref_get_type_timeout_non_blocking": Known(
        PRIVATE, "RRef._get_type(blocking=False) (see test_rref_type_non_blocking)"),
    "ThreeWorkersRemoteModuleTest.test_send_remote_module_over_the_wire": Known(
        PRIVATE, "compares the pickled attributes with torch's private "
        "_REMOTE_MODULE_PICKLED_ATTRIBUTES list"),
    # -------------------------------------------------------------- torchscript
    **_each(
        """DistAutogradTest.test_backward_simple_script_call
        TensorPipeAgentDistAutogradTest.test_backward_simple_script_call_sparse
        DistAutogradTest.test_trainer_ps_torchscript_functions
        RpcTest.test_rref_get_future
        RpcTest.test_stress_heavy_rpc_torchscript
        RpcTest.test_wait_all_exit_early_script_function""",
        TORCHSCRIPT, "calls a TorchScript function remotely (cannot be pickled)",
    ),
    **_each(
        """RemoteModuleTest.test_forward_async
        RemoteModuleTest.test_forward_sync
        RemoteModuleTest.test_forward_async_script
        RemoteModuleTest.test_forward_sync_script
        RemoteModuleTest.test_remote_module_py_pickle_not_supported_script
        ThreeWorkersRemoteModuleTest.test_send_remote_module_over_the_wire_script_not_supported""",
        TORCHSCRIPT,
        "builds a scripted module through torch's private _RemoteModule(..., "
        "_module_interface_cls=...) (the plain RemoteModule half of the test passes)",
    ),
    # ----------------------------------------------------------------- profiler
    # rpcx records every call's span and the callee's operators in torch's profiler
    # (rpcx._core.profiling); these remain, each for its own reason:
    "RpcTest.test_profiler_rpc_memory": Known(
        PROFILER, "the caller's profiler settings cannot be read from Python, so the callee "
        "records shapes but never memory (torch's C++ agent ships its config)"),
    **_each(
        """RpcTest.test_profiler_with_async_rpc_udf
        RpcTest.test_profiler_with_async_rpc_udf_single_threaded""",
        DIFFERENCE, "asserts that torch.profiler (Kineto) records no RPC event: torch "
        "cannot, rpcx does (a span per call, and the callee's operators)",
    ),
    **_each(
        """RpcTest.test_rpc_profiling_async_function
        RpcTest.test_rpc_profiling_async_function_single_threaded""",
        PROFILER, "the callee's events are those of its handler's own thread until it "
        "returns: an @async_execution function's later work (here, the nested call it "
        "waits for) is not shipped back",
    ),
    "RpcTest.test_server_process_global_profiler": Known(
        PRIVATE, "torch's rpc._server_process_global_profile (a private API of torch's "
        "agent); profile the callee with torch.profiler on that worker, or use rpcx.tracing"),
    "RpcTest.test_rref_type_blocking": Known(
        PRIVATE, "RRef._get_type(blocking=...) and the profiler events of its private RPC"),
    "DistAutogradTest.test_dist_autograd_profiling": Known(
        PROFILER, "looks for the names of torch's C++ autograd nodes (SendRpcBackward, "
        "RecvRpcBackward, torch::distributed::autograd::backward); rpcx's engine records "
        "its backward hops as spans of its own (dist_autograd.backward#hop(w0 -> w1))"),
    **_each(
        """RpcTest.test_profiler_with_script_async_rpc
        RpcTest.test_profiler_with_script_async_rpc_single_threaded
        RpcTest.test_profiler_with_script_remote_rpc
        RpcTest.test_profiler_with_script_remote_rpc_single_threaded
        RpcTest.test_profiler_with_script_sync_rpc
        RpcTest.test_profiler_with_script_sync_rpc_single_threaded
        RpcTest.test_async_record_function_cbs_jit_call""",
        PROFILER, "RPC profiler events of TorchScript calls",
    ),
    # --------------------------------------------------------------- difference
    **_each(
        """RpcTest.test_callback_wrong_arg_num
        RpcTest.test_callback_wrong_arg_type""",
        DIFFERENCE,
        "a failing .then() callback keeps its error type (TypeError); torch wraps it in "
        "RuntimeError",
    ),
    **_each(
        """DistAutogradTest.test_backward_autograd_engine_error
        DistAutogradTest.test_backward_python_udf_error
        DistAutogradTest.test_multiple_backward_with_errors""",
        DIFFERENCE,
        "an error raised in a backward pass on another worker keeps its type (the test's "
        "own Exception); torch turns it into RuntimeError",
    ),
    "TensorPipeAgentRpcTest.test_op_with_invalid_args": Known(
        DIFFERENCE, "a remote torch.add with bad arguments raises its own TypeError; torch "
                    "raises RuntimeError naming the operator schema"),
    **_each(
        """RpcTest.test_async_function_wrong_return_type
        RpcTest.test_async_function_wrong_return_type_async
        RpcTest.test_async_function_wrong_return_type_remote""",
        DIFFERENCE,
        "an @async_execution function that does not return a Future raises TypeError "
        "naming the function; torch raises RuntimeError",
    ),
    "RpcTest.test_custom_exception_throw_during_reconstruction": Known(
        DIFFERENCE, "an exception that cannot be rebuilt arrives as rpcx.RemoteException "
                    "'CustomException: ... (raised on worker ...)', not torch's 'Original "
                    "exception on remote side was' text"),
    "RpcTest.test_py_raise_in_user_func": Known(
        DIFFERENCE, "the callee does not print a user function's exception on its stderr; "
                    "it travels back to the caller with its remote traceback"),
    "RemoteModuleTest.test_bad_module": Known(
        DIFFERENCE, "a module_cls that does not build an nn.Module raises TypeError; torch "
                    "raises ValueError"),
    "RpcTest.test_send_to_rank": Known(
        DIFFERENCE, "a float destination (rank + 0.5) raises TypeError; torch raises "
                    "ValueError"),
    "DistAutogradTest.test_backward_invalid_args": Known(
        DIFFERENCE, "dist_autograd.backward(ctx, None) raises TypeError with Python's words, "
                    "not pybind's 'incompatible function arguments'"),
    "TensorPipeAgentRpcTest.test_tensorpipe_options_throw_on_timedelta_timeout": Known(
        DIFFERENCE, "a timedelta rpc_timeout raises TypeError with Python's words, not "
                    "pybind's 'incompatible constructor arguments'"),
    **_each(
        """RpcTest.test_duplicate_name_2
        RpcTest.test_reinit
        RpcTest.test_worker_id
        RpcTest.test_shutdown_followed_by_rpc
        RpcTest.test_use_rref_after_shutdown
        RpcTest.test_pg_init_no_rpc_init
        RpcTest.test_function_not_on_callee
        RpcTest.test_local_value_not_on_owner
        RpcTest.test_rref_py_pickle_not_supported
        RemoteModuleTest.test_remote_module_py_pickle_not_supported
        RpcTest.test_rref_str""",
        DIFFERENCE,
        "same error type, rpcx's own wording (names the call and the worker, no C++ "
        "terms); test_rref_str: rpcx's RRef repr",
    ),
    **_each(
        """RpcTest.test_wrong_types
        RpcTest.test_cannot_infer_backend_from_options
        TensorPipeAgentRpcTest.test_mismatched_type_for_options""",
        DIFFERENCE,
        "backends are chosen by name (a string backend is fine) and every backend accepts "
        "every options object, so there is no type mismatch to raise",
    ),
    "TensorPipeAgentRpcTest.test_rref_proxy_timeout": Known(
        DIFFERENCE, "rref.remote(timeout=).f() returns at once and its timeout surfaces on "
                    "the result's next use; torch's proxy blocks on _get_type first"),
    "RpcTest.test_rref_proxy_non_exist": Known(
        DIFFERENCE, "rref.remote().non_exist() returns an RRef at once and the "
                    "AttributeError surfaces on its first use (to_here(), a proxy); torch's "
                    "proxy fetches the type first and raises at once (docs/migration.md)"),
    "DistAutogradTest.test_no_grad_copy": Known(
        DIFFERENCE, "a gradient torch would hand over as is (the same storage) is copied "
                    "(listed as a bug in issue 9; a deliberate difference, docs/migration.md)"),
    "DistAutogradTest.test_backward_unused_send_function": Known(
        DIFFERENCE, "torch's backward waits for every send function of the context, also "
                    "one no gradient ever reaches (the test asserts it still runs after "
                    "10 s); rpcx's backward returns (listed as a bug in issue 9; a deliberate "
                    "difference, docs/migration.md)"),
    # --------------------------------------------------------------------- bugs
    **_each(
        "RpcTest.test_wait_all_exit_early_python RpcTest.test_wait_all_exit_early_builtin",
        BUG,
        "torch.futures.wait_all() does not return early on an rpcx future's error: rpcx "
        "completes futures through set_exception (a value that raises when unwrapped), "
        "and torch's C++ collect_all only short-circuits on C++ errors",
    ),
}


def expected_failure(key: str, backend: str) -> Known | None:
    """The known failure of ``Suite.test`` on ``backend``, if any (never on torch)."""
    if backend == "torch":
        return None
    known = KNOWN.get(key)
    if known is None or (known.backends is not None and backend not in known.backends):
        return None
    return known
