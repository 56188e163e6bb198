"""``routed_experts``: the experts with their routing given, as a Hugging Face MoE block calls
them, against transformers' eager experts loop and ``torch._grouped_mm`` experts (its default on
GPUs)."""

from __future__ import annotations

from typing import Any

import torch

import cakeops
from cakeops.bench.moe_experts import (
    eager_experts,
    gemm_work,
    gpu_inputs,
    grouped_mm_experts,
    softmax_top_k,
)
from cakeops.bench.tables import format_table
from cakeops.bench.timing import cakeops_rows, fwd_bwd, measure, result_row

OP = "routed_experts"
# name -> (T, D, F, E, top_k): the many-small-experts shape (Qwen-MoE, OLMoE)
CASES = {"T4096 D512 F1024 E64 top8": (4096, 512, 1024, 64, 8)}
QUICK_CASES = {"T512 D128 F256 E8 top2": (512, 128, 256, 8, 2)}
BASELINE = "eager experts loop"


def run(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    """float32, the routing (softmax top-k) made once outside the timed step; gradients into
    ``x``, the combine weights and the three weights."""
    rows = []
    for name, shape in (QUICK_CASES if quick else CASES).items():
        T, D, F, _, k = shape
        x, logits, ws = gpu_inputs(device, shape)
        index, weights = softmax_top_k(logits.float(), k)
        leaves = [t.float().requires_grad_() for t in (x, weights, *ws)]
        g = torch.randn(T, D, device=device)

        def ours(x, weights, *ws, index=index):
            return cakeops.routed_experts(x, index, weights, *ws)

        backend = cakeops.explain(cakeops.routed_experts, leaves[0], index, *leaves[1:]).backend
        contenders = {
            label: fwd_bwd(fn, leaves, g)
            for label, fn in (
                *cakeops_rows(ours, backend),
                (BASELINE, lambda x, w, *ws, i=index: eager_experts(x, i, w, *ws)),
                ("torch._grouped_mm", lambda x, w, *ws, i=index: grouped_mm_experts(x, i, w, *ws)),
            )
        }
        results = measure(contenders, device, repeats=2 if quick else 3, slow_s=30.0)
        work = gemm_work(T, D, F, k)
        print(format_table(f"\n{OP} fwd+bwd, {name}, float32", results, BASELINE, work,
                           "float32"))  # fmt: skip
        rows.append(result_row(name, "float32", backend, BASELINE, results, work))
    return rows


def gpu_cases(device: torch.device, shape: tuple[int, ...]) -> list:
    """bfloat16 at ``(T, D, F, E, top_k)``, the routing of ``moe_experts``' case computed once;
    the useful work is the 9 expert GEMMs over ``T * top_k`` rows."""
    from cakeops.bench.gpu import GpuCase
    from cakeops.ops.routed_experts import Inputs

    T, D, F, _, k = shape
    x, logits, ws = gpu_inputs(device, shape)
    index, weights = softmax_top_k(logits, k)
    inputs = Inputs(x, index, weights.bfloat16(), *ws)
    return [GpuCase("bfloat16", inputs, 18 * T * k * D * F, "bf16_flop_per_s")]


def gpu_peers(inputs) -> dict[str, Any]:
    args = [inputs[n] for n in ("x", "top_k_index", "top_k_weights", "w_gate", "w_up", "w_down")]
    return {"torch._grouped_mm": lambda: grouped_mm_experts(*args)}
