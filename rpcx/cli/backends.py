"""``rpcx backends [--names | --wide]``: the installed backends and what they can do."""

from __future__ import annotations

import sys
import textwrap

from rpcx.registry import DEFAULT_BACKEND, ENV_VAR, available_backends, plugin_errors

__all__ = ["WIDTH", "list_backends"]

# The widest line of the default listing: an 80-column terminal's, and what a code block
# of the documentation site shows at a laptop's width (1366 px) without scrolling.
WIDTH = 80
INDENT = "    "  # a backend's description and capabilities, under its name


def list_backends(names_only: bool, wide: bool = False) -> int:
    """Print the backends (``--names``: one name per line; by default each on three lines:
    name and plugin, description, capabilities; ``--wide``: a table, one line each);
    exit status."""
    specs = available_backends()
    if names_only:
        for name in sorted(specs):
            print(name)
        return 0
    rows = [("name", "capabilities", "plugin", "description")]
    for name in sorted(specs):
        spec = specs[name]
        marker = " (default)" if name == DEFAULT_BACKEND else ""
        rows.append((name + marker, spec.capabilities.summary(), spec.plugin,
                     spec.description or "-"))
    if wide:
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        for row in rows:
            cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
            print("  ".join(cells) + "  " + row[3])
    else:
        width = max(len(row[0]) for row in rows)
        for name, capabilities, plugin, description in rows:
            print(f"{name.ljust(width)}  {plugin}")
            for text in (description, capabilities):
                # (a capability is one word: lines break after the commas between them)
                print(textwrap.fill(text, WIDTH, initial_indent=INDENT,
                                    subsequent_indent=INDENT, break_long_words=False,
                                    break_on_hyphens=False))
    for plugin, error in sorted(plugin_errors().items()):
        print(f"\nplugin {plugin!r} {error}", file=sys.stderr)
    print(f"\nSelect with init_rpc(backend=...) or ${ENV_VAR}. One line each: --wide.")
    return 0
