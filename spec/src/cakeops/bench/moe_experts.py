"""``moe_experts`` against the per-expert eager loop a user writes and its ``torch.compile``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import cakeops
from cakeops.bench.limits import Work
from cakeops.bench.tables import format_table
from cakeops.bench.timing import cakeops_rows, fwd_bwd, measure, result_row

# name -> (T, D, F, E, top_k)
CASES = {
    "T4096 D1024 F2816 E8 top2": (4096, 1024, 2816, 8, 2),
    "T4096 D512 F1024 E64 top8": (4096, 512, 1024, 64, 8),
}
QUICK_CASES = {
    "T512 D128 F256 E8 top2": (512, 128, 256, 8, 2),
}


def gemm_work(T: int, D: int, F: int, top_k: int) -> Work:
    """The FLOPs of the expert GEMMs cakeops executes per forward+backward over the ``T * top_k``
    rows, each ``2 D F`` per row: 3 in the forward (gate, up, down), 8 in the backward (gate and
    up recomputed, ``g W_down``, three weight gradients, two input-gradient products)."""
    return Work("flops", 11 * 2 * T * top_k * D * F)


def eager_loop(x, router_logits, w_gate, w_up, w_down, top_k):
    """The HF-style loop: softmax top-k, then :func:`eager_experts`."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, selected = torch.topk(probs, top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
    return eager_experts(x, selected, weights, w_gate, w_up, w_down)


def eager_experts(x, top_k_index, top_k_weights, w_gate, w_up, w_down):
    """transformers' eager experts: per expert hit, its rows gathered, SwiGLU, weighted and
    added back with ``index_add_``."""
    out = torch.zeros_like(x)
    hit = F.one_hot(top_k_index, num_classes=w_gate.shape[0]).permute(2, 1, 0)
    for e in range(w_gate.shape[0]):
        slot, token = torch.where(hit[e])
        if token.numel() == 0:
            continue
        rows = x[token]
        h = F.silu(rows @ w_gate[e].T) * (rows @ w_up[e].T)
        out.index_add_(0, token, (h @ w_down[e].T) * top_k_weights[token, slot, None])
    return out


def run(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    compiled = torch.compile(eager_loop, dynamic=False)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (T, D, F_, E, k) in (QUICK_CASES if quick else CASES).items():

            def param(*shape, fan_in, dtype):
                w = torch.randn(shape, device=device) * fan_in**-0.5
                return w.to(dtype).requires_grad_()

            x = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
            logits = torch.randn(T, E, device=device, dtype=dtype, requires_grad=True)
            wg, wu, wd = (
                param(E, F_, D, fan_in=D, dtype=dtype),
                param(E, F_, D, fan_in=D, dtype=dtype),
                param(E, D, F_, fan_in=F_, dtype=dtype),
            )
            g = torch.randn(T, D, device=device, dtype=dtype)
            inputs = (x, logits, wg, wu, wd)
            backend = cakeops.explain(cakeops.moe_experts, *inputs, top_k=k).backend
            contenders = {
                label: fwd_bwd(fn, inputs, g)
                for label, fn in (
                    *cakeops_rows(lambda *t, k=k: cakeops.moe_experts(*t, top_k=k), backend),
                    ("eager loop (index_add_)", lambda *t, k=k: eager_loop(*t, k)),
                    ("torch.compile(eager loop)", lambda *t, k=k: compiled(*t, k)),
                )
            }
            # Steps of a few seconds still get timed in alternation; only the 16-bit eager
            # baselines (minutes per step on a CPU) are timed once.
            results = measure(contenders, device, repeats=2 if quick else 3, slow_s=30.0)
            dt = str(dtype).removeprefix("torch.")
            work = gemm_work(T, D, F_, k)
            title = f"\nmoe_experts fwd+bwd, {name}, {dt}"
            print(format_table(title, results, "eager loop (index_add_)", work, dt))
            ours = results[f"cakeops [{backend}]"]
            base = results["eager loop (index_add_)"]
            print(
                f"  cakeops speed-up over the eager loop: {base['time_s'] / ours['time_s']:.2f}x; "
                f"peak memory ratio: {ours['peak_bytes'] / base['peak_bytes']:.2f}"
            )
            rows.append(result_row(name, dt, backend, "eager loop (index_add_)", results, work))
    return rows


def grouped_mm_experts(x, top_k_index, top_k_weights, w_gate, w_up, w_down):
    """The experts as ``torch._grouped_mm`` runs them (transformers' default on GPUs): rows
    sorted by expert, three grouped GEMMs, a weighted ``index_add_`` combine."""
    k, E = top_k_index.shape[1], w_gate.shape[0]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    rows = x[token]
    gate = torch._grouped_mm(rows, w_gate.transpose(1, 2), offs=offs)
    up = torch._grouped_mm(rows, w_up.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(F.silu(gate) * up, w_down.transpose(1, 2), offs=offs)
    y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def softmax_top_k(router_logits, top_k):
    """``moe_experts``' routing (softmax, top-k, renormalised), as model code writes it."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, index = torch.topk(probs, top_k, dim=-1)
    return index, weights / weights.sum(-1, keepdim=True)


def gpu_inputs(device: torch.device, shape: tuple[int, ...]):
    """bfloat16 ``x`` and weights at ``(T, D, F, E, top_k)``, float32 router logits."""
    T, D, F, E, _ = shape

    def w(*s, fan_in):
        return (torch.randn(s, device=device) * fan_in**-0.5).bfloat16()

    x = torch.randn(T, D, device=device, dtype=torch.bfloat16)
    logits = torch.randn(T, E, device=device)
    return x, logits, (w(E, F, D, fan_in=D), w(E, F, D, fan_in=D), w(E, D, F, fan_in=F))


def gpu_cases(device: torch.device, shape: tuple[int, ...]) -> list:
    """``python -m cakeops.bench.gpu``: bfloat16 at ``(T, D, F, E, top_k)``; the useful work is
    the 9 expert GEMMs of forward (3) and backward (6) over ``T * top_k`` rows."""
    from cakeops.bench.gpu import GpuCase
    from cakeops.ops.moe_experts import Inputs

    T, D, F, _, k = shape
    x, logits, ws = gpu_inputs(device, shape)
    return [GpuCase("bfloat16", Inputs(x, logits, *ws, top_k=k), 18 * T * k * D * F,
                    "bf16_flop_per_s")]  # fmt: skip


def gpu_peers(inputs) -> dict[str, Any]:
    """The eager loop and the same routing followed by ``torch._grouped_mm`` experts."""
    x, logits, k = inputs["x"], inputs["router_logits"], inputs["top_k"]
    ws = (inputs["w_gate"], inputs["w_up"], inputs["w_down"])

    def grouped():
        index, weights = softmax_top_k(logits, k)
        return grouped_mm_experts(x, index, weights, *ws)

    return {
        "eager loop (index_add_)": lambda: eager_loop(x, logits, *ws, k),
        "routing + torch._grouped_mm": grouped,
    }
