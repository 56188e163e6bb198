"""The one helper the torch backend's linear-attention ops share: a causal product that keeps a
non-finite value within its causal range."""

from __future__ import annotations

from collections.abc import Callable

import torch


def causal_mm(
    scores: torch.Tensor,
    x: torch.Tensor,
    reverse: bool = False,
    product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.matmul,
    guard: bool = True,
) -> torch.Tensor:
    """``scores @ x`` (or ``product(scores, x)``) for ``scores`` zero outside the causal range
    (lower triangle; upper with ``reverse``), with no masked zero times a NaN or Inf of ``x``
    (when ``guard``; a caller passes False when its inputs are known finite): the non-finite
    entries enter through a running sum instead, reaching only the rows of their causal range,
    as in the reference. Returns a new tensor (callers may add into it in place)."""
    if not guard:
        return product(scores, x)
    finite = torch.isfinite(x)
    out = product(scores, x.where(finite, 0))
    bad = x.masked_fill(finite, 0)
    return out.add_(bad.flip(-2).cumsum(-2).flip(-2) if reverse else bad.cumsum(-2))
