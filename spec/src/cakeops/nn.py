"""``torch.nn`` modules around the ops."""

from __future__ import annotations

import torch

from cakeops.ops.rmsnorm_silu_gate import rmsnorm_silu_gate


class RMSNormSiLUGate(torch.nn.Module):
    """Gated RMSNorm: ``forward(x, z) = rmsnorm_silu_gate(x, z, self.weight, ...)``.

    Drop-in for the gated norms of Qwen3-Next (``norm_before_gate=True``) and Mamba2
    (``norm_before_gate=False``, usually with ``group_size``).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        group_size: int | None = None,
        norm_before_gate: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return rmsnorm_silu_gate(
            x,
            z,
            self.weight,
            self.eps,
            group_size=self.group_size,
            norm_before_gate=self.norm_before_gate,
        )

    def extra_repr(self) -> str:
        return (
            f"{self.hidden_size}, eps={self.eps}, group_size={self.group_size}, "
            f"norm_before_gate={self.norm_before_gate}"
        )
