"""Plots: per op, each case's speed-ups over the baseline above the peak memory, each contender
in its own colour in every plot of a run (matplotlib)."""

from __future__ import annotations

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


def write_plots(
    record: dict[str, Any], directory: str | Path, colour_of: dict[str, str] | None = None
) -> list[Path]:
    """Write ``<directory>/<op>.png`` for every op in ``record``: per case, each
    implementation's speed-up over the baseline above its peak memory, as labelled horizontal
    bars on linear axes (an outlier bar is cut and says so), as wide as the docs' text, each
    contender in its colour of ``colour_of`` (by default :func:`colours` of ``record``). Needs
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("plots need matplotlib (pip install matplotlib)") from e
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    m = record["machine"]
    color_of = colour_of or colours(record)
    written = []
    for op, rows in record["results"].items():
        # Per case a speed-up panel above a memory panel, 7.5 inches wide: about the docs'
        # text width at 110 dpi, so the labels read at their printed size.
        heights = [h for row in rows for h in [0.32 * len(row["results"]) + 0.7] * 2]
        fig, axes = plt.subplots(
            len(heights), 1, figsize=(7.5, sum(heights) + 0.4), dpi=110, squeeze=False,
            gridspec_kw={"height_ratios": heights},
        )  # fmt: skip
        pairs = zip(axes[0::2, 0], axes[1::2, 0], rows, strict=True)
        for ax_time, ax_mem, row in pairs:
            results, baseline = row["results"], row["baseline"]
            names = list(results)
            base = results[baseline]["time_s"]
            speedups = [base / results[n]["time_s"] for n in names]
            peaks = [results[n]["peak_bytes"] / 2**20 for n in names]
            colors = [color_of[n] for n in names]
            case = f"{row['case']}, {row['dtype']}"
            _bars(ax_time, names, speedups,
                  [f"{s:.2f}x ({results[n]['time_s'] * 1e3:.1f} ms)" for s, n in
                   zip(speedups, names, strict=True)],
                  colors, f"{case}: speed-up over {baseline}")  # fmt: skip
            ax_time.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
            _bars(ax_mem, names, peaks, [f"{p:.1f} MiB" for p in peaks], colors,
                  f"{case}: peak memory (MiB)", smallest_visible=True)  # fmt: skip
        fig.suptitle(
            f"{op} forward+backward on {m['device']} ({m['processor']}, {m['threads']} threads), "
            f"torch {m['torch']}, {record['date'][:10]}",
            fontsize=9,
        )
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / (sum(heights) + 0.4)))
        path = directory / f"{op}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
