"""``DistributedOptimizer`` with the API of ``torch.distributed.optim``."""

from __future__ import annotations

from rpcx.optim.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
