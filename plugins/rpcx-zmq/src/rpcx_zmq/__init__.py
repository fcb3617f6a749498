"""rpcx-zmq: an rpcx backend on ZeroMQ.

Installing the package is enough: rpcx finds the backend through the ``rpcx`` entry-point
group. Select it with ``rpcx.init_rpc(..., backend="zmq")`` or ``RPCX_BACKEND=zmq``.
"""

from rpcx_zmq.options import ZmqRpcBackendOptions
from rpcx_zmq.transport import ZmqTransport

__all__ = ["ZmqRpcBackendOptions", "ZmqTransport"]
__version__ = "0.1.0"
