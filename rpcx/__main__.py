"""``python -m rpcx``: the command line (see :mod:`rpcx.cli`)."""

from __future__ import annotations

import sys

from rpcx.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
