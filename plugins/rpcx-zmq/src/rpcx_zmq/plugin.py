"""The hook rpcx calls (through the ``rpcx`` entry point) to register the zmq backend."""

from __future__ import annotations

from typing import Any

from rpcx.hookspecs import hookimpl

from rpcx_zmq.options import ZmqRpcBackendOptions
from rpcx_zmq.transport import ZmqTransport

__all__ = ["rpcx_register_backends"]


@hookimpl
def rpcx_register_backends(register: Any) -> None:
    """Register the ``zmq`` backend."""
    register(
        "zmq",
        ZmqTransport,
        description="ZeroMQ: TCP across hosts, IPC within one, zero-copy tensor frames",
        options_type=ZmqRpcBackendOptions,
        capabilities=ZmqTransport.capabilities,
    )
