"""Runs a seed program written for GPUs on a machine without enough of them.

Python imports ``sitecustomize`` at start-up in every process whose path holds this
directory, so the program's spawned workers get it too. Only when
``RPCX_SEED_CUDA_ON_CPU=1``: ``Tensor.cuda`` and ``Module.cuda`` leave their object on
the CPU, and ``DistributedDataParallel`` drops ``device_ids``/``output_device`` (which
it refuses for a CPU module). The program's RPC, RRef, distributed autograd and
optimizer code runs unchanged; only where its tensors live differs. The seed test sets
the variable only where the machine has fewer GPUs than the program uses. Either way it
first runs the ``sitecustomize`` it shadows (the next one on ``sys.path``; Debian's
Python has one).
"""

import importlib.machinery
import importlib.util
import os
import sys


def _chain():
    """Run the next ``sitecustomize`` on ``sys.path``, the one this file shadows."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_chain()
if os.environ.get("RPCX_SEED_CUDA_ON_CPU") == "1":
    import torch
    from torch.nn.parallel import DistributedDataParallel

    def _tensor_stays(self, *args, **kwargs):
        return self

    def _module_stays(self, device=None):
        return self

    _ddp_init = DistributedDataParallel.__init__

    def _ddp_on_cpu(self, module, device_ids=None, output_device=None,
                    *args, **kwargs):
        _ddp_init(self, module, None, None, *args, **kwargs)

    torch.Tensor.cuda = _tensor_stays
    torch.nn.Module.cuda = _module_stays
    DistributedDataParallel.__init__ = _ddp_on_cpu
