"""The README's usage example: a gated RMSNorm forward and backward on the best backend."""

import torch

import cakeops

x = torch.randn(8, 1024, dtype=torch.bfloat16, requires_grad=True)  # hidden states
z = torch.randn(8, 1024, dtype=torch.bfloat16, requires_grad=True)  # gate projection
norm = cakeops.nn.RMSNormSiLUGate(1024, eps=1e-6)  # float32 weight, Qwen3-Next style
y = norm(x, z)  # rmsnorm(x) * weight * silu(z), in bfloat16
y.float().pow(2).mean().backward()
print(cakeops.explain(cakeops.rmsnorm_silu_gate, x, z, norm.weight))
print("y", tuple(y.shape), y.dtype, "| weight grad norm:", norm.weight.grad.norm().item())
