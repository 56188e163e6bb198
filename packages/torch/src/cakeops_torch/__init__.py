"""The ``torch`` backend: pure-PyTorch kernels for every device PyTorch runs on.

Not a reference: analytic backwards that recompute instead of saving. Each op is the module
named after it.
"""

import torch

from cakeops import Backend
from cakeops.registry import package_kernels

backend = Backend(
    name="torch",
    distribution="cakeops-torch",
    description="pure PyTorch: analytic backwards, recomputation instead of saved activations",
    ops=package_kernels(
        __name__,
        devices={"*": 10},
        dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
    ),
)
