"""The user's documentation names no private module: what a page tells users to import
is public and stays put.

A dotted path in ``README.md`` or under ``docs/`` (design notes aside: they describe the
insides by name, as they must) is read as far as it names a module; if any part of that
module's path starts with ``_``, the page names rpcx's insides. Names of functions in a
public module (``rpcx._set_rpc_timeout``, torch's own name) are not module paths, nor
are logger names (``rpcx.agent``).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md",
                *(p for p in (ROOT / "docs").rglob("*.md") if "design" not in p.parts)])
DOTTED = re.compile(r"\brpcx(?:\.\w+)+")


def module_part(dotted: str) -> str:
    """The longest prefix of ``dotted`` that is an importable module."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        try:
            if importlib.util.find_spec(candidate) is not None:
                return candidate
        except (ImportError, ValueError):
            continue
    return parts[0]


def private_paths(text: str) -> list[str]:
    """Every private module ``text`` names (dotted), in order of appearance."""
    found = []
    for match in DOTTED.finditer(text):
        module = module_part(match.group(0).rstrip("."))
        if any(part.startswith("_") for part in module.split(".")[1:]):
            found.append(module)
    return found


def test_the_check_tells_a_private_module_from_a_private_name() -> None:
    text = ("see rpcx._core.agent, rpcx._set_rpc_timeout and rpcx.MembershipChange; "
            "rpcx.transport_kit.Link; rpcx._util.moved.MOVED.")
    assert private_paths(text) == ["rpcx._core.agent", "rpcx._util.moved"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_page_names_no_private_module(page: Path) -> None:
    assert private_paths(page.read_text()) == []
