"""Make this interpreter's torch look like a build without distributed RPC.

Put this directory first on ``PYTHONPATH`` (``nox -s no_torch_rpc`` and
tests/test_without_torch_rpc.py do) and every Python process started with that
environment, workers included, sees the torch that a build without distributed RPC
gives: ``torch.distributed.rpc`` and ``torch.distributed.autograd`` import but say
``is_available() == False`` and have none of their API, and ``torch._C._distributed_rpc``
and ``torch._C._distributed_autograd`` cannot be imported. It does so when
``torch.distributed.rpc`` is first looked for (``import torch`` imports it): ``torch._C``
is loaded by then, and loses the entry points those packages test for.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

_GONE = ("_rpc_init", "_distributed_rpc", "_dist_autograd_init", "_distributed_autograd")


class _WithoutTorchRpc(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname in ("torch.distributed.rpc", "torch.distributed.autograd"):
            torch_c = sys.modules.get("torch._C")
            if torch_c is not None:
                for name in _GONE:
                    if hasattr(torch_c, name):
                        delattr(torch_c, name)
                sys.modules["torch._C._distributed_rpc"] = None  # type: ignore[assignment]
                sys.modules["torch._C._distributed_autograd"] = None  # type: ignore[assignment]
        return None


sys.meta_path.insert(0, _WithoutTorchRpc())
