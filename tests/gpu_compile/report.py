"""Merge the compile check's parts into ``bench-results/gpu-compile.json`` (one row per kernel,
config, dtype and target), write its summary table into ``docs/content/gpu.md`` and fail on what
a GPU would reject or run badly:

- a compile error;
- a spill in a config the autotuner can choose for 16-bit inputs;
- a max or min that drops NaN (``arith.maxnumf``/``minnumf``: a GPU's ``tl.maximum`` default);
- shared memory above the target's per-block limit in a config not pruned before launch (every
  compiled config was one the autotuner kept);
- a ``tl.dot`` on 16-bit operands that lowers to FMA instead of tensor cores.

    python tests/gpu_compile/report.py PART.json ... --json OUT.json --docs docs/content/gpu.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from datetime import date
from pathlib import Path

# Opt-in shared memory per block (bytes): H100/H200 (sm_90) 227 KB, A100 (sm_80) 163 KB.
SHARED_LIMIT = {"sm_90": 232448, "sm_80": 166912}
SIXTEEN_BIT = {"float16", "bfloat16"}
START, END = "<!-- gpu-compile:start -->", "<!-- gpu-compile:end -->"
COMPILE_GOAL = 130


def problems(row: dict) -> list[str]:
    found = []
    if not row["ok"]:
        found.append(f"compile error: {row['error'].splitlines()[0][:300]}")
        return found
    # 16-bit inputs, and 16-bit x with float32 master weights ("bfloat16 x, float32 weights")
    if row["dtype"].split(" ")[0] in SIXTEEN_BIT and (row.get("spill_bytes") or 0) > 0:
        found.append(f"{row['spill_bytes']} bytes of spills with {row['dtype']} inputs")
    limit = SHARED_LIMIT.get(row["target"])
    if limit is not None and (row.get("shared_bytes") or 0) > limit:
        found.append(f"{row['shared_bytes']} bytes of shared memory (limit {limit})")
    if row.get("nan_dropping"):
        found.append(f"{row['nan_dropping']} max/min that drop NaN (arith.maxnumf/minnumf): "
                     "the non-finite contract needs NaN to propagate")  # fmt: skip
    for dot in row.get("dots", []):
        if dot["operands"] in ("bf16", "f16") and dot["lowering"] == "fma":
            found.append(f"tl.dot on {dot['operands']} at {dot['source']} lowers to FMA")
    return found


def _gpu_run_rows(rows: list[dict], sources=("suite", "gpu-bench")) -> list[dict]:
    return [r for r in rows if r["backend"] == "triton" and r["target"] == "sm_90"
            and "TF32" not in r["dtype"] and r.get("source") in sources]  # fmt: skip


def suite_compilations(rows: list[dict]) -> int:
    """Triton compilations an H200 run of the CUDA suite and the benchmarks triggers: the sm_90
    rows at their shapes, without the TF32 path (which only a user's setting turns on)."""
    return len(_gpu_run_rows(rows))


def compile_cost(rows: list[dict]) -> str:
    """What compiling costs the GPU run, from this check's own timings (one compilation after
    another on the machine that ran it): the benchmark step's share and the suite's."""
    bench, suite = _gpu_run_rows(rows, ("gpu-bench",)), _gpu_run_rows(rows, ("suite",))
    seconds = lambda rs: sum(r.get("seconds") or 0 for r in rs)  # noqa: E731
    return (f"{len(bench)} of them at the GPU benchmark's shapes, {seconds(bench):.0f} s of "
            f"compiling one after another here (the step times for {_bench_budget()} s, every "
            f"op's Triton row first), and {len(suite)} at the suite's, {seconds(suite):.0f} s "
            f"here, spread over its 8 workers")  # fmt: skip


def _bench_budget() -> int:
    """The GPU script's ``--budget`` of its benchmark step on a GPU (``tests/gpu/run.py``)."""
    import importlib.util
    import tempfile

    path = Path(__file__).resolve().parents[1] / "gpu" / "run.py"
    spec = importlib.util.spec_from_file_location("gpu_run_for_report", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    bench = module.plan(Path(tempfile.gettempdir()), False)[1].commands[0]
    return int(float(bench[bench.index("--budget") + 1]))


def summary(rows: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["backend"], row["module"].split(".")[-1], row["kernel"], row["dtype"])].append(
            row
        )
    lines = [
        "| backend | op module | kernel | dtype | target | configs | errors | max registers "
        "| max spill (B) | max shared (KB) | tl.dot lowering |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (backend, module, kernel, dtype), group in sorted(groups.items()):
        by_target: dict[str, list[dict]] = defaultdict(list)
        for row in group:
            by_target[row["target"]].append(row)
        for target, trows in sorted(by_target.items(), reverse=True):
            ok = [r for r in trows if r["ok"]]
            lowering: dict[str, int] = defaultdict(int)
            for r in ok:
                for d in r.get("dots", []):
                    lowering[f"{d['lowering']} ({d['operands']})"] += 1
            low = ", ".join(f"{k} x{v}" for k, v in sorted(lowering.items())) or "-"
            regs = max((r.get("registers") or 0 for r in ok), default=0)
            spill = max((r.get("spill_bytes") or 0 for r in ok), default=0)
            shared = max((r.get("shared_bytes") or 0 for r in ok), default=0)
            lines.append(
                f"| {backend} | {module} | `{kernel}` | {dtype} | {target} | {len(trows)} "
                f"| {len(trows) - len(ok)} | {regs} | {spill} | {shared / 1024:.1f} | {low} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--docs", type=Path)
    args = parser.parse_args()
    rows, versions = [], {}
    for part in args.parts:
        data = json.loads(part.read_text())
        versions[data["backend"]] = data.get(data["backend"])
        rows += [{"backend": data["backend"], **row} for row in data["rows"]]
    failures = []
    for row in rows:
        row["problems"] = problems(row)
        if row["problems"]:
            failures.append(row)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"versions": versions, "rows": rows}, indent=1))
    table = summary(rows)
    if args.docs:
        text = args.docs.read_text()
        head, rest = text.split(START, 1)
        tail = rest.split(END, 1)[1]
        stamp = (
            f"Generated by `nox -s gpu_compile` on {date.today().isoformat()} "
            f"(Triton {versions.get('triton')}, numba-cuda kernels through numba "
            f"{versions.get('numba')}); {len(rows)} compilations, {len(failures)} failing; "
            f"an H200 run of the CUDA suite and the benchmarks triggers "
            f"{suite_compilations(rows)} Triton compilations (goal: under {COMPILE_GOAL}): "
            f"{compile_cost(rows)}."
        )
        args.docs.write_text(f"{head}{START}\n{stamp}\n\n{table}\n{END}{tail}")
    print(table)
    print(f"\n{len(rows)} compilations, {len(failures)} failing the check")
    if any(r.get("source") in ("suite", "gpu-bench") for r in rows):
        print(f"Triton compilations of the CUDA suite and benchmarks on sm_90: "
              f"{suite_compilations(rows)} (goal: under {COMPILE_GOAL}): "
              f"{compile_cost(rows)}")  # fmt: skip
    for row in failures:
        where = f"{row['backend']} {row['kernel']} {row['target']} {row['dtype']} ({row['call']})"
        for problem in row["problems"]:
            print(f"FAIL {where}: {problem}\n     config {row['config']}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
