"""Backends import nothing private from rpcx: what they need is public.

A plugin that reaches into ``rpcx._lanes`` or ``rpcx._memory`` breaks whenever rpcx
rearranges its insides; what transports share lives in :mod:`rpcx.transport` and
:mod:`rpcx.transport_kit`. Read with the ``ast`` module, so imports under
``if TYPE_CHECKING:`` and inside functions count too. Checked: every plugin's shipped
package (``plugins/*/src``) and its tests (``plugins/*/tests``: what they need is in
:mod:`rpcx.testing`), and rpcx's built-in backends (``rpcx/backends``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(
    [p for p in (ROOT / "plugins").glob("*/src/*") if p.is_dir() and not p.name.endswith(
        ".egg-info") and p.name != "__pycache__"]
    + sorted(p for p in (ROOT / "plugins").glob("*/tests") if p.is_dir())
    + [ROOT / "rpcx" / "backends"]
)


def _private(module: str) -> bool:
    """Whether ``module`` (dotted) is private rpcx: ``rpcx._x`` or below it."""
    parts = module.split(".")
    return parts[0] == "rpcx" and any(part.startswith("_") for part in parts[1:])


def private_imports(source: str, filename: str = "<source>") -> list[str]:
    """Every private rpcx module ``source`` imports, as ``line: module``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _private(node.module):
                found.append(f"{node.lineno}: {node.module}")
            else:  # from rpcx import _lanes
                found += [f"{node.lineno}: {node.module}.{a.name}" for a in node.names
                          if _private(f"{node.module}.{a.name}")]
    return found


def test_the_check_sees_every_form() -> None:
    source = (
        "import rpcx._lanes\n"
        "from rpcx import _memory, hosts\n"
        "from rpcx._context import current_agent\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from rpcx._lanes import ReceiveLane\n"
        "def f():\n"
        "    import rpcx.testing._private\n"
        "from rpcx.transport_kit import Link\n"
        "import rpcx.hosts\n"
    )
    assert private_imports(source) == [
        "1: rpcx._lanes", "2: rpcx._memory", "3: rpcx._context", "6: rpcx._lanes",
        "8: rpcx.testing._private",
    ]


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_backends_import_nothing_private_from_rpcx(package: Path) -> None:
    offences = [
        f"{path.relative_to(ROOT)}:{where}"
        for path in sorted(package.rglob("*.py"))
        for where in private_imports(path.read_text(), str(path))
    ]
    assert not offences, (
        "private rpcx modules imported (use rpcx.transport / rpcx.transport_kit, or ask "
        "for what is missing to be made public):\n" + "\n".join(offences))
