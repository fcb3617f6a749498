"""``rpcx trace plot``: the merged timeline as a PNG (matplotlib, Agg).

A row per worker and thread that has spans (workers in rank order) and one more per extra
lane of a thread (``worker / thread #N``: the merged trace's lanes, for spans in flight
together that do not nest), a bar per span, an arrow per message, a marker per instant;
the x axis is reference-clock ms from the earliest event. matplotlib is imported only when
a plot is drawn: the rest of ``rpcx.tracing`` does not need it.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rpcx.tracing.merge import TraceError, merge

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["FAMILIES", "PlotSummary", "label_family", "plot_timeline"]

# Label family -> colour. Saturated colours on purpose: everything else on the plot (text,
# arrows, worker shading) is grey, so a bar is told apart from the rest by its hue.
FAMILIES: dict[str, str] = {
    "rpc_sync": "#1f77b4",
    "rpc_async": "#ff7f0e",
    "remote": "#2ca02c",
    "backward": "#d62728",
    "other": "#9467bd",
}
_ROW_HEIGHT_IN = 0.32
_DPI = 100


@dataclass(frozen=True)
class PlotSummary:
    """What :func:`plot_timeline` drew.

    ``row_bands`` is each row's (top, bottom) pixel rows in the PNG, in ``rows`` order;
    ``plot_box`` the axes' (left, top, right, bottom) in pixels.
    """

    rows: list[str]
    spans: int
    arrows: int
    instants: int
    path: pathlib.Path
    row_bands: list[tuple[int, int]]
    plot_box: tuple[int, int, int, int]


def label_family(label: str) -> str:
    """The colour family of a span label (``api#target``): rpc_sync, rpc_async, remote,
    backward or other."""
    api = label.split("#", 1)[0]
    if api in ("rpc_sync", "rpc_async", "remote"):
        return api
    return "backward" if "backward" in label.lower() else "other"


def _load(source: str | os.PathLike[str] | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(source, Mapping):
        return source
    path = pathlib.Path(source)
    if path.is_dir():
        return merge(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TraceError(f"{path}: not a trace directory or merged trace: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceError(f"{path}: not a merged trace (no traceEvents)")
    return data


def plot_timeline(directory_or_merged: str | os.PathLike[str] | Mapping[str, Any],
                  out_png: str | os.PathLike[str], *, title: str | None = None
                  ) -> PlotSummary:
    """Draw a trace directory, a merged trace file, or :func:`merge`'s dict to ``out_png``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as missing:
        raise ImportError("rpcx trace plot needs matplotlib: pip install matplotlib"
                          ) from missing

    merged = _load(directory_or_merged)
    events: list[dict[str, Any]] = list(merged["traceEvents"])
    processes: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    spans = [e for e in events if e.get("ph") == "X"]
    # A thread's extra lanes (spans in flight together that do not nest, each lane on a
    # thread id of its own; docs/design/tracing.md): (pid, lane's tid) -> (thread, lane).
    lane_of: dict[tuple[int, int], tuple[int, int]] = {
        (lane["pid"], lane["tid"]): (lane["thread"], lane["lane"])
        for lane in merged.get("metadata", {}).get("lanes", [])}

    def thread_lane(key: tuple[int, int]) -> tuple[int, int, int]:
        thread, lane = lane_of.get(key, (key[1], 0))
        return key[0], thread, lane

    # Rows: workers by rank (pid), a worker's threads by when they first did something,
    # a thread's lanes right after it.
    first: dict[tuple[int, int], float] = {}  # (pid, thread) -> its first span's start
    keys_seen: set[tuple[int, int]] = set()
    for s in spans:
        key = (s["pid"], s["tid"])
        keys_seen.add(key)
        pid, thread, _ = thread_lane(key)
        first[(pid, thread)] = min(first.get((pid, thread), s["ts"]), s["ts"])

    def order(key: tuple[int, int]) -> tuple[int, float, int, int]:
        pid, thread, lane = thread_lane(key)
        return pid, first[(pid, thread)], thread, lane

    keys = sorted(keys_seen, key=order)
    row_of = {k: i for i, k in enumerate(keys)}
    first_row_of_pid: dict[int, int] = {}
    for k, i in row_of.items():
        first_row_of_pid.setdefault(k[0], i)

    def row(pid: int, tid: int) -> int | None:
        # A message or instant on a thread without spans goes on its worker's first row.
        return row_of.get((pid, tid), first_row_of_pid.get(pid))

    labels = []
    for key in keys:
        p, t, lane = thread_lane(key)
        label = f"{processes.get(p, f'rank {p}')} / {threads.get((p, t), f'thread {t}')}"
        labels.append(f"{label} #{lane}" if lane else label)
    n = max(len(keys), 1)
    fig = Figure(figsize=(14, 1.6 + _ROW_HEIGHT_IN * n), dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    _shade_workers(ax, keys)

    families_seen: set[str] = set()
    for cat, height, alpha in (("call", 0.72, 0.45), ("serve", 0.44, 0.95)):
        # Callers' spans tall and pale, serves short and solid: a thread that serves inside
        # its own call (a call to itself) still shows both.
        by_family: dict[str, tuple[list[int], list[float], list[float]]] = {}
        for s in spans:
            if ("call" if s.get("cat") == "call" else "serve") != cat:
                continue
            fam = label_family(str(s.get("name", "")))
            ys, lefts, widths = by_family.setdefault(fam, ([], [], []))
            ys.append(row_of[(s["pid"], s["tid"])])
            lefts.append(s["ts"] / 1000)
            widths.append(s.get("dur", 0) / 1000)
        for fam, (ys, lefts, widths) in by_family.items():
            families_seen.add(fam)
            # An edge in the bar's own colour keeps a span shorter than a pixel visible.
            ax.barh(ys, widths, left=lefts, height=height, color=FAMILIES[fam],
                    edgecolor=FAMILIES[fam], linewidth=0.4, alpha=alpha)

    starts: dict[Any, dict[str, Any]] = {}
    arrows = 0
    for e in events:
        if e.get("ph") == "s":
            starts[(e.get("cat"), e["id"])] = e
    for e in events:
        if e.get("ph") != "f":
            continue
        src = starts.get((e.get("cat"), e["id"]))
        if src is None:
            continue
        y0, y1 = row(src["pid"], src["tid"]), row(e["pid"], e["tid"])
        if y0 is None or y1 is None:
            continue
        ax.annotate("", xy=(e["ts"] / 1000, y1), xytext=(src["ts"] / 1000, y0),
                    arrowprops={"arrowstyle": "-|>", "color": "0.2", "alpha": 0.3,
                                "lw": 0.6, "shrinkA": 0, "shrinkB": 0,
                                "mutation_scale": 6})
        arrows += 1

    xs: list[float] = []
    ys_i: list[float] = []
    for e in events:
        if e.get("ph") == "i":
            r = row(e["pid"], e["tid"])
            if r is not None:
                xs.append(e["ts"] / 1000)
                ys_i.append(r - 0.38)
    if xs:
        ax.scatter(xs, ys_i, marker="v", s=14, color="black", zorder=3, linewidths=0)

    ax.set_ylim(n - 0.5, -0.5)  # first row on top
    ax.set_yticks(range(len(keys)), labels, fontsize=8)
    ax.set_xlabel("ms (reference clock, from the earliest event)")
    ax.grid(axis="x", color="0.85", linewidth=0.5)
    ax.set_axisbelow(True)
    if not spans:
        ax.text(0.5, 0.5, "no complete spans", transform=ax.transAxes, ha="center",
                va="center", color="0.4")
    meta = merged.get("metadata", {})
    if title is None:
        calls = meta.get("calls", len(spans))
        title = f"rpcx trace: {len(processes)} workers, {calls} calls"
    ax.set_title(title, loc="left", fontsize=10)
    handles = [Patch(color=FAMILIES[f], label=f) for f in FAMILIES if f in families_seen]
    if handles:
        ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=5,
                  fontsize=8, frameon=False, borderaxespad=0.2)
    fig.tight_layout()
    out = pathlib.Path(out_png)
    try:
        fig.savefig(out, dpi=_DPI)
    except OSError as failed:
        raise TraceError(f"{out}: cannot write: {failed}") from None

    # Pixel geometry, from the layout the PNG was drawn with (display y grows upwards,
    # image rows downwards).
    height_px = fig.get_figheight() * _DPI
    to_px = ax.transData.transform
    bands: list[tuple[int, int]] = []
    for i in range(len(keys)):
        (_, y_top), (_, y_bottom) = to_px([(0, i - 0.4), (0, i + 0.4)])
        bands.append((round(height_px - y_top), round(height_px - y_bottom)))
    box = ax.get_window_extent()
    plot_box = (round(box.x0), round(height_px - box.y1), round(box.x1),
                round(height_px - box.y0))
    return PlotSummary(rows=labels, spans=len(spans), arrows=arrows, instants=len(xs),
                       path=out, row_bands=bands, plot_box=plot_box)


def _shade_workers(ax: Axes, keys: list[tuple[int, int]]) -> None:
    """Every other worker's rows on a light grey band, so a worker's threads read as one."""
    groups: list[tuple[int, int]] = []  # (first row, last row) per worker
    for i, (pid, _) in enumerate(keys):
        if groups and keys[groups[-1][0]][0] == pid:
            groups[-1] = (groups[-1][0], i)
        else:
            groups.append((i, i))
    for g, (lo, hi) in enumerate(groups):
        if g % 2:
            ax.axhspan(lo - 0.5, hi + 0.5, color="0.94", zorder=0, linewidth=0)
        if g:
            ax.axhline(lo - 0.5, color="0.6", linewidth=0.6, zorder=1)
