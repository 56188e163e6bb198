"""``cakeops bench``: the machine's limits, each op's benchmark module (or its example inputs),
then the JSON record, the Markdown tables and the plots."""

from __future__ import annotations

import json
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from cakeops.bench import limits as machine
from cakeops.bench.plots import colours, write_plots
from cakeops.bench.tables import write_markdown
from cakeops.bench.timing import example_run


def _write_outputs(record, json_path, markdown_dir, plots_dir, colour_of=None) -> None:
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(record, indent=2))
        print(f"wrote {json_path}")
    if markdown_dir:
        for path in write_markdown(record, markdown_dir):
            print(f"wrote {path}")
        # each op's record beside its table, so that its plots can be drawn again
        for op, rows in record["results"].items():
            path = Path(markdown_dir) / f"{op}.json"
            path.write_text(json.dumps({**record, "results": {op: rows}}, indent=1) + "\n")
            print(f"wrote {path}")
    if plots_dir:
        for path in write_plots(record, plots_dir, colour_of):
            print(f"wrote {path}")


def rerender(
    json_paths: list[str],
    ops: list[str] | None,
    markdown_dir: str | None = None,
    plots_dir: str | None = None,
) -> int:
    """Tables and plots from saved records (``cakeops bench --from-json``), no measuring; every
    contender keeps one colour over all of them."""
    records = [json.loads(Path(p).read_text()) for p in json_paths]
    every_op = {"results": {f"{i}:{op}": rows for i, r in enumerate(records)
                            for op, rows in r["results"].items()}}  # fmt: skip
    colour_of = colours(every_op)
    for record in records:
        if ops:
            record["results"] = {op: r for op, r in record["results"].items() if op in ops}
        if record["results"]:
            _write_outputs(record, None, markdown_dir, plots_dir, colour_of)
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
