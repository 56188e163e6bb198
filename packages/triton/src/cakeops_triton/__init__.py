"""The ``triton`` backend: Triton kernels for CUDA (and ROCm where Triton runs).

Available when Triton imports and a GPU is present. With ``TRITON_INTERPRET=1`` set before the
kernels are imported it also serves CPU tensors through Triton's interpreter, but only when chosen
explicitly (the conformance suite does): the automatic choice never picks it for the CPU.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from cakeops import Backend
from cakeops.registry import package_kernels

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"
# Highest priority on GPUs; on the CPU only through the interpreter, and only when forced.
DEVICES: dict[str, int | None] = {"cuda": 100, **({"cpu": None} if INTERPRET else {})}
#: The longest ``gated_delta_rule`` call (positions: a batch row's, or the packed row's) chosen
#: implicitly that the chunked kernels do not take (key heads over ``chunk.MAX_K``): a decode
#: step, or a few speculative tokens, as one launch of the step kernel where the torch
#: backend's chunked form makes a dozen launches. Longer such calls go to the torch backend,
#: whose backward is chunked (the step kernels' runs step by step); named, the backend runs
#: them all.
DELTA_RULE_POSITIONS = 64


class TritonBackend(Backend):
    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        if not torch.cuda.is_available() and not INTERPRET:
            return "no CUDA or ROCm device (TRITON_INTERPRET=1 runs the kernels on CPU tensors)"
        return None

    def not_preferred_reasons(self, op, inputs) -> list[str]:
        if op != "gated_delta_rule" or inputs.q.shape[2] <= DELTA_RULE_POSITIONS:
            return []
        from cakeops_triton.gated_delta_rule import chunk

        if chunk.supported(inputs.k, inputs.g):
            return []
        return [
            f"chosen implicitly for calls of up to {DELTA_RULE_POSITIONS} positions (a decode "
            f"step: one launch) unless chunked (key heads up to {chunk.MAX_K}), "
            f"got {inputs.q.shape[2]} positions, gates {tuple(inputs.g.shape)} and key heads of "
            f"{inputs.k.shape[-1]}: its step kernels' backward runs step by step, where the "
            "torch backend's is chunked"
        ]

    def not_supported_reasons(self, op, inputs) -> list[str]:
        reasons = super().not_supported_reasons(op, inputs)
        if op == "causal_conv1d" and _row_extent(inputs.x) >= 2**31:
            reasons.append("indexes within a row of x in 32 bits: C * L below 2**31 elements")
        return reasons


def _row_extent(x: torch.Tensor) -> int:
    """Elements one row of ``(N, C, L)`` spans in memory (at least ``C * L``)."""
    _, C, L = x.shape
    return max(C * L, 1 + (C - 1) * abs(x.stride(1)) + (L - 1) * abs(x.stride(2)))


backend = TritonBackend(
    name="triton",
    distribution="cakeops-triton",
    description="Triton kernels: fused, float32 math, deterministic reductions",
    ops=package_kernels(
        __name__,
        devices=DEVICES,
        dtypes=DTYPES,
    ),
)
