"""``rmsnorm_silu_gate`` against the eager composite a user writes and its ``torch.compile``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import cakeops
from cakeops.bench.limits import Work
from cakeops.bench.tables import format_table
from cakeops.bench.timing import cakeops_rows, measure, result_row

# name -> (rows x D, group_size)
CASES = {
    "rows 8192, D 4096": ((8192, 4096), None),
    "rows 32768, D 128, group 128": ((32768, 128), 128),
}
QUICK_CASES = {
    "rows 512, D 1024": ((512, 1024), None),
    "rows 2048, D 128, group 128": ((2048, 128), 128),
}
EPS = 1e-6


def copy_work(x: torch.Tensor) -> Work:
    """The bytes an ideal forward+backward moves: the forward reads ``x``, ``z`` and writes
    ``y``; the backward reads ``g``, ``x``, ``z`` and writes ``dx``, ``dz``: 8 tensors of ``x``'s
    size (the weight and its gradient are one row)."""
    return Work("bytes", 8 * x.numel() * x.element_size())


def composite(x, z, weight, group_size):
    """Gated RMSNorm as model code writes it (float32 statistics, as in Qwen3-Next's torch path)."""
    dtype = x.dtype
    h = x.float().unflatten(-1, (-1, group_size))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    h = weight * h.flatten(-2).to(dtype)
    h = h * F.silu(z.float())
    return h.to(dtype)


def run(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    compiled = torch.compile(composite, dynamic=False)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (shape, group_size) in (QUICK_CASES if quick else CASES).items():
            gs = group_size or shape[-1]
            x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
            z = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(shape[-1], device=device, dtype=dtype, requires_grad=True)
            g = torch.randn(shape, device=device, dtype=dtype)
            backend = cakeops.explain(
                cakeops.rmsnorm_silu_gate, x, z, w, EPS, group_size=gs
            ).backend

            def op(x=x, z=z, w=w, gs=gs):
                return cakeops.rmsnorm_silu_gate(x, z, w, EPS, group_size=gs)

            def eager(x=x, z=z, w=w, gs=gs):
                return composite(x, z, w, gs)

            def torch_compiled(x=x, z=z, w=w, gs=gs):
                return compiled(x, z, w, gs)

            contenders = {}
            for label, fwd in (
                *cakeops_rows(op, backend),
                ("eager composite", eager),
                ("torch.compile(composite)", torch_compiled),
            ):

                def step(fwd=fwd, x=x, z=z, w=w, g=g):
                    return torch.autograd.grad(fwd(), (x, z, w), g)

                contenders[label] = (fwd, step)
            results = measure(contenders, device, repeats=2 if quick else 9)
            title = f"\nrmsnorm_silu_gate fwd+bwd, {name}, {str(dtype).removeprefix('torch.')}"
            work = copy_work(x)
            print(format_table(title, results, "eager composite", work, dtype))
            ours_r = results[f"cakeops [{backend}]"]
            vs_compile = ours_r["time_s"] / results["torch.compile(composite)"]["time_s"]
            inputs_bytes = sum(t.numel() * t.element_size() for t in (x, z, w))
            print(
                f"  cakeops time / torch.compile time: {vs_compile:.2f}; cakeops saves "
                f"{ours_r['saved_bytes']} bytes = the inputs ({inputs_bytes} bytes): "
                f"{ours_r['saved_bytes'] == inputs_bytes}"
            )
            rows.append(
                result_row(
                    name,
                    str(dtype).removeprefix("torch."),
                    backend,
                    "eager composite",
                    results,
                    work,
                    input_bytes=inputs_bytes,
                )
            )
    return rows


def gpu_cases(device: torch.device, shape: tuple[int, ...]) -> list:
    """``python -m cakeops.bench.gpu``: bfloat16 and float16 (every CUDA backend takes it);
    forward+backward reads x, z, g twice and writes y, dx, dz: the bytes of 8 x-sized tensors."""
    from cakeops.bench.gpu import GpuCase
    from cakeops.ops.rmsnorm_silu_gate import Inputs

    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(shape, device=device, dtype=dtype)
        w = torch.ones(shape[-1], device=device, dtype=dtype)
        nbytes = copy_work(x).amount
        cases.append(
            GpuCase(str(dtype).removeprefix("torch."), Inputs(x, torch.randn_like(x), w), nbytes)
        )
    return cases


def gpu_peers(inputs) -> dict[str, Any]:
    """The eager composite and its ``torch.compile``; flash-linear-attention's gated RMSNorm
    (``rms_norm_gated``: whole rows, the norm before the gate) and Liger-Kernel's RMSNorm then
    its SiLU-times-x kernel (the same math in two launches) when they import; a string says why
    a peer is not compared."""
    x, z, w = inputs["x"], inputs["z"], inputs["weight"]
    gs = inputs["group_size"] or x.shape[-1]
    compiled = torch.compile(composite, dynamic=False)
    peers: dict[str, Any] = {
        "eager composite": lambda: composite(x, z, w, gs),
        "torch.compile(composite)": lambda: compiled(x, z, w, gs),
    }
    fla = "flash-linear-attention rms_norm_gated"
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
    except Exception as exc:  # not installed, or a different API
        peers[fla] = f"does not import ({type(exc).__name__}: {exc})"[:200]
    else:
        if gs != x.shape[-1]:
            peers[fla] = "normalises whole rows only (no groups)"
        else:
            peers[fla] = lambda: rms_norm_gated(x, z, w, None, activation="swish", eps=EPS)
    liger = "Liger-Kernel RMSNorm, then SiLU(z) * y"
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as exc:
        peers[liger] = f"does not import ({type(exc).__name__}: {exc})"[:200]
    else:
        if gs != x.shape[-1]:
            peers[liger] = "normalises whole rows only (no groups)"
        else:
            peers[liger] = lambda: LigerSiLUMulFunction.apply(
                z, LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)
            )
    return peers
