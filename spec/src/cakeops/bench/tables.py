"""Tables: the printed table of a case and the Markdown pages the docs include."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cakeops.bench import limits as machine
from cakeops.bench.limits import Work


def _mb(n: float) -> str:
    return f"{n / 2**20:8.1f}"


def _of_limit(work: Work | dict | None, dtype: str, seconds: float, limits=None) -> str:
    """``"23% of copy bandwidth"``, or ``""`` without work or limits."""
    if isinstance(work, dict):
        work = Work(**work)
    share, key = machine.fraction(work, dtype, seconds, limits)
    return "" if share is None else f"{share:.0%} of {machine.NAMES[key]}"


def format_table(
    title: str, results: dict[str, dict[str, float]], baseline: str,
    work: Work | None = None, dtype: torch.dtype | str = "float32",
) -> str:  # fmt: skip
    """The printed table of one case; with ``work``, each row's fraction of the run's limit."""
    dtype = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    base = results[baseline]
    counted = _faults_counted(results)
    lines = [
        title,
        f"  {'implementation':<28} {'time ms':>9} {'spread':>7} {'vs ' + baseline:>12} "
        f"{'peak MiB':>9} {'saved MiB':>9}"
        + (f" {'faults':>7}" if counted else "")
        + f"  {'of the limit' if work else ''}",
    ]
    for label, r in results.items():
        ratio = base["time_s"] / r["time_s"]
        repeats = f"{r.get('spread', 0.0):6.0%}" if r.get("repeats", 1) > 1 else "  once"
        lines.append(
            f"  {label:<28} {r['time_s'] * 1e3:9.2f} {repeats:>7} {ratio:11.2f}x "
            f"{_mb(r['peak_bytes']):>9} {_mb(r['saved_bytes']):>9}"
            + (f" {_faults(r):>7}" if counted else "")
            + f"  {_of_limit(work, dtype, r['time_s'])}".rstrip()
        )
    return "\n".join(lines)


def _faults_counted(results: dict[str, dict[str, Any]]) -> bool:
    return any("faults" in r for r in results.values())


def _faults(r: dict[str, Any]) -> str:
    """A row's page faults per step, or ``-`` for a contender timed once."""
    return str(r["faults"]) if "faults" in r else "-"


def _machine_line(record: dict[str, Any]) -> str:
    m = record["machine"]
    limits = record.get("limits")
    measured = (
        f" Limits measured in the same run: {machine.describe(limits)}; *of the limit* is the "
        "time the op's work (see the benchmarks page) takes at that limit over the row's time."
        if limits
        else ""
    )
    return (
        f"Measured {record['date']} on {m['device']} ({m['processor']}, {m['threads']} threads, "
        f"{m['platform']}), torch {m['torch']}, with `{record['command']}`. Time is the median "
        "of forward+backward, the contenders timed in alternation; *speed-up* is the baseline's "
        "time over the row's; *peak* is the memory allocated during forward+backward beyond the "
        "inputs; *saved* is what the autograd graph holds between forward and backward"
        + (
            "; *page faults* are those of a timed step (median), the fresh memory the operating "
            "system mapped in for it (- for a contender timed once)."
            if _record_counts_faults(record)
            else "."
        )
        + measured
    )


def _record_counts_faults(record: dict[str, Any]) -> bool:
    return any(
        _faults_counted(row["results"]) for rows in record["results"].values() for row in rows
    )


def op_markdown(record: dict[str, Any], op: str) -> str:
    """One op's results as Markdown tables, one per case and dtype."""
    lines = [_machine_line(record)]
    for row in record["results"][op]:
        results, baseline = row["results"], row["baseline"]
        work, limits = row.get("work"), record.get("limits")
        limit_column = work is not None and bool(limits)
        counted = _faults_counted(results)
        lines += [
            "",
            f"**{row['case']}, {row['dtype']}** (baseline: {baseline})",
            "",
            "| implementation | time (ms) | speed-up | peak (MiB) | saved (MiB) |"
            + (" page faults |" if counted else "")
            + (" of the limit |" if limit_column else ""),
            "| --- | ---: | ---: | ---: | ---: |"
            + (" ---: |" if counted else "")
            + (" ---: |" if limit_column else ""),
        ]
        base = results[baseline]["time_s"]
        for label, r in results.items():
            share = _of_limit(work, row["dtype"], r["time_s"], limits) if limit_column else None
            lines.append(
                f"| {label} | {r['time_s'] * 1e3:.1f} | {base / r['time_s']:.2f}x | "
                f"{r['peak_bytes'] / 2**20:.1f} | {r['saved_bytes'] / 2**20:.1f} |"
                + (f" {_faults(r)} |" if counted else "")
                + (f" {share} |" if limit_column else "")
            )
    return "\n".join(lines) + "\n"


def write_markdown(record: dict[str, Any], directory: str | Path) -> list[Path]:
    """Write ``<directory>/<op>.md`` for every op in ``record``; the docs include these."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for op in record["results"]:
        path = directory / f"{op}.md"
        path.write_text(op_markdown(record, op))
        written.append(path)
    return written
