"""Tests of torch's suite known to fail on rpcx, with the reason (docs/compatibility.md)."""

from __future__ import annotations

from typing import NamedTuple


class Known(NamedTuple):
    category: str
    reason: str
    backends: frozenset[str] | None = None  # None: every rpcx backend


KNOWN: dict[str, Known] = {}


def expected_failure(key: str, backend: str) -> Known | None:
    """The known failure of ``SUITE.test`` on ``backend``, if any (never on torch)."""
    if backend == "torch":
        return None
    known = KNOWN.get(key)
    if known is None or (known.backends is not None and backend not in known.backends):
        return None
    return known
