"""Import torch without its numpy warning: the first thing ``import rpcx`` does.

Where numpy is not installed, ``import torch`` prints ``UserWarning: Failed to initialize
NumPy: No module named 'numpy'``. rpcx never needs numpy (only ``Tensor.numpy()`` and
friends do, and they still raise "Numpy is not available"), so a program or an ``rpcx``
command that imports rpcx before torch prints nothing about it. A program that imports
torch first has seen the warning before rpcx loads; the docs say what it is.

Only that one warning is dropped, only while torch is being imported, and the warning
filters are left as they are (torch adds its own at import; a ``catch_warnings`` block
would throw those away).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

# (Only numpy missing: the same warning for a numpy torch cannot use, e.g. "_ARRAY_API not
# found", is one a user needs to see.)
_NUMPY_MISSING = "Failed to initialize NumPy: No module named"


def import_torch() -> None:
    """Import torch, dropping its "Failed to initialize NumPy: No module named ..."
    warning (once imported, this does nothing)."""
    if "torch" in sys.modules:
        return
    shown = warnings.showwarning

    def show_unless_numpy_missing(message: Warning | str, category: type[Warning],
                                  filename: str, lineno: int, file: Any = None,
                                  line: str | None = None) -> None:
        if not (issubclass(category, UserWarning) and str(message).startswith(_NUMPY_MISSING)):
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show_unless_numpy_missing
    try:
        import torch  # noqa: F401
    finally:
        if warnings.showwarning is show_unless_numpy_missing:  # (unless torch replaced it)
            warnings.showwarning = shown


import_torch()
