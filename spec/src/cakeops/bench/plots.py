"""Plots: one figure per op and case, each contender's speed-up over the baseline above its peak
memory, each contender in its own colour in every figure of a run (matplotlib)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def _clip(values: list[float]) -> float:
    """The axis limit of a bar chart: the largest value, unless it dwarfs the others (over 4x
    the second largest), in which case 1.3x the second: that bar is cut and labelled."""
    ordered = sorted(values, reverse=True)
    if len(ordered) > 1 and ordered[1] > 0 and ordered[0] > 4 * ordered[1]:
        return 1.3 * ordered[1]
    return 1.15 * ordered[0] if ordered and ordered[0] > 0 else 1.0


def _bars(ax, labels: list[str], values: list[float], text: list[str], colors, title: str,
          smallest_visible: bool = False):  # fmt: skip
    """Horizontal bars with their values written on them; a bar past the axis is cut there
    (``smallest_visible``: the axis ends at most 10x the smallest bar, so it always shows)."""
    limit = _clip(values)
    positive = [v for v in values if v > 0]
    if smallest_visible and positive:
        limit = min(limit, 10 * min(positive))
    ys = range(len(labels))
    ax.barh(ys, [min(v, limit) for v in values], color=colors)
    for y, v, t in zip(ys, values, text, strict=True):
        cut = v > limit
        ax.text(min(v, limit) * (0.98 if cut else 1.0) + (0 if cut else 0.01 * limit), y,
                f"{t} (cut)" if cut else t, va="center", ha="right" if cut else "left",
                fontsize=8, color="white" if cut else "black")  # fmt: skip
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, limit * 1.25)
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelsize=7)


#: the op on each backend: the same colour in every plot and every run
BACKEND_COLOURS = {
    "cakeops [numba]": "tab:blue",
    "cakeops [torch]": "tab:orange",
    "cakeops [triton]": "tab:purple",
    "cakeops [reference]": "tab:gray",
}
#: the other contenders' colours, handed out in order of first appearance in a record
OTHER_COLOURS = ("tab:green", "tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:cyan",
                 "#393b79", "#8c6d31", "#843c39", "#7b4173", "#637939", "#3182bd", "#e6550d",
                 "#31a354", "#756bb1", "#636363")  # fmt: skip


def colours(record: dict[str, Any]) -> dict[str, str]:
    """One colour per contender across every plot of ``record``: the op's rows by backend, the
    rest (composites, compiled code, peers) in order of first appearance over all ops. Labels
    beyond the palette's length share its colours in turn."""
    labels = dict.fromkeys(
        name for rows in record["results"].values() for row in rows for name in row["results"]
    )
    colour_of = {name: c for name, c in BACKEND_COLOURS.items() if name in labels}
    others = [name for name in labels if name not in colour_of]
    for i, name in enumerate(others):
        colour_of[name] = OTHER_COLOURS[i % len(OTHER_COLOURS)]
    return colour_of


def slug(text: str) -> str:
    """A case's name as a file name: lower case, runs of other characters as one ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def plot_paths(record: dict[str, Any], directory: str | Path) -> dict[str, list[Path]]:
    """Where :func:`write_plots` puts each op's figures: ``<directory>/<op>/<case>-<dtype>.png``,
    one per case, in the record's order."""
    directory = Path(directory)
    return {
        op: [directory / op / f"{slug(row['case'])}-{row['dtype']}.png" for row in rows]
        for op, rows in record["results"].items()
    }


#: Figure width in inches at ``DPI``: about the docs' text width, so labels read at their
#: printed size without zooming.
WIDTH_IN, DPI = 7.5, 110


def write_plots(
    record: dict[str, Any], directory: str | Path, colour_of: dict[str, str] | None = None
) -> list[Path]:
    """Write one figure per op and case (see :func:`plot_paths`): each implementation's
    speed-up over the baseline above its peak memory, as labelled horizontal bars on linear
    axes (an outlier bar is cut and says so), as wide as the docs' text, titled with the case
    and the run's machine and date, each contender in its colour of ``colour_of`` (by default
    :func:`colours` of ``record``). Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plots need matplotlib (pip install matplotlib)") from e
    m = record["machine"]
    color_of = colour_of or colours(record)
    machine = (f"{m['device']} ({m['processor']}, {m['threads']} threads), torch {m['torch']}, "
               f"{record['date'][:10]}")  # fmt: skip
    written = []
    for op, rows in record["results"].items():
        for row, path in zip(rows, plot_paths(record, directory)[op], strict=True):
            results, baseline = row["results"], row["baseline"]
            names = list(results)
            panel = 0.32 * len(names) + 0.7
            title = 0.55
            fig, (ax_time, ax_mem) = plt.subplots(
                2, 1, figsize=(WIDTH_IN, 2 * panel + title), dpi=DPI, layout="constrained"
            )
            base = results[baseline]["time_s"]
            speedups = [base / results[n]["time_s"] for n in names]
            peaks = [results[n]["peak_bytes"] / 2**20 for n in names]
            colors = [color_of[n] for n in names]
            _bars(ax_time, names, speedups,
                  [f"{s:.2f}x ({results[n]['time_s'] * 1e3:.1f} ms)" for s, n in
                   zip(speedups, names, strict=True)],
                  colors, f"speed-up over {baseline}")  # fmt: skip
            ax_time.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
            _bars(ax_mem, names, peaks, [f"{p:.1f} MiB" for p in peaks], colors,
                  "peak memory (MiB)", smallest_visible=True)  # fmt: skip
            fig.suptitle(f"{op} forward+backward, {row['case']}, {row['dtype']}\n{machine}",
                         fontsize=9)  # fmt: skip
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path)
            plt.close(fig)
            written.append(path)
    return written
