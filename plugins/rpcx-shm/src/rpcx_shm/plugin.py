"""The entry point rpcx loads (group ``rpcx``, name ``shm``): registers the backend."""

from __future__ import annotations

from rpcx.hookspecs import hookimpl
from rpcx.registry import BackendRegistry
from rpcx_shm.options import ShmRpcBackendOptions
from rpcx_shm.transport import ShmTransport


@hookimpl
def rpcx_register_backends(register: BackendRegistry) -> None:
    """Register the ``shm`` backend."""
    register(
        "shm",
        ShmTransport,
        description="one host: Unix sockets, large tensors through shared memory",
        options_type=ShmRpcBackendOptions,
    )
