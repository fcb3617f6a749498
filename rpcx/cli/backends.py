"""Command line: ``python -m rpcx backends [--names]``."""

from __future__ import annotations

import argparse
import sys

from rpcx.registry import DEFAULT_BACKEND, ENV_VAR, available_backends, plugin_errors

__all__ = ["main"]


def _backends(names_only: bool) -> int:
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m rpcx`` and the ``rpcx`` script."""
    parser = argparse.ArgumentParser(prog="python -m rpcx", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    backends = commands.add_parser("backends", help="list the installed backends")
    backends.add_argument("--names", action="store_true", help="print one name per line")
    args = parser.parse_args(argv)
    if args.command == "backends":
        return _backends(args.names)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
