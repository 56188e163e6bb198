"""Side-by-side benchmarks: the op on its selected backend against what a user would write.

Each op module here defines ``cases(quick)`` (name -> input factory) and ``contenders(inputs)``
(label -> callable running forward and backward, returning the output). For each case every
contender is measured in the same run: median time of forward+backward, peak memory allocated
during it (CUDA allocator statistics, or the profiler's allocation events on CPU), and the bytes
the autograd graph holds between forward and backward (saved-tensor hooks).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from cakeops.bench import limits as machine
from cakeops.bench.limits import Work
from cakeops.measure import alternating_times, peak_memory, saved_bytes, spread, sync
from cakeops.registry import explain_inputs


def cakeops_rows(fn: Callable[..., Any], backend: str) -> list[tuple[str, Callable[..., Any]]]:
    """The op's rows: on the backend the automatic choice picks, and on ``torch`` beside it when
    that is another one (so a kernel backend is compared with the portable one in the same run).
    """
    rows = [(f"cakeops [{backend}]", fn)]
    if backend != "torch":

        def on_torch(*args, **kwargs):
            from cakeops import use_backend

            with use_backend("torch"):  # the backward follows the forward's choice
                return fn(*args, **kwargs)

        rows.append(("cakeops [torch]", on_torch))
    return rows


def result_row(
    case: str, dtype: torch.dtype | str, backend: str, baseline: str, results,
    work: Work | None = None, **extra,
):  # fmt: skip
    """One case of an op's record: what ``op_markdown`` and ``write_plots`` read; ``work`` (bytes
    moved or FLOPs of a forward+backward) gives each row its fraction of the machine's limit."""
    dtype = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    row = {"case": case, "dtype": dtype, "backend": backend, "baseline": baseline,
           "results": results, **extra}  # fmt: skip
    if work is not None:
        row["work"] = work._asdict()
    return row


def step_of(op: str, inputs, forward: Callable[[], Any]) -> Callable[[], Any]:
    """Forward+backward of ``forward``, gradients for the inputs the spec differentiates (not
    integer ids, for one), against a fixed random incoming gradient."""
    from cakeops.ops import SPECS

    spec = SPECS[op]
    wrt = tuple(inputs[name] for name in spec.differentiable_given(inputs))
    g = torch.randn_like(spec.output_like(inputs))

    def step():
        out = forward()
        return torch.autograd.grad(out, wrt, g.view_as(out))

    return step


def example_run(op: str, device: torch.device) -> list[dict[str, Any]]:
    """The benchmark of an op without a module here: the op on the spec's example inputs, on
    the backend the automatic choice picks (and ``torch`` beside it)."""
    from cakeops.ops import SPECS

    spec = SPECS[op]
    inputs = spec.example(device)
    for name in spec.differentiable_given(inputs):
        inputs[name].requires_grad_()
    backend = explain_inputs(op, spec.validate(tuple(inputs.values()))).backend or "torch"
    contenders = {
        label: (fn, step_of(op, inputs, fn))
        for label, fn in cakeops_rows(lambda: spec(**inputs), backend)
    }
    results = measure(contenders, device, repeats=3)
    baseline = f"cakeops [{backend}]"
    print(format_table(f"\n{op} fwd+bwd, example inputs", results, baseline))
    return [result_row("example inputs", "float32", backend, baseline, results)]


def measure(
    contenders: dict[str, tuple[Callable[[], Any], Callable[[], Any]]],
    device: torch.device,
    repeats: int,
    slow_s: float = 3.0,
) -> dict[str, dict[str, float]]:
    """``contenders``: label -> (forward only, forward+backward).

    Timed steps alternate between the contenders (round-robin, median per contender), so that a
    shared machine's drifting speed shifts every contender alike and the ratios stay fair. On a
    CPU the page faults of each timed step are counted too (median per contender): the cost of
    fresh memory from the operating system, which no kernel controls. Peak memory is measured
    after all timing, so the profiler it needs on CPU never overlaps a timed step. A contender
    whose second warm-up step still takes over ``slow_s`` seconds (the first may compile) is
    timed once, on the run that measures its peak memory: the profiler's overhead is small next
    to such a step.
    """
    slow, fast = {}, []
    for label, (_forward, step) in contenders.items():
        # Two warm-up steps (the first may compile or populate caches); a contender is slow
        # when its second step still takes over slow_s.
        for _ in range(2):
            start = time.perf_counter()
            step()
            sync(device)
        if time.perf_counter() - start > slow_s:
            slow[label] = None
        else:
            fast.append(label)
    faults: dict[str, list[int]] = {}
    steps = {label: contenders[label][1] for label in fast}
    times = alternating_times(steps, device, repeats, faults=faults)
    results = {}
    for label, (forward, step) in contenders.items():
        if label in slow:
            start = time.perf_counter()
            peak = peak_memory(step, device)
            seconds, repeats_spread = time.perf_counter() - start, 0.0
        else:
            seconds, repeats_spread = statistics.median(times[label]), spread(times[label])
            peak = peak_memory(step, device)
        results[label] = {
            "time_s": seconds,
            "spread": repeats_spread,
            "repeats": len(times.get(label, [])) or 1,
            "peak_bytes": peak,
            "saved_bytes": saved_bytes(forward),
        }
        if label in faults:  # timed steps on a CPU: their median page faults
            results[label]["faults"] = statistics.median_low(faults[label])
    return results


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


def write_plots(record: dict[str, Any], directory: str | Path) -> list[Path]:
    """Write ``<directory>/<op>.png`` for every op in ``record``: per case, each
    implementation's speed-up over the baseline above its peak memory, as labelled horizontal
    bars on linear axes (an outlier bar is cut and says so), as wide as the docs' text. Needs
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
    written = []
    for op, rows in record["results"].items():
        impls = list(dict.fromkeys(name for row in rows for name in row["results"]))
        palette = plt.get_cmap("tab10")
        color_of = {name: palette(i % 10) for i, name in enumerate(impls)}
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


def _write_outputs(record, json_path, markdown_dir, plots_dir) -> None:
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(record, indent=2))
        print(f"wrote {json_path}")
    if markdown_dir:
        for path in write_markdown(record, markdown_dir):
            print(f"wrote {path}")
    if plots_dir:
        for path in write_plots(record, plots_dir):
            print(f"wrote {path}")


def rerender(
    json_path: str,
    ops: list[str] | None,
    markdown_dir: str | None = None,
    plots_dir: str | None = None,
) -> int:
    """Tables and plots from a saved record (``cakeops bench --from-json``), no measuring."""
    record = json.loads(Path(json_path).read_text())
    if ops:
        record["results"] = {op: r for op, r in record["results"].items() if op in ops}
    _write_outputs(record, None, markdown_dir, plots_dir)
    return 0


def run(
    ops: list[str],
    device: str = "cpu",
    quick: bool = False,
    json_path: str | None = None,
    markdown_dir: str | None = None,
    command: str = "cakeops bench",
    plots_dir: str | None = None,
) -> int:
    """Run the benchmarks of ``ops``, print tables, write JSON, per-op Markdown and plots when
    asked. Returns an exit code."""
    import importlib

    dev = torch.device(device)
    record: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        },
        "command": command,
        "results": {},
    }
    print(
        f"cakeops bench on {record['machine']['device']} ({record['machine']['processor']}, "
        f"{record['machine']['threads']} threads), torch {torch.__version__}"
    )
    if quick:
        print(
            "quick run: small shapes and two repeats each; the figures are indicative only "
            "(a busy machine can move them severalfold)"
        )
    record["limits"] = machine.measure_limits(dev, quick)
    machine.CURRENT.clear()
    machine.CURRENT.update(record["limits"])
    print(f"limits of this machine, measured now: {machine.describe(record['limits'])}")
    for i, op in enumerate(ops, 1):
        print(f"\n[{i}/{len(ops)}] {op} ({datetime.now():%H:%M:%S})", flush=True)
        try:
            module = importlib.import_module(f"cakeops.bench.{op}")
        except ModuleNotFoundError:  # an op with no comparison of its own yet
            record["results"][op] = example_run(op, dev)
        else:
            record["results"][op] = module.run(dev, quick)
    _write_outputs(record, json_path, markdown_dir, plots_dir)
    return 0
