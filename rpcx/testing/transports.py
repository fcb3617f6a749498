"""What a transport's own unit tests need from rpcx, without importing its insides.

A plugin's tests build transports by hand (a :class:`~rpcx.transport.TransportContext`
of their own) or look at the running worker's; these give them the real pieces.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from rpcx._core import context as _context
from rpcx._core.agent import RpcAgent
from rpcx._core.lanes import ReceiveLane
from rpcx._world import rendezvous

__all__ = ["ReceiveLane", "current_agent", "published_address", "receive_lane"]


def receive_lane(
    name: str, resume: Callable[[], None],
    start_thread: Callable[[Callable[[], None]], None] | None = None,
) -> ReceiveLane:
    """A real receive lane (``TransportContext.receive_lane``) for a hand-built context.

    ``start_thread(fn)`` starts the follower that resumes the loop when a request served
    on the lane blocks; by default a daemon thread.
    """
    def start(fn: Callable[[], None]) -> None:
        threading.Thread(target=fn, name=f"rpcx-test-{name}", daemon=True).start()

    return ReceiveLane(name, resume, start_thread or start)


def current_agent() -> RpcAgent:
    """The agent of the calling thread's worker (``RpcNotInitializedError`` if none)."""
    agent = _context.current_agent()
    assert isinstance(agent, RpcAgent)
    return agent


def published_address(key: str) -> Any:
    """What a transport of the calling thread's world published in the store under
    ``key`` (its own prefix, e.g. ``"zmq/1"``), decoded from JSON: where a test finds a
    worker's listening address to knock on it as a stranger."""
    agent = current_agent()
    return json.loads(rendezvous.prefixed(agent._presence.store, "transport").get(key))
