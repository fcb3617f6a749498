"""``rpcx trace merge DIR -o OUT.json`` and ``rpcx trace plot DIR -o OUT.png``.

``merge`` writes one Chrome trace of every worker's ``*.rpcx-trace.json`` in DIR and
prints a summary line; its exit status is 1 if the aligned clocks still put a call's
steps out of order (each such call is printed). ``plot`` draws the timeline as a PNG.
Unusable input (no trace files, a bad file) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import sys

__all__ = ["merge_command", "plot_command"]

_MAX_VIOLATIONS = 20


def _fail(command: str, error: Exception) -> int:
    print(f"rpcx trace {command}: {error}", file=sys.stderr)
    return 2


def merge_command(directory: str, out: str) -> int:
    """``rpcx trace merge``: write the merged trace, print what it holds."""
    from rpcx.tracing.merge import TraceError, write_merged

    try:
        summary = write_merged(directory, out)
    except (TraceError, OSError) as e:
        return _fail("merge", e)
    if summary.unaligned:
        clock = f"clock error unknown (no clock samples from {', '.join(summary.unaligned)})"
    else:
        clock = f"worst clock error {(summary.worst_clock_error_ns or 0) / 1000:.1f} us"
    extra = ""
    if summary.incomplete_calls:
        extra += f", {summary.incomplete_calls} incomplete"
    if summary.dropped:
        extra += f", {summary.dropped} events dropped"
    print(f"{summary.path}: {summary.workers} workers, {summary.calls} calls{extra}, "
          f"{clock}, {len(summary.violations)} causality violations")
    for line in summary.violations[:_MAX_VIOLATIONS]:
        print(f"  {line}")
    if len(summary.violations) > _MAX_VIOLATIONS:
        print(f"  ... and {len(summary.violations) - _MAX_VIOLATIONS} more")
    return 1 if summary.violations else 0


def plot_command(directory: str, out: str, title: str | None = None) -> int:
    """``rpcx trace plot``: draw the timeline, print what was drawn."""
    from rpcx.tracing.merge import TraceError
    from rpcx.tracing.plot import plot_timeline

    try:
        summary = plot_timeline(directory, out, title=title)
    except (TraceError, OSError, ImportError) as e:
        return _fail("plot", e)
    workers = len({row.split(" / ", 1)[0] for row in summary.rows})
    print(f"{summary.path}: {len(summary.rows)} rows ({workers} workers), "
          f"{summary.spans} spans, {summary.arrows} arrows, {summary.instants} instants")
    return 0
