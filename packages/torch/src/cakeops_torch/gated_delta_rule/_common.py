"""What the delta rule's two algorithms share."""

from __future__ import annotations

import torch

from cakeops.ops.gated_delta_rule import L2NORM_EPS

OP = "gated_delta_rule"


def _inverse_norms(x: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(sum(x^2) + eps)`` per position ``(..., 1)`` (``use_qk_l2norm``), without a
    full-size temporary."""
    return torch.linalg.vecdot(x, x).unsqueeze(-1).add_(L2NORM_EPS).rsqrt_()
