"""``rpcx backends [--names]``: the installed backends and what they can do."""

from __future__ import annotations

import sys

from rpcx.registry import DEFAULT_BACKEND, ENV_VAR, available_backends, plugin_errors

__all__ = ["list_backends"]


def list_backends(names_only: bool) -> int:
    """Print the backends (a table, or ``--names``: one name per line); exit status."""
    specs = available_backends()
    if names_only:
        for name in sorted(specs):
            print(name)
        return 0
    rows = [("name", "capabilities", "plugin", "description")]
    for name in sorted(specs):
        spec = specs[name]
        marker = " (default)" if name == DEFAULT_BACKEND else ""
        rows.append((name + marker, spec.capabilities.summary(), spec.plugin, spec.description))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print("  ".join(cells) + "  " + row[3])
    for plugin, error in sorted(plugin_errors().items()):
        print(f"\nplugin {plugin!r} {error}", file=sys.stderr)
    print(f"\nSelect with init_rpc(backend=...) or ${ENV_VAR}.")
    return 0
