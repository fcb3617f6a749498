"""The kinds of message in rpcx's protocol.

Every message is one envelope, ``(kind, request_id, payload)``. Requests carry a non-zero
request id and are answered by exactly one ``RESULT`` or ``ERROR`` with the same id;
one-way messages carry id 0. Services register a handler per request kind with the agent.
"""

from __future__ import annotations

import enum

__all__ = ["CONTROL_KINDS", "PASSING_KINDS", "MessageKind"]


class MessageKind(enum.IntEnum):
    """Message kinds. Values are part of the wire format: append, never renumber."""

    RESULT = 1  # payload: the return value
    ERROR = 2  # payload: errors.RemoteErrorInfo
    CALL = 3  # payload: (func, args, kwargs)
    REMOTE_CALL = 4  # payload: (rref_id, fork_id, func, args, kwargs); the callee owns it
    RREF_FETCH = 5  # payload: rref_id; answered with the owner's value
    RREF_FORKS = 6  # payload: [(rref_id, fork_id, holder rank, holder name)]; new references
    RREF_DELETE = 7  # payload: [(rref_id, fork_id)]; references that are gone
    RREF_CONFIRM = 8  # one-way, payload: [fork_id]; the owner knows these references
    AUTOGRAD_BACKWARD = 9  # payload: (context_id, [(send tag, index, grad)])
    AUTOGRAD_RELEASE = 10  # payload: [context_id]; forget them, tell the other peers, answer
    #   once every release sent here before, and everything passed on, has landed
    AUTOGRAD_RUN = 11  # payload: (context_id, chain or None); run a round of a backward
    AUTOGRAD_CHAIN = 12  # one-way, payload: (context_id, [(tag, index, grad)], chain)
    AUTOGRAD_CHAIN_END = 13  # one-way, payload: (token, next round's ranks, error info)
    HEARTBEAT = 14  # one-way, payload: PING (answered with a PONG) or PONG
    RREF_CALL = 15  # payload: (rref_id, method name, args, kwargs); an RRef proxy's call
    AUTOGRAD_FORGET = 16  # one-way (mostly a note), payload: [context_id]; forget them and
    #   tell their other peers the same way
    PROFILED = 17  # payload: (kind, payload) of a CALL, REMOTE_CALL or RREF_CALL sent while
    #   the caller runs torch's profiler; answered with (value, serve_ns, events)
    CLOCK = 18  # payload: None; answered with the callee's time.monotonic_ns() (rpcx.tracing
    #   aligns the workers' clocks with it)
    LEAVING = 19  # one-way, payload: a LEAVING_* code; the sender leaves without having
    #   called shutdown() (sent just before its transport's goodbye, which follows in order)



# Requests whose payload is bookkeeping, never user code or user objects: the codec reads
# them with an unpickler that accepts plain data and tensors only (rpcx._wire.codec).
CONTROL_KINDS = frozenset({
    MessageKind.RREF_FETCH, MessageKind.RREF_FORKS, MessageKind.RREF_DELETE,
    MessageKind.RREF_CONFIRM, MessageKind.AUTOGRAD_BACKWARD, MessageKind.AUTOGRAD_RELEASE,
    MessageKind.AUTOGRAD_RUN, MessageKind.AUTOGRAD_CHAIN, MessageKind.AUTOGRAD_CHAIN_END,
    MessageKind.HEARTBEAT, MessageKind.AUTOGRAD_FORGET, MessageKind.CLOCK,
    MessageKind.LEAVING,
})
PING, PONG = 0, 1  # HEARTBEAT payloads
# LEAVING payloads: why a worker leaves without shutdown()
LEAVING_AT_EXIT = 0  # its program is exiting (rpcx's atexit handler)
LEAVING_THREAD_ENDED = 1  # its rpcx.spawn thread ended

# Kinds whose frames may pass a large frame still being written (``Frame.may_pass``): user
# calls and their replies, fetches, heartbeats and clock reads. No rpcx protocol orders
# them after a frame whose send had not returned; bookkeeping kinds (RRef forks and
# deletions, autograd rounds and releases, LEAVING) keep strict per-pair order, as the
# acknowledgements of releases and deletions count on it.
PASSING_KINDS = frozenset({
    MessageKind.RESULT, MessageKind.ERROR, MessageKind.CALL, MessageKind.REMOTE_CALL,
    MessageKind.RREF_CALL, MessageKind.PROFILED, MessageKind.RREF_FETCH,
    MessageKind.HEARTBEAT, MessageKind.CLOCK,
})
