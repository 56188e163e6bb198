"""GPU benchmarks: each op on every installed backend, against the device's own measured limits.

``python -m cakeops.bench.gpu [--quick] [--json PATH]`` measures the device's copy bandwidth and
bfloat16 matrix rate first, then times each op per backend (and flash-linear-attention's chunked
linear attention when it imports) and reports achieved bandwidth or FLOP rate as a fraction of
those, plus the time ratio against the ``torch`` backend. ``--quick`` uses small shapes (and runs
on the CPU too, to check the script itself).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch

import cakeops
from cakeops import registry
from cakeops.bench.limits import NAMES as LIMIT_NAMES
from cakeops.bench.limits import measure_limits
from cakeops.measure import time_it
from cakeops.ops import SPECS

FULL = {
    "rmsnorm_silu_gate": (32768, 4096),
    "causal_dot_product": (8, 16, 4096, 128, 128),
    "moe_experts": (16384, 2048, 1408, 64, 6),
}
QUICK = {
    "rmsnorm_silu_gate": (256, 512),
    "causal_dot_product": (1, 2, 256, 32, 32),
    "moe_experts": (256, 64, 96, 8, 2),
}


class GpuCase(NamedTuple):
    """One GPU benchmark case of an op: its inputs, and optionally the useful work of a
    forward+backward (bytes moved or FLOPs) with the device limit it is a fraction of."""

    name: str
    inputs: Any
    work: float = 0.0
    limit: str = "copy_bytes_per_s"


def _backends_for(op: str, inputs) -> list[str]:
    names = []
    for name, backend in registry.backends().items():
        usable = registry.why_unavailable(backend) is None
        usable = usable and not backend.not_supported_reasons(op, inputs)
        if name != "reference" and usable:
            names.append(name)
    return names


def _cases(op: str, device: torch.device, quick: bool) -> list[GpuCase]:
    """The op's GPU cases: its bench module's ``gpu_cases(device, shape)`` at the shape of
    ``QUICK``/``FULL``, or else the spec's example inputs in bfloat16 (no device-limit column)."""
    shape = (QUICK if quick else FULL).get(op)
    try:
        module = importlib.import_module(f"cakeops.bench.{op}")
    except ModuleNotFoundError:
        module = None
    if shape is not None and hasattr(module, "gpu_cases"):
        return module.gpu_cases(device, shape)
    return [GpuCase("bfloat16", SPECS[op].example(device, torch.bfloat16))]


def _time_case(op: str, case: GpuCase, device: torch.device, repeats: int, limits) -> list[dict]:
    spec = SPECS[op]
    inputs = {
        k: v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v
        for k, v in case.inputs.items()
    }
    tensors = tuple(v for v in inputs.values() if isinstance(v, torch.Tensor))
    g = torch.randn_like(spec.output_like(case.inputs))
    contenders: dict[str, tuple[Any, str | None]] = {
        name: (lambda: spec(**inputs), name) for name in _backends_for(op, case.inputs)
    }
    module = sys.modules.get(f"cakeops.bench.{op}")
    for label, fn in getattr(module, "gpu_peers", lambda _: {})(inputs).items():
        contenders[label] = (fn, None)
    rows = []
    for label, (fn, backend) in contenders.items():

        def step(fn=fn):
            out = fn()
            return torch.autograd.grad(out, tensors, g.view_as(out))

        with cakeops.use_backend(backend) if backend else contextlib.nullcontext():
            forward_s = time_it(fn, device, repeats)
            seconds = time_it(step, device, repeats)
        row = {"op": op, "part": f"fwd+bwd {case.name}", "impl": label, "time_s": seconds,
               "forward_s": forward_s}  # fmt: skip
        if case.work:
            row["fraction"] = case.work / seconds / limits[case.limit]
            row["of"] = LIMIT_NAMES[case.limit]
        rows.append(row)
    return rows


def run(device: torch.device, quick: bool) -> dict[str, Any]:
    limits = measure_limits(device, quick)
    repeats = 3 if quick else 10
    rows: list[dict[str, Any]] = []
    for op in SPECS:
        for case in _cases(op, device, quick):
            rows += _time_case(op, case, device, repeats, limits)
    for row in rows:
        base = next(
            (
                r
                for r in rows
                if (r["op"], r["part"], r["impl"]) == (row["op"], row["part"], "torch")
            ),
            None,
        )
        row["speedup_vs_torch"] = base["time_s"] / row["time_s"] if base else None
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "limits": limits,
        "shapes": QUICK if quick else FULL,
        "rows": rows,
    }


def summary(record: dict[str, Any]) -> str:
    lim = record["limits"]
    lines = [
        f"device {record['device']}, torch {record['torch']}: copy "
        f"{lim['copy_bytes_per_s'] / 1e9:.0f} GB/s, "
        f"bf16 matmul {lim['bf16_flop_per_s'] / 1e12:.0f} TFLOP/s",
        "",
        "| op | part | implementation | time (ms) | of the device limit | vs torch |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in record["rows"]:
        frac = f"{100 * r['fraction']:.0f}% {r['of']}" if "fraction" in r else "-"
        vs = f"{r['speedup_vs_torch']:.2f}x" if r["speedup_vs_torch"] else "-"
        lines.append(
            f"| {r['op']} | {r['part']} | {r['impl']} | {r['time_s'] * 1e3:.2f} | {frac} | {vs} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cakeops.bench.gpu", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small shapes (any device)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark", file=sys.stderr)
        return 2
    record = run(device, args.quick)
    print(summary(record))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
