"""GPU benchmarks: each op on every installed backend, against the device's own measured limits.

``python -m cakeops.bench.gpu [--quick] [--json PATH]`` measures the device's copy bandwidth and
bfloat16 matrix rate first, then times each op per backend (and flash-linear-attention's chunked
linear attention when it imports) and reports achieved bandwidth or FLOP rate as a fraction of
those, plus the time ratio against the ``torch`` backend. ``--quick`` uses small shapes (and runs
on the CPU too, to check the script itself).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import cakeops
from cakeops import registry
from cakeops.bench import time_it

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


def device_limits(device: torch.device, quick: bool) -> dict[str, float]:
    """Copy bandwidth (bytes/s, read + write) and bfloat16 matmul rate (FLOP/s), measured now."""
    n = (1 << 20) if quick else (1 << 28)
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_s = time_it(lambda: dst.copy_(src), device, repeats=10)
    size = 256 if quick else 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    mm_s = time_it(lambda: a @ a, device, repeats=10)
    return {"copy_bytes_per_s": 2 * src.nbytes / copy_s, "bf16_flop_per_s": 2 * size**3 / mm_s}


def _backends_for(op: str, example: dict[str, Any]) -> list[str]:
    names = []
    for name, backend in registry.backends().items():
        usable = registry.why_unavailable(backend) is None
        usable = usable and not backend.not_supported_reasons(op, example)
        if name != "reference" and usable:
            names.append(name)
    return names


def _rmsnorm(device, shape, dtype) -> tuple[dict, Callable, Callable, float, float]:
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    z = torch.randn_like(x, requires_grad=True)
    w = torch.ones(shape[1], device=device, dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)
    y = [None]

    def fwd():
        y[0] = cakeops.rmsnorm_silu_gate(x, z, w)

    def bwd():
        torch.autograd.grad(y[0], (x, z, w), g, retain_graph=True)

    nbytes = x.numel() * x.element_size()
    # forward reads x, z and writes y; backward reads g, x, z and writes dx, dz
    return {"x": x, "z": z, "weight": w}, fwd, bwd, 3 * nbytes, 5 * nbytes


def _causal(device, shape):
    N, H, L, E, M = shape
    q = (torch.randn(N, H, L, E, device=device) * E**-0.5).bfloat16().requires_grad_()
    k = (torch.randn(N, H, L, E, device=device) * E**-0.5).bfloat16().requires_grad_()
    v = torch.randn(N, H, L, M, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(N, H, L, M, device=device, dtype=torch.bfloat16)
    return {"q": q, "k": k, "v": v}, g


def _moe(device, shape):
    T, D, F, E, k = shape
    x = torch.randn(T, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    logits = torch.randn(T, E, device=device, requires_grad=True)

    def w(*s, fan_in):
        return (torch.randn(s, device=device) * fan_in**-0.5).bfloat16().requires_grad_()

    inputs = {
        "x": x,
        "router_logits": logits,
        "w_gate": w(E, F, D, fan_in=D),
        "w_up": w(E, F, D, fan_in=D),
        "w_down": w(E, D, F, fan_in=F),
    }
    return inputs, torch.randn(T, D, device=device, dtype=torch.bfloat16), 18 * T * k * D * F


def run(device: torch.device, quick: bool) -> dict[str, Any]:
    shapes = QUICK if quick else FULL
    limits = device_limits(device, quick)
    repeats = 3 if quick else 10
    rows: list[dict[str, Any]] = []

    # bfloat16 is the target's dtype; float16 as well, which every CUDA backend takes (numba's
    # kernels have no bfloat16).
    for dtype in (torch.bfloat16, torch.float16):
        inputs, fwd, bwd, fwd_bytes, bwd_bytes = _rmsnorm(
            device, shapes["rmsnorm_silu_gate"], dtype
        )
        for name in _backends_for("rmsnorm_silu_gate", inputs):
            with cakeops.use_backend(name):
                fwd()
                f_s = time_it(fwd, device, repeats)
                b_s = time_it(bwd, device, repeats)
            parts = (("forward", f_s, fwd_bytes), ("backward", b_s, bwd_bytes))
            for part, seconds, nbytes in parts:
                rows.append(
                    {
                        "op": "rmsnorm_silu_gate",
                        "part": f"{part} {str(dtype).removeprefix('torch.')}",
                        "impl": name,
                        "time_s": seconds,
                        "fraction": nbytes / seconds / limits["copy_bytes_per_s"],
                        "of": "copy bandwidth",
                    }
                )

    qkv, g = _causal(device, shapes["causal_dot_product"])
    contenders = {
        name: (lambda: cakeops.causal_dot_product(*qkv.values()), name)
        for name in _backends_for("causal_dot_product", qkv)
    }
    try:  # flash-linear-attention's chunked kernel, when installed
        from fla.ops.linear_attn import chunk_linear_attn

        def fla():
            q, k, v = (t.transpose(1, 2) for t in qkv.values())  # (B, T, H, D) layout
            return chunk_linear_attn(q, k, v, scale=1.0, normalize=False)[0]

        contenders["flash-linear-attention"] = (fla, None)
    except Exception as exc:  # not installed, or a different API
        print(f"flash-linear-attention not compared: {exc}", file=sys.stderr)
    for label, (fn, backend) in contenders.items():

        def step(fn=fn):
            out = fn()
            grad = g if out.shape == g.shape else g.transpose(1, 2)  # fla's (B, T, H, M)
            return torch.autograd.grad(out, tuple(qkv.values()), grad)

        if backend:
            with cakeops.use_backend(backend):
                seconds = time_it(step, device, repeats)
        else:
            seconds = time_it(step, device, repeats)
        rows.append(
            {"op": "causal_dot_product", "part": "fwd+bwd", "impl": label, "time_s": seconds}
        )

    moe_inputs, g, flops = _moe(device, shapes["moe_experts"])
    top_k = shapes["moe_experts"][4]
    for name in _backends_for("moe_experts", {**moe_inputs, "top_k": top_k}):

        def step():
            out = cakeops.moe_experts(*moe_inputs.values(), top_k=top_k)
            return torch.autograd.grad(out, tuple(moe_inputs.values()), g)

        with cakeops.use_backend(name):
            seconds = time_it(step, device, repeats)
        rows.append(
            {
                "op": "moe_experts",
                "part": "fwd+bwd",
                "impl": name,
                "time_s": seconds,
                "fraction": flops / seconds / limits["bf16_flop_per_s"],
                "of": "bf16 matrix rate",
            }
        )

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
        "shapes": shapes,
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
