"""The ``torch`` backend: pure-PyTorch kernels for every device PyTorch runs on.

Not a reference: analytic backwards that recompute instead of saving.
"""

import torch

from cakeops import Backend, OpKernels

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

backend = Backend(
    name="torch",
    distribution="cakeops-torch",
    description="pure PyTorch: analytic backwards, recomputation instead of saved activations",
    ops={
        "rmsnorm_silu_gate": OpKernels(
            module="cakeops_torch.rmsnorm_silu_gate", devices={"*": 10}, dtypes=DTYPES
        ),
        "causal_dot_product": OpKernels(
            module="cakeops_torch.causal_dot_product", devices={"*": 10}, dtypes=DTYPES
        ),
        "moe_experts": OpKernels(
            module="cakeops_torch.moe_experts", devices={"*": 10}, dtypes=DTYPES
        ),
    },
)
