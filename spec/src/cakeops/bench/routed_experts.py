"""``routed_experts``: on the CPU the spec's example inputs (the expert math is ``moe_experts``'
benchmark); on a GPU the MoE shape with its routing given, against ``torch._grouped_mm``
experts, which transformers runs by default there."""

from __future__ import annotations

from typing import Any

import torch

from cakeops.bench.moe_experts import gpu_inputs, grouped_mm_experts, softmax_top_k
from cakeops.bench.timing import example_run

OP = "routed_experts"


def run(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    return example_run(OP, device)


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
