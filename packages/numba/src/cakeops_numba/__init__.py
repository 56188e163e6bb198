"""The ``numba`` backend: CUDA kernels written with numba-cuda.

Tensors reach the kernels without copies through ``__cuda_array_interface__``, outputs are
allocated by PyTorch and kernels launch on PyTorch's current stream. With
``NUMBA_ENABLE_CUDASIM=1`` (set before numba is imported) the same kernels run on CPU tensors in
numba's CUDA simulator, but only when the backend is chosen explicitly (the conformance suite
does). On CUDA it ranks below ``triton`` and above ``torch``.

bfloat16 is not supported: PyTorch's ``__cuda_array_interface__`` has no bfloat16 type code, so
numba cannot receive such a tensor without a copy.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

import torch

from cakeops import Backend, OpKernels

DTYPES = (torch.float16, torch.float32)
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "") == "1"
# Below triton (100) on GPUs; on the CPU only in the simulator, and only when forced.
DEVICES: dict[str, int | None] = {"cuda": 50, **({"cpu": None} if SIMULATOR else {})}
BFLOAT16_REASON = "bfloat16: PyTorch's __cuda_array_interface__ has no bfloat16 type code"


class NumbaBackend(Backend):
    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("numba") is None:
            return "numba is not installed (pip install numba numba-cuda)"
        if SIMULATOR:
            return None
        if importlib.util.find_spec("numba.cuda") is None:
            return "numba-cuda is not installed (pip install numba-cuda)"
        if not torch.cuda.is_available():
            return "no CUDA device (NUMBA_ENABLE_CUDASIM=1 runs the kernels on CPU tensors)"
        from numba import cuda

        if not cuda.is_available():
            return "numba-cuda finds no usable CUDA driver"
        return None

    def not_supported_reasons(self, op: str, inputs: Mapping[str, Any]) -> list[str]:
        reasons = super().not_supported_reasons(op, inputs)
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in inputs.values()):
            reasons.append(BFLOAT16_REASON)
        return reasons


backend = NumbaBackend(
    name="numba",
    distribution="cakeops-numba",
    description="numba-cuda kernels: zero-copy, on PyTorch's stream, deterministic reductions",
    ops={
        "rmsnorm_silu_gate": OpKernels(
            module="cakeops_numba.rmsnorm_silu_gate", devices=DEVICES, dtypes=DTYPES
        ),
        "causal_dot_product": OpKernels(
            module="cakeops_numba.causal_dot_product", devices=DEVICES, dtypes=DTYPES
        ),
        "moe_experts": OpKernels(
            module="cakeops_numba.moe_experts", devices=DEVICES, dtypes=DTYPES
        ),
    },
)
