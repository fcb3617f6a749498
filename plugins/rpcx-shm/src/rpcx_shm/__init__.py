"""rpcx-shm: the fastest way to run rpcx on one host (backend ``shm``).

Installed, it registers through the ``rpcx`` entry-point group; rpcx never imports it.
Use it with ``rpcx.init_rpc(..., backend="shm")`` or ``RPCX_BACKEND=shm``.
"""

from rpcx_shm.options import ShmRpcBackendOptions
from rpcx_shm.transport import ShmTransport, host_identity

__all__ = ["ShmRpcBackendOptions", "ShmTransport", "host_identity"]
__version__ = "0.1.0"
