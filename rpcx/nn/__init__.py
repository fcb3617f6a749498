"""``RemoteModule`` with the API of ``torch.distributed.nn``."""

from __future__ import annotations

from rpcx.nn.remote_module import RemoteModule

__all__ = ["RemoteModule"]
