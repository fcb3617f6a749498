"""The tree, the import contract and the architecture doc show the same layers.

``lint-imports`` checks only the modules a layers contract names; a module left out of
the list would be free to import anything. So every module and package of a container
the contract layers must be in its list, and every top-level entry of ``rpcx/`` must be
drawn in docs/design/architecture.md's tree.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
CONTRACTS: list[dict[str, Any]] = tomllib.loads((ROOT / "pyproject.toml").read_text())[
    "tool"]["importlinter"]["contracts"]


def _entries(container: str) -> set[str]:
    """The modules and packages directly in ``container`` (dotted)."""
    path = ROOT.joinpath(*container.split("."))
    return ({p.stem for p in path.glob("*.py") if p.stem != "__init__"}
            | {p.name for p in path.iterdir() if (p / "__init__.py").is_file()})


def _listed(layers: list[str]) -> set[str]:
    return {name.strip() for layer in layers for name in layer.split("|")}


LAYERED = [(c["name"], container, c["layers"]) for c in CONTRACTS if c["type"] == "layers"
           for container in c["containers"]]


@pytest.mark.parametrize(("name", "container", "layers"), LAYERED,
                         ids=[container for _, container, _ in LAYERED])
def test_every_module_of_a_layered_container_has_its_layer(
        name: str, container: str, layers: list[str]) -> None:
    listed, present = _listed(layers), _entries(container)
    assert present - listed == set(), f"{name}: not in a layer"
    assert listed - present == set(), f"{name}: names what is not there"


def test_the_architecture_doc_draws_every_top_level_entry() -> None:
    text = (ROOT / "docs" / "design" / "architecture.md").read_text()
    tree = text[text.index("```\nrpcx/\n"):]
    tree = tree[:tree.index("```", 4)]
    drawn = set(re.findall(r"\b(_{0,2}[a-z][a-z_]*)", tree))
    assert _entries("rpcx") - drawn == set()
