"""``RemoteModule``: an ``nn.Module`` that lives on another worker."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, NoReturn

import torch

from rpcx._core import context as _context
from rpcx._services.calls import rpc_async, rpc_sync
from rpcx._wire.codec import current_encode_context
from rpcx.errors import SerializationError
from rpcx.futures import RpcFuture
from rpcx.rref import RRef
from rpcx.worker import WorkerInfo

__all__ = ["RemoteModule", "parse_remote_device"]

_RANK = re.compile(r"rank:(\d+)$")


def parse_remote_device(remote_device: str) -> tuple[str | int, torch.device]:
    """Split ``"worker/device"`` or ``"rank:N/device"`` into ``(worker or rank, device)``.

    The device part may be left out (``"worker"``): the module then lives on the CPU.
    """
    if not isinstance(remote_device, str) or not remote_device:
        raise ValueError(
            f"remote_device must be a string like 'worker1/cpu' or 'rank:1/cuda:0', "
            f"got {remote_device!r}"
        )
    worker, _, device = remote_device.partition("/")
    if not worker:
        raise ValueError(f"remote_device {remote_device!r} names no worker")
    try:
        parsed_device = torch.device(device or "cpu")
    except RuntimeError as exc:
        raise ValueError(f"remote_device {remote_device!r}: bad device {device!r}: {exc}") from exc
    rank = _RANK.match(worker)
    return (int(rank.group(1)) if rank else worker), parsed_device


def _create(
    module_cls: type[torch.nn.Module],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
) -> RRef[torch.nn.Module]:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"RemoteModule: {module_cls!r} built a {type(module).__name__}, not an nn.Module"
        )
    return RRef(module.to(device))


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_to(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _forward(
    module: RRef[torch.nn.Module],
    device: torch.device,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    caller: int | None = None,
) -> Any:
    local = module.local_value()
    if device.type == "cpu":
        return local(*args, **kwargs)
    args, kwargs = _to(args, device), _to(kwargs, device)
    out = local(*args, **kwargs)
    # As torch's RemoteModule: outputs come back on the device only if the caller's
    # device map routes it; otherwise they come back on the CPU.
    routes = _context.current_agent().routes
    if caller is None or routes.target(caller, device, response=True) is None:
        out = _to(out, torch.device("cpu"))
    return out


def _parameter_rrefs(module: RRef[torch.nn.Module], recurse: bool) -> list[RRef[torch.Tensor]]:
    return [RRef(p) for p in module.local_value().parameters(recurse)]


def _set_training(module: RRef[torch.nn.Module], mode: bool) -> None:
    module.local_value().train(mode)


def _is_training(module: RRef[torch.nn.Module]) -> bool:
    return module.local_value().training


class RemoteModule(torch.nn.Module):
    """A module created on, and run by, another worker; see torch's RemoteModule.

    ``RemoteModule("ps/cpu", nn.Linear, args=(4, 2))`` builds ``nn.Linear(4, 2)`` on
    worker ``ps``; ``forward`` runs it there (inside a distributed autograd context the
    call is recorded like any other). It holds no parameters locally: train it with
    :class:`rpcx.optim.DistributedOptimizer` over :meth:`remote_parameters`. It can be
    sent to other workers in a call; every copy drives the same remote module.
    """

    def __init__(
        self,
        remote_device: str,
        module_cls: type[torch.nn.Module],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        *,
        _module_rref: RRef[torch.nn.Module] | None = None,
    ) -> None:
        super().__init__()
        where, device = parse_remote_device(remote_device)
        agent = _context.current_agent()
        self.on: WorkerInfo = agent.resolve(where)
        self.device = device
        self.remote_device = remote_device
        if _module_rref is None:
            _module_rref = rpc_sync(
                self.on, _create, args=(module_cls, tuple(args or ()), dict(kwargs or {}), device)
            )
        else:
            # As torch's: a module that already exists runs where it lives, its RRef's
            # owner, whatever worker remote_device names (torch's own example names the
            # receiving worker); remote_device still gives the device.
            self.on = _module_rref.owner()
        self.module_rref = _module_rref

    @classmethod
    def init_from_module_rref(
        cls,
        remote_device: str,
        module_rref: RRef[torch.nn.Module],
        _module_interface_cls: Any = None,
    ) -> RemoteModule:
        """A RemoteModule for a module that already exists on its owner.

        Calls go to ``module_rref``'s owner; ``remote_device`` gives the device (its
        worker part must name a worker of the world, but need not be the owner, as in
        torch).
        """
        return cls(remote_device, torch.nn.Module, _module_rref=module_rref)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module on its worker and return its output."""
        caller = _context.current_agent().rank
        return rpc_sync(
            self.on, _forward, args=(self.module_rref, self.device, args, kwargs, caller)
        )

    def forward_async(self, *args: Any, **kwargs: Any) -> RpcFuture[Any]:
        """Like :meth:`forward`, returning a future."""
        caller = _context.current_agent().rank
        return rpc_async(
            self.on, _forward, args=(self.module_rref, self.device, args, kwargs, caller)
        )

    def remote_parameters(self, recurse: bool = True) -> list[RRef[torch.Tensor]]:
        """RRefs to the module's parameters, for :class:`DistributedOptimizer`."""
        result: list[RRef[torch.Tensor]] = rpc_sync(
            self.on, _parameter_rrefs, args=(self.module_rref, recurse)
        )
        return result

    def get_module_rref(self) -> RRef[torch.nn.Module]:
        """The RRef of the module on its worker."""
        return self.module_rref

    def train(self, mode: bool = True) -> RemoteModule:
        """Set training mode on the remote module (and this wrapper)."""
        rpc_sync(self.on, _set_training, args=(self.module_rref, mode))
        self.training = mode  # the wrapper has no children of its own to visit
        return self

    def eval(self) -> RemoteModule:
        """Set evaluation mode on the remote module (and this wrapper)."""
        return self.train(False)

    def is_training(self) -> bool:
        """The remote module's ``training`` flag."""
        result: bool = rpc_sync(self.on, _is_training, args=(self.module_rref,))
        return result

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        """A RemoteModule holds no local parameters: use :meth:`remote_parameters`."""
        raise ValueError(
            "Method ``parameters`` not supported for RemoteModule. Please use "
            f"``remote_parameters`` instead: the parameters live on worker {self.on.name!r} "
            "(their RRefs are what DistributedOptimizer takes)"
        )

    def _not_supported(self, method: str) -> NoReturn:
        raise ValueError(
            f"Method ``{method}`` not supported for RemoteModule: the module lives on "
            f"worker {self.on.name!r} and this wrapper holds nothing of it; call it there "
            "through get_module_rref() (rref.rpc_sync().<method>(...))"
        )

    def __reduce__(self) -> Any:
        # Travels as (where, module RRef): the receiver rebuilds a wrapper around the same
        # remote module. Only rpcx can pickle the RRef, so only calls can carry it.
        try:
            current_encode_context()
        except SerializationError:
            raise RuntimeError(
                f"{self!r} can only be pickled by rpcx, as an argument or result of a "
                "call (torch.save and plain pickle cannot carry the remote module)"
            ) from None
        return (_rebuild, (self.remote_device, self.module_rref, self.training))

    def __repr__(self) -> str:
        return f"RemoteModule(on={self.on.name!r}, device={str(self.device)!r})"


# nn.Module methods that would act on the empty local wrapper, not on the remote module:
# each raises, as torch's RemoteModule does (same wording), instead of silently working
# on nothing.
_UNSUPPORTED = (
    "add_module", "apply", "bfloat16", "buffers", "children", "cpu", "cuda", "double",
    "extra_repr", "float", "half", "ipu", "load_state_dict", "modules", "named_buffers",
    "named_children", "named_modules", "named_parameters", "register_backward_hook",
    "register_buffer", "register_forward_hook", "register_forward_pre_hook",
    "register_parameter", "requires_grad_", "share_memory", "state_dict", "to", "type",
    "xpu", "zero_grad",
)


def _unsupported(method: str) -> Any:
    def refuse(self: RemoteModule, *args: Any, **kwargs: Any) -> NoReturn:
        self._not_supported(method)

    refuse.__name__ = method
    refuse.__doc__ = f"Not supported: raises ValueError (``{method}`` would act on nothing)."
    return refuse


for _method in _UNSUPPORTED:
    setattr(RemoteModule, _method, _unsupported(_method))


def _rebuild(
    remote_device: str, module_rref: RRef[torch.nn.Module], training: bool
) -> RemoteModule:
    module = RemoteModule(remote_device, torch.nn.Module, _module_rref=module_rref)
    module.training = training  # locally only: the remote module keeps its own mode
    return module
