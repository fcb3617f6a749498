"""Backend options with torch.distributed.rpc's names, fields and validation.

Options objects are plain mutable objects, like torch's (programs set ``init_method`` on
an existing object), and every backend accepts every options type: a backend reads the
fields it understands. Device maps are validated here, once, for all backends.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar, Union

import torch

__all__ = [
    "DEFAULT_INIT_METHOD",
    "DEFAULT_NUM_WORKER_THREADS",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "DeviceLike",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "as_backend_options",
    "as_rpcx_options",
    "converted_options",
    "invert_device_map",
    "normalize_device",
    "normalize_device_map",
]

OptionsT = TypeVar("OptionsT")

DEFAULT_RPC_TIMEOUT_SEC = 60.0
"""Default timeout of a call, in seconds (torch's too)."""
DEFAULT_INIT_METHOD = "env://"
"""Default rendezvous: ``$MASTER_ADDR`` and ``$MASTER_PORT``."""
DEFAULT_NUM_WORKER_THREADS = 16
"""Default number of incoming requests a worker runs at once."""
DEFAULT_MAX_FRAME_BYTES = 64 << 30
"""Largest message (header and tensors) a worker accepts, 64 GiB: a peer announcing more
is broken or hostile, and is dropped before anything is allocated for it."""
DEFAULT_HEARTBEAT_INTERVAL = 1.0
"""Seconds of quiet after which a peer is pinged."""
DEFAULT_HEARTBEAT_TIMEOUT = 10.0
"""Seconds of silence after which a peer is reported unresponsive. Generous: a live
worker answers within milliseconds unless something holds its GIL for seconds."""
DEFAULT_MAX_BYTES_IN_FLIGHT = 1 << 30
"""Bytes of calls (1 GiB) a worker may have in flight to one peer before new calls to it
wait: bounds what a fast caller can queue at a slow callee."""

DeviceLike = Union[int, str, torch.device]  # noqa: UP007  (an alias, evaluated on 3.10)
DeviceMap = dict[torch.device, torch.device]


class RpcBackendOptions:
    """Options every backend understands.

    Args:
        rpc_timeout: default timeout of a call, in seconds; ``0`` means no timeout.
        init_method: rendezvous URL, ``tcp://host:port``, ``env://`` or ``file://path``.
        num_worker_threads: how many threads run incoming requests concurrently. rpcx
            adds a thread while one of them blocks on a nested call, so nested calls
            cannot deadlock a small pool.
        max_frame_bytes: the largest message (pickled header plus every tensor) this
            worker accepts, 64 GiB by default. A peer that announces a larger one is
            reported lost with a protocol error before anything is allocated for it.
        auth_key: the world's shared secret (``str`` or ``bytes``); wins over
            ``$RPCX_AUTH_KEY``. With a key, only workers holding it can join the world
            or send this worker a frame (docs/security.md). Never printed, never sent.
        auth_payload: with a key, also authenticate every tensor's bytes, not only
            headers and sizes (costs a SHA-256 pass over each tensor at both ends).
        encrypt: with a key, encrypt every byte of every frame (AES-256-GCM, keys derived
            from the world key per session and direction): ``True`` or ``"hosts"``
            between workers on different hosts, ``"always"`` between every pair; wins
            over ``$RPCX_ENCRYPT``. Needs the ``cryptography`` package
            (``pip install 'torch-rpcx[encrypt]'``); docs/security.md.
        tls_ca: instead of a key, certificates: the path of the PEM file of the CA
            that signs every worker's certificate; wins over ``$RPCX_TLS_CA``. With
            ``tls_cert`` and ``tls_key`` (all three or none), one worker draws the
            world's key and hands it over mutual TLS to workers whose certificate the CA
            signed; ``encrypt`` then defaults to between hosts (docs/security.md,
            "Certificates").
        tls_cert: this worker's certificate (chain), a PEM file; wins over
            ``$RPCX_TLS_CERT``.
        tls_key: that certificate's private key, a PEM file; wins over
            ``$RPCX_TLS_KEY``.
        heartbeat_interval: seconds of quiet after which a peer is pinged (multi-process
            backends); ``0`` turns heartbeats off.
        heartbeat_timeout: seconds of silence after which a peer is reported
            unresponsive: calls waiting on it fail, naming it and how long it has been
            silent, and new ones fail at once until it is heard again.
        max_bytes_in_flight: bytes of calls (arguments and tensors) this worker may have
            sent to one peer and not had answered, 1 GiB by default. A call that would
            pass it waits, within its timeout, for earlier calls to that peer to finish,
            then fails with ``RpcTimeoutError`` naming the limit. A single larger call
            goes when nothing else is in flight to that peer. ``0``: no limit.
        trace_dir: record this worker's calls (``rpcx.tracing``) from ``init_rpc`` to
            ``shutdown`` and write its trace file into this directory; ``$RPCX_TRACE``
            does the same for every worker. ``None``: no trace (the default).
    """

    def __init__(
        self,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        auth_key: str | bytes | None = None,
        auth_payload: bool = False,
        encrypt: bool | str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT,
        trace_dir: str | None = None,
    ) -> None:
        self.max_bytes_in_flight = int(max_bytes_in_flight)
        self.trace_dir = None if trace_dir is None else str(trace_dir)
        self.heartbeat_interval = float(heartbeat_interval)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method
        self.num_worker_threads = int(num_worker_threads)
        self.max_frame_bytes = int(max_frame_bytes)
        self.auth_key = auth_key
        self.auth_payload = bool(auth_payload)
        self.encrypt = encrypt
        self.tls_ca = tls_ca
        self.tls_cert = tls_cert
        self.tls_key = tls_key

    @property
    def auth_key(self) -> str | bytes | None:
        """The shared secret, or ``None`` (then ``$RPCX_AUTH_KEY`` applies)."""
        return self._auth_key

    @auth_key.setter
    def auth_key(self, key: str | bytes | None) -> None:
        if key is not None and not isinstance(key, (str, bytes)):
            raise TypeError(f"auth_key must be str or bytes, got {type(key).__name__}")
        self._auth_key = key  # "_": left out of repr(), so logs never show it

    def validate(self) -> None:
        """Raise ``ValueError`` if a field holds a value no backend can use."""
        if self.rpc_timeout < 0:
            raise ValueError(f"rpc_timeout must be >= 0 seconds, got {self.rpc_timeout}")
        if self.num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be >= 1, got {self.num_worker_threads}")
        if self.heartbeat_interval < 0 or self.heartbeat_timeout < 0:
            raise ValueError("heartbeat_interval and heartbeat_timeout must be >= 0 seconds")
        if 0 < self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout:g} s) must be longer than "
                f"heartbeat_interval ({self.heartbeat_interval:g} s)")
        if self.max_bytes_in_flight < 0:
            raise ValueError(
                f"max_bytes_in_flight must be >= 0 (0: no limit), got {self.max_bytes_in_flight}")
        if self.max_frame_bytes < 1 << 20:
            raise ValueError(f"max_frame_bytes must be at least 1 MiB, got {self.max_frame_bytes}")
        if not isinstance(self.init_method, str) or "://" not in self.init_method:
            raise ValueError(
                f"init_method must be a URL such as 'tcp://host:port', 'env://' or "
                f"'file:///path', got {self.init_method!r}"
            )

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        if self._auth_key is not None:
            fields += ", auth_key=<set>"
        return f"{type(self).__name__}({fields})"


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """torch's TensorPipe options, understood by every rpcx backend.

    ``device_maps`` maps a destination worker's name to ``{local device: remote device}``.
    Responses travel along the inverse map. Maps must be one-to-one. ``max_frame_bytes``
    and the ``auth_*``, ``encrypt``, ``tls_*``, ``heartbeat_*``, ``max_bytes_in_flight`` and
    ``trace_dir`` fields are rpcx's own (see :class:`RpcBackendOptions`).
    """

    def __init__(
        self,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        device_maps: Mapping[str, Mapping[DeviceLike, DeviceLike]] | None = None,
        devices: Iterable[DeviceLike] | None = None,
        _transports: list[str] | None = None,
        _channels: list[str] | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        auth_key: str | bytes | None = None,
        auth_payload: bool = False,
        encrypt: bool | str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT,
        trace_dir: str | None = None,
    ) -> None:
        super().__init__(rpc_timeout, init_method, num_worker_threads,
                         max_frame_bytes=max_frame_bytes, auth_key=auth_key,
                         auth_payload=auth_payload, encrypt=encrypt, tls_ca=tls_ca,
                         tls_cert=tls_cert, tls_key=tls_key,
                         heartbeat_interval=heartbeat_interval,
                         heartbeat_timeout=heartbeat_timeout,
                         max_bytes_in_flight=max_bytes_in_flight, trace_dir=trace_dir)
        self.device_maps: dict[str, DeviceMap] = {}
        self.devices: list[torch.device] = []
        # TensorPipe's transports and channels: the tensorpipe backend hands them to
        # torch's agent; other backends ignore them.
        self._transports = _transports
        self._channels = _channels
        for to, device_map in (device_maps or {}).items():
            self.set_device_map(to, device_map)
        if devices is not None:
            self.set_devices(devices)

    def set_device_map(self, to: str, device_map: Mapping[DeviceLike, DeviceLike]) -> None:
        """Add ``{local: remote}`` entries for calls to worker ``to``.

        Incremental: entries add to what is already set for ``to``. Raises ``ValueError``
        if an entry conflicts with an existing one or two local devices would map to the
        same remote device.
        """
        new = normalize_device_map(device_map)
        merged = dict(self.device_maps.get(to, {}))
        for src, dst in new.items():
            if src in merged and merged[src] != dst:
                raise ValueError(
                    f"device map to {to!r}: {src} is already mapped to {merged[src]}, "
                    f"cannot also map it to {dst} (maps must be one-to-one)"
                )
            merged[src] = dst
        _check_one_to_one(merged, to)
        self.device_maps[to] = merged

    def set_devices(self, devices: Iterable[DeviceLike]) -> None:
        """Set the local devices this worker sends from and receives on."""
        normalized = [normalize_device(d) for d in devices]
        if len(set(normalized)) != len(normalized):
            raise ValueError(f"devices contains duplicates: {normalized}")
        self.devices = normalized

    def validate(self) -> None:
        """Check the common fields and that every device map is one-to-one."""
        super().validate()
        for to, device_map in self.device_maps.items():
            _check_one_to_one(device_map, to)


def as_rpcx_options(options: object) -> RpcBackendOptions:
    """The options object ``init_rpc`` uses for ``options``.

    rpcx's own options (and any object with rpcx's ``validate()``, such as a plugin's)
    pass through unchanged. torch's ``torch.distributed.rpc.TensorPipeRpcBackendOptions``
    and ``RpcBackendOptions``, left over in a program whose imports were changed to rpcx,
    are read into rpcx's equivalents: ``init_method``, ``rpc_timeout``,
    ``num_worker_threads``, ``device_maps`` and ``devices``. (torch's object does not
    keep the private ``_transports``/``_channels`` it was built with, so those are lost.)
    Anything else raises ``TypeError`` naming the class to use instead.
    """
    if isinstance(options, RpcBackendOptions):
        return options
    torch_kind = _torch_options_kind(options)
    if torch_kind == "tensorpipe":
        theirs: Any = options
        return TensorPipeRpcBackendOptions(
            num_worker_threads=theirs.num_worker_threads,
            rpc_timeout=theirs.rpc_timeout,
            init_method=theirs.init_method,
            device_maps={to: dict(device_map) for to, device_map in theirs.device_maps.items()},
            devices=list(theirs.devices),
        )
    if torch_kind == "base":
        theirs = options
        return RpcBackendOptions(rpc_timeout=theirs.rpc_timeout, init_method=theirs.init_method)
    if torch_kind is not None:
        raise TypeError(
            f"rpc_backend_options: torch's {type(options).__qualname__} has no rpcx "
            "equivalent (its extra settings belong to one of torch's own agents); "
            "use rpcx.TensorPipeRpcBackendOptions (or rpcx.RpcBackendOptions) with "
            "init_method, rpc_timeout, num_worker_threads, device_maps and devices"
        )
    if callable(getattr(options, "validate", None)):
        return options  # type: ignore[return-value]  # duck-typed options (a plugin's)
    raise TypeError(
        "rpc_backend_options must be an options object such as "
        "rpcx.TensorPipeRpcBackendOptions(init_method=..., rpc_timeout=...), "
        f"got {type(options).__qualname__}"
    )


def as_backend_options(options: RpcBackendOptions, options_type: type[RpcBackendOptions]
                       ) -> RpcBackendOptions:
    """``options`` as an object of a backend's own ``options_type``, converted once by
    ``init_rpc`` so that the agent and the transport read fields that exist.

    An object of that type (or a subclass) is returned unchanged, as is a duck-typed
    options object (no :class:`RpcBackendOptions`). Any other is copied into a new
    ``options_type()``: every field both types have keeps the given value (the key too),
    the backend's own fields get its defaults, and fields only the given type has are
    left out. So ``TensorPipeRpcBackendOptions`` given to a backend with options of its
    own keeps its timeouts, device maps and key.
    """
    if isinstance(options, options_type) or not isinstance(options, RpcBackendOptions):
        return options
    return converted_options(options, options_type)


def converted_options(options: object, options_type: type[OptionsT]) -> OptionsT:
    """A new ``options_type()`` with every field ``options`` also has set to its value
    (copied: maps and lists are not shared); the rest keep their defaults."""
    converted = options_type()
    fields = vars(converted)
    for name, value in vars(options).items():
        if name in fields:
            fields[name] = copy.copy(value)
    return converted


def _torch_options_kind(options: object) -> str | None:
    """``"tensorpipe"`` or ``"base"`` for torch's two public options classes, ``"other"``
    for another of torch's (its test agent's ``FaultyTensorPipeRpcBackendOptions``),
    ``None`` if ``options`` is not torch's. Reads class names: importing
    torch.distributed.rpc here would cost every rpcx program its start-up time."""
    classes = [(c.__module__, c.__qualname__) for c in type(options).__mro__]
    if ("torch.distributed.rpc.options", "TensorPipeRpcBackendOptions") in classes:
        return "tensorpipe"
    if classes[0] == ("torch._C._distributed_rpc", "RpcBackendOptions"):
        return "base"
    if any(module.startswith("torch.") and name == "RpcBackendOptions"
           for module, name in classes):
        return "other"
    return None


def normalize_device(device: DeviceLike) -> torch.device:
    """Turn ``1``, ``"cuda:1"`` or ``torch.device("cuda", 1)`` into ``torch.device("cuda:1")``."""
    if isinstance(device, bool):
        raise ValueError(f"not a device: {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device index must be >= 0, got {device}")
        return torch.device("cuda", device)
    try:
        result = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"not a device: {device!r}") from exc
    if result.type != "cpu" and result.index is None:
        raise ValueError(f"device {device!r} needs an index, for example '{result.type}:0'")
    return result


def normalize_device_map(device_map: Mapping[DeviceLike, DeviceLike]) -> DeviceMap:
    """Normalize every key and value of a device map and check it is one-to-one."""
    if not isinstance(device_map, Mapping):
        raise ValueError(f"a device map must be a dict, got {type(device_map).__name__}")
    normalized = {normalize_device(k): normalize_device(v) for k, v in device_map.items()}
    if len(normalized) != len(device_map):
        raise ValueError(f"device map {dict(device_map)!r} names a local device twice")
    _check_one_to_one(normalized, "this worker")
    return normalized


def invert_device_map(device_map: Mapping[torch.device, torch.device]) -> DeviceMap:
    """The map a response takes: ``{remote: local}`` for ``{local: remote}``."""
    return {dst: src for src, dst in device_map.items()}


def _check_one_to_one(device_map: Mapping[torch.device, torch.device], to: str) -> None:
    seen: dict[torch.device, torch.device] = {}
    for src, dst in device_map.items():
        if dst in seen:
            raise ValueError(
                f"device map to {to!r}: {seen[dst]} and {src} both map to {dst} "
                "(maps must be one-to-one)"
            )
        seen[dst] = src
