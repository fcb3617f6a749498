"""``rpcx.launch``: one program, started by ``rpcx.spawn`` or by ``torchrun``, unchanged.

``launch(fn, args, nprocs=N)`` runs ``fn(worker, *args)`` on each of the world's
workers, where ``worker`` (a :class:`LaunchedWorker`) says the rank, the world size and
how to rendezvous:

- started by ``torchrun`` (``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set), this
  process is one worker: ``fn`` runs here, once, and every rendezvous goes through
  ``env://``, that is torchrun's store;
- started any other way, it starts the ``N`` workers with :func:`rpcx.spawn`
  (processes, or threads on loopback), which meet through files in a temporary
  directory.

Either way ``worker.init_method(name)`` is the init method of rendezvous ``name``: rpcx's
own (``"rpc"``), a gloo process group's, any other. ``launch`` returns rank 0's result
when it spawned the workers, and this process's result under torchrun.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rpcx.spawn import spawn, under_torchrun

__all__ = ["LaunchedWorker", "launch", "under_torchrun"]

_RESULT = "rank0-result.pickle"


@dataclass(frozen=True)
class LaunchedWorker:
    """Where one worker of a :func:`launch` stands: its rank, the world, its rendezvous."""

    rank: int
    world_size: int
    rendezvous: str | None  # the directory the spawned workers share; None under torchrun

    def init_method(self, name: str = "rpc") -> str:
        """The init method of rendezvous ``name`` (one per process group, say)."""
        if self.rendezvous is None:
            return "env://"
        return "file://" + os.path.join(self.rendezvous, name)


def launch(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int | None = None,
    backend: str | None = None,
) -> Any:
    """Run ``fn(worker, *args)`` on every worker; see the module's docstring.

    ``nprocs`` is how many workers to spawn; under torchrun it may be left out, and if
    given it must equal torchrun's world size. ``fn`` must be picklable (a module-level
    function) when the workers are processes.
    """
    if under_torchrun():
        world_size = int(os.environ["WORLD_SIZE"])
        if nprocs is not None and nprocs != world_size:
            raise ValueError(
                f"this program runs {nprocs} workers, but torchrun started {world_size}: "
                f"start it with --nproc-per-node {nprocs} (times the number of nodes)"
            )
        return fn(LaunchedWorker(int(os.environ["RANK"]), world_size, None), *args)
    if nprocs is None or nprocs < 1:
        raise ValueError(f"launch() needs nprocs >= 1 outside torchrun, got {nprocs!r}")
    with tempfile.TemporaryDirectory(prefix="rpcx-launch-") as rendezvous:
        spawn(_run, args=(fn, args, nprocs, rendezvous), nprocs=nprocs, backend=backend)
        with open(os.path.join(rendezvous, _RESULT), "rb") as result:
            return pickle.load(result)


def _run(
    rank: int, fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int, rendezvous: str
) -> None:
    result = fn(LaunchedWorker(rank, nprocs, rendezvous), *args)
    if rank == 0:  # written whole, then renamed: the parent never reads half of it
        path = os.path.join(rendezvous, _RESULT)
        with open(path + ".partial", "wb") as out:
            pickle.dump(result, out)
        os.replace(path + ".partial", path)
