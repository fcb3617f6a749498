"""Summaries over rounds, the terminal table, the JSON record and the sweep plots.

Ratios compare each rpcx backend with torch.distributed.rpc and are oriented so that
**>1 means rpcx is better**: ``rpcx / torch`` for rates (calls/s, GB/s) and
``torch / rpcx`` for times (us, ms). Every figure is the median over rounds of the
round's own median; a system/workload that failed in every round shows as ``error``
with a numbered footnote giving the reason; one that failed in only some rounds shows
the median of the others, marked ``*``, with a footnote.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import statistics
from typing import Any

from floors import FLOORS
from systems import BASELINE
from workloads import WORKLOADS

Rounds = list[dict[str, Any]]  # see run.py: {"floors": {...}, "systems": {...}, ...}


# ------------------------------------------------------------------------- summaries


def _ok(entry: dict[str, Any] | None) -> bool:
    return entry is not None and "error" not in entry


def summarize(rounds: Rounds, systems: list[str], selected: list[str]) -> dict[str, Any]:
    """Medians over rounds of every scalar workload, sweep point and floor."""
    scalars: dict[str, dict[str, Any]] = {}
    sweeps: dict[str, dict[str, Any]] = {}
    for system in systems:
        scalars[system] = {}
        for name in selected:
            if name not in WORKLOADS:
                continue
            entries = [r["systems"].get(system, {}).get(name) for r in rounds]
            failures = [
                (i + 1, e["error"]) for i, e in enumerate(entries) if e is not None and not _ok(e)
            ]
            good = [e for e in entries if _ok(e)]
            if WORKLOADS[name].kind == "sweep":
                summary = _summarize_sweep(name, good)
                sweeps.setdefault(name, {})[system] = summary
                if failures:
                    sweeps[name][system]["failures"] = failures
                continue
            cell: dict[str, Any] = {"failures": failures}
            if good:
                cell["value"] = statistics.median(e["value"] for e in good)
                cell["rounds"] = [e["value"] for e in good]
            scalars[system][name] = cell
    floors: dict[str, Any] = {}
    for name in FLOORS:
        entries = [r["floors"].get(name) for r in rounds if name in r.get("floors", {})]
        if not entries:
            continue
        good = [e for e in entries if _ok(e)]
        floors[name] = {
            "value": statistics.median(e["value"] for e in good) if good else None,
            "failures": [e["error"] for e in entries if not _ok(e)],
        }
    return {"scalars": scalars, "sweeps": sweeps, "floors": floors}


def _summarize_sweep(name: str, good: list[dict[str, Any]]) -> dict[str, Any]:
    """Per point, the median over rounds (GB/s follows from the median latency)."""
    if not good:
        return {"points": []}
    if name == "size_sweep":
        sizes = sorted({p["bytes"] for e in good for p in e["points"]})
        points = []
        for size in sizes:
            lat = [p["latency_us"] for e in good for p in e["points"] if p["bytes"] == size]
            median = statistics.median(lat)
            points.append({"bytes": size, "latency_us": median,
                           "GBps": 2 * size / (median * 1e-6) / 1e9, "rounds_us": lat})
        return {"points": points}
    counts = sorted({p["clients"] for e in good for p in e["points"]})
    points = []
    for k in counts:
        rates = [p["calls_per_s"] for e in good for p in e["points"] if p["clients"] == k]
        points.append({"clients": k, "calls_per_s": statistics.median(rates), "rounds": rates})
    return {"points": points}


def ratio(value: float, base: float, higher_is_better: bool) -> float:
    """How many times better than ``base`` (>1 is better); ``inf`` where rpcx measured
    nothing at all of a cost (an idle worker's 0 ticks)."""
    if higher_is_better:
        return value / base if base else float("inf")
    return base / value if value else float("inf")


def ratios(summary: dict[str, Any], systems: list[str], selected: list[str]
           ) -> dict[str, dict[str, float | None]]:
    """``{system: {workload: ratio vs torch or None}}`` for the table's scalar rows."""
    scalars = summary["scalars"]
    out: dict[str, dict[str, float | None]] = {}
    for system in systems:
        out[system] = {}
        for name in selected:
            if name not in WORKLOADS or WORKLOADS[name].kind != "scalar":
                continue
            base = scalars.get(BASELINE, {}).get(name, {}).get("value")
            value = scalars.get(system, {}).get(name, {}).get("value")
            out[system][name] = (None if base is None or value is None
                                 else ratio(value, base, WORKLOADS[name].higher_is_better))
    return out


def column_names(systems: list[str], default: str | None) -> list[str]:
    """Column headers: each system, the default backend marked ``(default)``."""
    return [s + (" (default)" if s == default else "") for s in systems]


# ---------------------------------------------------------------------------- table


def _fmt(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def human_bytes(n: int) -> str:
    """``64 B``, ``16 KiB``, ``256 MiB``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


class _Notes:
    """Numbered footnotes for errors (the same text gets the same number)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, text: str) -> int:
        if text not in self.lines:
            self.lines.append(text)
        return self.lines.index(text) + 1


def _ratio_text(value: float) -> str:
    return f"{value:.2f}x" if value != float("inf") else "inf"


def _cell(cell: dict[str, Any] | None, base: float | None, higher: bool, system: str,
          what: str, notes: _Notes) -> str:
    if cell is None:
        return "-"
    failures = cell.get("failures", [])
    if cell.get("value") is None:
        reasons = sorted({reason for _, reason in failures})
        rounds = ",".join(str(i) for i, _ in failures)
        n = notes.add(f"{system} {what} (round {rounds}): {'; '.join(reasons)}")
        return f"error[{n}]"
    text = _fmt(cell["value"])
    if failures:
        rounds = ",".join(str(i) for i, _ in failures)
        n = notes.add(f"{system} {what}: failed in round {rounds}: "
                      f"{'; '.join(sorted({r for _, r in failures}))}")
        text += f"*[{n}]"
    if base is not None and system != BASELINE:
        text += f" ({_ratio_text(ratio(cell['value'], base, higher))})"
    return text


def table(summary: dict[str, Any], systems: list[str], selected: list[str],
          notes_extra: list[str], condition: str | None = None,
          default: str | None = None, placement: str | None = None) -> str:
    """The terminal report: the workload table, both sweeps, the floors, footnotes.

    ``condition`` (``quiet``/``busy``, see conditions.py) and ``placement`` (one host or
    two, see placement.py) head the table; the column of ``default`` (the backend
    ``init_rpc`` uses unnamed) is marked ``(default)``.
    """
    notes = _Notes()
    scalars = summary["scalars"]
    columns = column_names(systems, default)
    label_w, unit_w = 44, 8
    col_w = max(20, *(len(c) + 2 for c in columns))
    out: list[str] = []
    if condition:
        out.append(f"condition: {condition}")
    if placement:
        out.append(f"placement: {placement}")

    def header(first: str, unit: str = "unit") -> str:
        return f"{first:<{label_w}}{unit:<{unit_w}}" + "".join(f"{c:>{col_w}}" for c in columns)

    rows = [n for n in selected if n in WORKLOADS and WORKLOADS[n].kind == "scalar"]
    if rows:
        out.append(header("workload"))
        for name in rows:
            w = WORKLOADS[name]
            base_cell = scalars.get(BASELINE, {}).get(name)
            base = base_cell.get("value") if base_cell else None
            cells = [
                _cell(scalars[s].get(name), base, w.higher_is_better, s, name, notes)
                for s in systems
            ]
            out.append(f"{w.label:<{label_w}}{w.unit:<{unit_w}}"
                       + "".join(f"{c:>{col_w}}" for c in cells))

    size = summary["sweeps"].get("size_sweep")
    if size:
        for key, unit, higher, title in (
            ("latency_us", "us", False, "echo round trip by size"),
            ("GBps", "GB/s", True, "echo bandwidth by size (both directions)"),
        ):
            out.append("")
            out.append(header(title, unit))
            sizes = sorted({p["bytes"] for s in size.values() for p in s["points"]})
            for nbytes in sizes:
                base = _point(size.get(BASELINE), "bytes", nbytes, key)
                cells = []
                for s in systems:
                    value = _point(size.get(s), "bytes", nbytes, key)
                    cells.append(_sweep_cell(value, base, higher, s, size.get(s), notes,
                                             "size_sweep"))
                out.append(f"{'  ' + human_bytes(nbytes):<{label_w}}{unit:<{unit_w}}"
                           + "".join(f"{c:>{col_w}}" for c in cells))

    clients = summary["sweeps"].get("clients_sweep")
    if clients:
        out.append("")
        out.append(header("aggregate small rpc_sync by clients", "calls/s"))
        counts = sorted({p["clients"] for s in clients.values() for p in s["points"]})
        if not counts:
            counts = [0]
        for k in counts:
            base = _point(clients.get(BASELINE), "clients", k, "calls_per_s")
            cells = []
            for s in systems:
                value = _point(clients.get(s), "clients", k, "calls_per_s")
                cells.append(_sweep_cell(value, base, True, s, clients.get(s), notes,
                                         "clients_sweep"))
            label = f"  {k} client{'s' if k != 1 else ''}" if k else "  (no points)"
            out.append(f"{label:<{label_w}}{'calls/s':<{unit_w}}"
                       + "".join(f"{c:>{col_w}}" for c in cells))

    floors = summary["floors"]
    if floors:
        out.append("")
        out.append(f"{'floors (same run, no RPC layer)':<{label_w}}{'unit':<{unit_w}}"
                   f"{'value':>{col_w}}")
        for name, cell in floors.items():
            label, unit, _ = FLOORS[name]
            if cell["value"] is None:
                n = notes.add(f"floor {name}: {'; '.join(cell['failures'])}")
                text = f"error[{n}]"
            else:
                text = _fmt(cell["value"])
            out.append(f"{label:<{label_w}}{unit:<{unit_w}}{text:>{col_w}}")

    out.append("")
    out.append("ratios (in parentheses): rpcx backend vs torch.distributed.rpc, >1 is better "
               "(rpcx/torch for calls/s and GB/s, torch/rpcx for us and ms); "
               "medians over rounds")
    if "loopback" in systems:
        out.append("loopback's workers are threads of one process; the other systems' are "
                   "processes")
    for i, line in enumerate(notes.lines, 1):
        out.append(f"[{i}] {line}")
    out.extend(f"note: {line}" for line in notes_extra)
    return "\n".join(out)


def _point(sweep: dict[str, Any] | None, key: str, at: int, field: str) -> float | None:
    if not sweep:
        return None
    for p in sweep["points"]:
        if p[key] == at:
            return float(p[field])
    return None


def _sweep_cell(value: float | None, base: float | None, higher: bool, system: str,
                sweep: dict[str, Any] | None, notes: _Notes, what: str) -> str:
    if value is None:
        failures = (sweep or {}).get("failures", [])
        if failures:
            rounds = ",".join(str(i) for i, _ in failures)
            reasons = "; ".join(sorted({r for _, r in failures}))
            return f"error[{notes.add(f'{system} {what} (round {rounds}): {reasons}')}]"
        return "-"
    text = _fmt(value)
    failures = (sweep or {}).get("failures", [])
    if failures:
        rounds = ",".join(str(i) for i, _ in failures)
        reasons = "; ".join(sorted({r for _, r in failures}))
        text += f"*[{notes.add(f'{system} {what}: failed in round {rounds}: {reasons}')}]"
    if base is not None and system != BASELINE:
        text += f" ({_ratio_text(ratio(value, base, higher))})"
    return text


# ----------------------------------------------------------------------------- files


def write_json(path: pathlib.Path, record: dict[str, Any]) -> None:
    """The full record: metadata, every round's raw results, the medians."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str))


SYSTEM_STYLE = {
    "torch": {"color": "black", "marker": "o", "linestyle": "-"},
    "gloo": {"color": "tab:blue", "marker": "s", "linestyle": "-"},
    "tensorpipe": {"color": "tab:orange", "marker": "^", "linestyle": "-"},
    "loopback": {"color": "tab:green", "marker": "D", "linestyle": "--"},
    "shm": {"color": "tab:purple", "marker": "v", "linestyle": "-"},
    "auto": {"color": "darkviolet", "marker": "*", "linestyle": "-"},
    "tcp": {"color": "teal", "marker": "p", "linestyle": "-"},
    "zmq": {"color": "tab:red", "marker": "P", "linestyle": "-"},
}
# A backend without a style of its own (a third-party plugin) gets one of these in turn.
_SPARE_STYLES = [{"color": c, "marker": m, "linestyle": "-."}
                 for c, m in (("tab:brown", "X"), ("tab:pink", "*"), ("tab:olive", "h"),
                              ("tab:cyan", "p"), ("tab:gray", "<"))]


def _style(system: str, systems: list[str]) -> dict[str, str]:
    """The plot style of ``system``: its own, else a spare one by its place among the
    unstyled systems of this run (so two plugins never share one)."""
    if system in SYSTEM_STYLE:
        return SYSTEM_STYLE[system]
    unstyled = [s for s in systems if s not in SYSTEM_STYLE]
    return _SPARE_STYLES[unstyled.index(system) % len(_SPARE_STYLES)]


def _title_suffix(meta: dict[str, Any]) -> str:
    mode = "quick" if meta.get("quick") else "full"
    if meta.get("condition"):
        mode += f", {meta['condition']}"
    if meta.get("placement") and meta["placement"] != "one-host":
        mode += f", {meta['placement']}"
    return (f"{meta.get('started', '')[:16]}  {meta.get('cpus')} CPUs, torch "
            f"{meta.get('torch')}, {meta.get('rounds')} round(s), {mode}, "
            f"OMP_NUM_THREADS={meta.get('omp_num_threads')}")


def _sweep(summary: dict[str, Any], name: str, systems: list[str]) -> dict[str, Any] | None:
    """The sweep ``name`` if any of ``systems`` has points in it."""
    sweep: dict[str, Any] | None = summary["sweeps"].get(name)
    if not sweep or not any(sweep.get(s, {}).get("points") for s in systems):
        return None
    return sweep


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: pathlib.Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sizes(path: pathlib.Path, summary: dict[str, Any], systems: list[str],
               meta: dict[str, Any]) -> bool:
    """Latency and GB/s against message size, log-log, one line per system."""
    sweep = _sweep(summary, "size_sweep", systems)
    if sweep is None:
        return False
    plt = _pyplot()
    from matplotlib.ticker import FixedLocator, NullLocator

    fig, (ax_lat, ax_bw) = plt.subplots(1, 2, figsize=(13, 5.2))
    sizes: list[int] = []
    for system in systems:
        points = sweep.get(system, {}).get("points", [])
        if not points:
            continue
        x = [p["bytes"] for p in points]
        sizes = sorted(set(sizes) | set(x))
        style = _style(system, systems)
        ax_lat.plot(x, [p["latency_us"] for p in points], label=system, **style)
        ax_bw.plot(x, [p["GBps"] for p in points], label=system, **style)
    floors = summary.get("floors", {})
    for name, ax, color in (("unix_rtt", ax_lat, "gray"), ("tcp_rtt", ax_lat, "silver"),
                            ("memcpy", ax_bw, "gray")):
        value = floors.get(name, {}).get("value")
        if value:
            label, unit, _ = FLOORS[name]
            ax.axhline(value, color=color, linestyle=":", linewidth=1.2,
                       label=f"floor: {label} ({_fmt(value)} {unit})")
    for ax, ylabel, title in (
        (ax_lat, "round trip (us, median)", "echo latency"),
        (ax_bw, "GB/s (both directions)", "echo bandwidth"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticks(sizes, [human_bytes(s) for s in sizes], rotation=30)
        ax.set_xlabel("tensor size (uint8)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"rpcx vs torch.distributed.rpc: echo of one tensor, 2 workers\n"
                 f"{_title_suffix(meta)}", fontsize=10)
    _save(plt, fig, path)
    return True


def plot_clients(path: pathlib.Path, summary: dict[str, Any], systems: list[str],
                 meta: dict[str, Any]) -> bool:
    """Aggregate calls/s against the number of clients, one line per system."""
    sweep = _sweep(summary, "clients_sweep", systems)
    if sweep is None:
        return False
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(8, 5.2))
    counts: set[int] = set()
    for system in systems:
        points = sweep.get(system, {}).get("points", [])
        if not points:
            continue
        x = [p["clients"] for p in points]
        counts |= set(x)
        label = system + (" (threads of one process)" if system == "loopback" else "")
        ax.plot(x, [p["calls_per_s"] for p in points], label=label,
                **_style(system, systems))
    ax.set_xticks(sorted(counts))
    ax.set_xlabel("concurrent client workers (each: small rpc_sync in a loop)")
    ax.set_ylabel("aggregate calls/s to one server")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=9)
    ax.set_title(f"rpcx vs torch.distributed.rpc: one server, 1-{max(counts)} clients\n"
                 f"{_title_suffix(meta)}", fontsize=10)
    _save(plt, fig, path)
    return True


def copy_latest(paths: list[pathlib.Path], out_dir: pathlib.Path) -> None:
    """Also keep the newest plots as ``latest-*.png`` (for docs to pick up)."""
    for path in paths:
        suffix = path.name.split("-")[-1]
        shutil.copyfile(path, out_dir / f"latest-{suffix}")
