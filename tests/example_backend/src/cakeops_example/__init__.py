"""Example backend: ``rmsnorm_silu_gate`` for float32 CPU tensors, computed through float64.

Low priority, so the automatic choice prefers ``torch``; force it with ``CAKEOPS_BACKEND=example``.
"""

import torch

from cakeops import Backend, OpKernels

backend = Backend(
    name="example",
    distribution="cakeops-example",
    description="example third-party backend",
    ops={
        "rmsnorm_silu_gate": OpKernels(
            module="cakeops_example.rmsnorm_silu_gate",
            devices={"cpu": 1},
            dtypes=(torch.float32,),
        ),
    },
)
