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


class TritonBackend(Backend):
    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        if not torch.cuda.is_available() and not INTERPRET:
            return "no CUDA or ROCm device (TRITON_INTERPRET=1 runs the kernels on CPU tensors)"
        return None


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
