"""``rpcx doctor [--init-method URL]``: what this machine has for rpcx, and what is wrong.

Each line is a check: ``ok``, ``note`` (worth knowing, not wrong) or ``PROBLEM`` with
what to do about it. The exit status is 1 if any check found a problem.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import socket
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

__all__ = ["Check", "diagnose", "doctor"]

TESTED_TORCH = "2.13.0"
_CONNECT_TIMEOUT = 2.0


@dataclass
class Check:
    """One line of the report."""

    name: str
    status: str  # "ok", "note" or "PROBLEM"
    detail: str

    def __str__(self) -> str:
        return f"{self.status:<8} {self.name}: {self.detail}"


def diagnose(init_method: str | None = None) -> list[Check]:
    """Every check, in order."""
    checks = [Check("python", "ok", f"{platform.python_version()} ({sys.executable})")]
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        return [*checks, Check("torch", "PROBLEM", f"cannot import torch ({exc}): "
                               f"pip install torch=={TESTED_TORCH}")]
    version = torch.__version__.split("+")[0]
    checks.append(Check("torch", "ok" if version == TESTED_TORCH else "note",
                        torch.__version__ if version == TESTED_TORCH else
                        f"{torch.__version__}; rpcx is tested with {TESTED_TORCH} (the "
                        "tensorpipe backend uses torch internals that change between releases)"))
    if not dist.is_available():
        checks.append(Check("torch.distributed", "PROBLEM", "this torch build has no "
                            "torch.distributed: install an official torch wheel"))
        return checks
    checks.append(Check("gloo", "ok" if dist.is_gloo_available() else "note",
                        "available (backend='gloo')" if dist.is_gloo_available() else
                        "this torch build has no gloo: backend='gloo' is unavailable; the "
                        "default backend (auto) does not need it"))
    tensorpipe = hasattr(torch._C, "_distributed_rpc") and hasattr(
        torch._C._distributed_rpc, "TensorPipeAgent")
    checks.append(Check("tensorpipe", "ok" if tensorpipe else "note",
                        "available" if tensorpipe else
                        "torch has no TensorPipe agent: backend='tensorpipe' is unavailable"))
    numpy = importlib.util.find_spec("numpy") is not None
    checks.append(Check("numpy", "ok" if numpy else "note",
                        "installed" if numpy else
                        "not installed: rpcx does not need it, but torch.distributed.rpc's "
                        "own TensorPipe init_rpc fails without it (\"Numpy is not "
                        "available\"); pip install numpy if you also run torch's RPC"))
    if torch.cuda.is_available():
        checks.append(Check("cuda", "ok", f"{torch.cuda.device_count()} device(s), "
                            f"CUDA {torch.version.cuda}"))
    else:
        checks.append(Check("cuda", "note", "no CUDA device: CUDA tensors and device maps "
                            "are unavailable; everything else works on CPU"))
    checks.extend(_plugins())
    checks.append(_security())
    checks.append(_for_torch())
    checks.extend(_default_backend(init_method))
    checks.extend(_rendezvous(init_method))
    return checks


def _security() -> Check:
    """What a world started from this environment would run with: a world key
    (``RPCX_AUTH_KEY``) or certificates (``RPCX_TLS_*``), encryption (``RPCX_ENCRYPT``).
    The key itself is never shown."""
    from rpcx._wire import auth, cipher
    from rpcx._world import enrollment
    from rpcx.options import RpcBackendOptions

    key = os.environ.get(auth.AUTH_KEY_ENV)
    try:
        certificates = enrollment.resolve_certificates(RpcBackendOptions())
        encrypt = cipher.resolve_encrypt(RpcBackendOptions(),
                                         default="hosts" if certificates else None)
    except ValueError as exc:
        return Check("security", "PROBLEM", str(exc))
    if certificates is not None:
        return _certificates_check(certificates, bool(key), encrypt, cipher.aead_available())
    if encrypt is not None and not key:
        return Check("security", "PROBLEM",
                     f"{cipher.ENCRYPT_ENV} is set but {auth.AUTH_KEY_ENV} is not: init_rpc "
                     "will refuse to start (encryption's keys come from the world key)")
    if encrypt is not None and not cipher.aead_available():
        return Check("security", "PROBLEM",
                     f"{cipher.ENCRYPT_ENV} is set but the 'cryptography' package (45 or "
                     "newer) is missing: pip install 'torch-rpcx[encrypt]'")
    if encrypt == "always":
        return Check("security", "ok", "world key set; every frame encrypted (AES-256-GCM), "
                     "between every pair of workers")
    if encrypt == "hosts":
        return Check("security", "ok", "world key set; frames between hosts encrypted "
                     "(AES-256-GCM), within one host authenticated")
    if key:
        return Check("security", "note", "world key set: frames authenticated, not "
                     f"encrypted; set {cipher.ENCRYPT_ENV}=1 to encrypt frames between hosts "
                     "(docs/security.md)")
    return Check("security", "note", f"no world key ({auth.AUTH_KEY_ENV}): a world started "
                 "here admits any worker that reaches its store, and nothing is encrypted "
                 "(docs/security.md)")


def _certificates_check(certificates: Any, key: bool, encrypt: str | None,
                        aead: bool) -> Check:
    """The security line for a world keyed by certificates (``RPCX_TLS_*``)."""
    if key:
        return Check("security", "PROBLEM", "both RPCX_AUTH_KEY and certificates (RPCX_TLS_*) "
                     "are set: init_rpc will refuse to start; keep one")
    if encrypt is not None and not aead:
        return Check("security", "PROBLEM",
                     "certificates turn encryption on, and the 'cryptography' package (45 "
                     "or newer) is missing: pip install 'torch-rpcx[encrypt]' (or set "
                     "RPCX_ENCRYPT=0)")
    frames = {"always": "every frame encrypted (AES-256-GCM), between every pair",
              "hosts": "frames between hosts encrypted (AES-256-GCM), within one host "
                       "authenticated",
              None: "frames authenticated, not encrypted (RPCX_ENCRYPT=0)"}[encrypt]
    return Check("security", "ok", f"certificates set (CA {certificates.ca}): the world's "
                 f"key is handed over mutual TLS to workers the CA signed; {frames}")


def _for_torch() -> Check:
    """Whether torch's RPC names are rpcx's here (``RPCX_FOR_TORCH``,
    ``rpcx.use_for_torch()``), and whether the start-up hook is installed."""
    from rpcx import for_torch

    hook = startup_hook()
    where = f"start-up hook {hook}" if hook else "start-up hook not installed"
    origin = for_torch.used_for_torch()
    if for_torch.switch_requested() and not for_torch.hook_ran():
        # (rpcx, imported here, honoured the variable itself: but in a program, names a
        # library bound before rpcx was imported stay torch's)
        return Check("for torch", "PROBLEM",
                     f"${for_torch.ENV_VAR} is set but the start-up hook did not run "
                     f"({where}): a library that imports torch's RPC names before rpcx "
                     "keeps torch's; reinstall rpcx (pip install torch-rpcx) in this "
                     "environment")
    if origin is not None:
        return Check("for torch", "ok", f"on: torch.distributed.rpc is rpcx ({origin}; {where})")
    if for_torch.switch_requested():
        return Check("for torch", "PROBLEM",
                     f"${for_torch.ENV_VAR} is set but torch's RPC names are torch's: rpcx "
                     f"could not take them over (its RuntimeWarning at import says why; "
                     f"{where})")
    return Check("for torch", "note",
                 f"off: torch.distributed.rpc is torch's own; set {for_torch.ENV_VAR}=1 in "
                 f"every process (or call rpcx.use_for_torch()) to run libraries built on it "
                 f"on rpcx ({where})")


def startup_hook() -> str | None:
    """Where ``rpcx-for-torch.pth`` is installed, if it is (site-packages, user or not)."""
    import site

    directories = [*site.getsitepackages(), site.getusersitepackages()]
    for directory in directories:
        path = os.path.join(directory, "rpcx-for-torch.pth")
        if os.path.exists(path):
            return path
    return None


def _default_backend(init_method: str | None) -> list[Check]:
    """Which backend ``init_rpc`` picks here, and how auto would reach each kind of peer."""
    from rpcx.hosts import address_towards, default_address
    from rpcx.registry import DEFAULT_BACKEND, ENV_VAR

    chosen = os.environ.get(ENV_VAR)
    checks = [Check("default backend", "ok" if not chosen else "note",
                    DEFAULT_BACKEND if not chosen else
                    f"{chosen} (from ${ENV_VAR}; without it: {DEFAULT_BACKEND})")]
    if (chosen or DEFAULT_BACKEND) != "auto":
        return checks
    if hasattr(os, "memfd_create"):
        checks.append(Check("auto, same host", "ok", "Unix sockets; tensors of 256 KiB or "
                            "more through shared memory, copied once per hop"))
    else:
        checks.append(Check("auto, same host", "PROBLEM", "this platform has no "
                            "memfd_create (Linux only): use backend='tcp' or 'gloo'"))
    towards = address_towards(init_method or "env://")
    where = towards or default_address()
    why = ("the address that routes to the rendezvous host" if towards else
           "no rendezvous host given (--init-method or MASTER_ADDR): this host's default "
           "route")
    checks.append(Check("auto, other hosts", "ok", f"TCP, listening on {where} ({why}); "
                        "set SocketRpcBackendOptions(hostname=...) to choose another"))
    return checks


def _plugins() -> list[Check]:
    from rpcx.registry import available_backends, plugin_errors

    checks = [Check("backends", "ok", ", ".join(sorted(available_backends())))]
    for plugin, error in sorted(plugin_errors().items()):
        checks.append(Check(f"plugin {plugin}", "PROBLEM",
                            f"{error}; reinstall it, or pip uninstall it if unused"))
    return checks


def _rendezvous(init_method: str | None) -> list[Check]:
    """Which address this host uses towards the rendezvous, and whether it answers."""
    from rpcx.hosts import address_towards

    if init_method is None:
        if "MASTER_ADDR" not in os.environ:
            return [Check("rendezvous", "note", "no --init-method and no MASTER_ADDR: "
                          "pass --init-method tcp://HOST:PORT to check the path to it")]
        init_method = "env://"
    url = urlparse(init_method)
    if url.scheme == "env":
        host = os.environ.get("MASTER_ADDR")
        port_text = os.environ.get("MASTER_PORT", "")
        if not host or not port_text.isdigit():
            return [Check("rendezvous", "PROBLEM", "env:// needs MASTER_ADDR and "
                          "MASTER_PORT set (a number); or use tcp://HOST:PORT")]
        port = int(port_text)
    elif url.scheme == "tcp" and url.hostname and url.port:
        host, port = url.hostname, url.port
    elif url.scheme == "file":
        return [Check("rendezvous", "ok", f"{init_method}: a file (every worker must see "
                      "the same file system)")]
    else:
        return [Check("rendezvous", "PROBLEM", f"{init_method!r} is no rendezvous URL: "
                      "use tcp://HOST:PORT, env:// or file:///PATH")]
    local = address_towards(init_method)
    checks = [Check("address", "ok" if local else "PROBLEM",
                    f"this host reaches {host} from {local}" if local else
                    f"no route from this host to {host}: check the name and the network")]
    try:
        with socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT):
            checks.append(Check("rendezvous", "ok", f"{host}:{port} accepts connections"))
    except ConnectionRefusedError:
        checks.append(Check("rendezvous", "note", f"{host}:{port} refused the connection: "
                            "nothing listens there yet (rank 0 opens it when it starts)"))
    except OSError as exc:
        checks.append(Check("rendezvous", "PROBLEM", f"{host}:{port} unreachable ({exc}): "
                            "check the address, and that a firewall lets the port through"))
    return checks


def doctor(init_method: str | None = None) -> int:
    """Print the report; 1 if something is wrong, else 0."""
    checks = diagnose(init_method)
    for check in checks:
        print(check)
    problems = sum(1 for check in checks if check.status == "PROBLEM")
    print(f"\n{problems} problem(s)" if problems else "\nno problems found")
    return 1 if problems else 0
