"""Float64 reference math of ``causal_dot_product``."""

from __future__ import annotations

import torch


def _tril_scores(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``tril(a @ b^T)``: entry ``[i, j]`` is ``a_i . b_j`` for ``j <= i``, else exactly 0."""
    return torch.tril(a @ b.transpose(-1, -2))


def math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The masked form in float64: ``tril(q k^T) v``. Differentiable; memory ``L x L``."""
    q, k, v = q.double(), k.double(), v.double()
    return _tril_scores(q, k) @ v


def math_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same in float64 as a cumulative sum of ``k_j v_j^T`` states (memory ``L x E x M``),
    for long sequences where ``L x L`` does not fit."""
    q, k, v = q.double(), k.double(), v.double()
    states = torch.cumsum(k.unsqueeze(-1) * v.unsqueeze(-2), dim=2)
    return torch.einsum("nhle,nhlem->nhlm", q, states)


def forward(q, k, v):
    return math(q, k, v).to(q.dtype)


def backward(g, q, k, v):
    """``dq = tril(g v^T) k``, ``dk = tril(g v^T)^T q``, ``dv = tril(q k^T)^T g`` in float64."""
    gd, qd, kd, vd = g.double(), q.double(), k.double(), v.double()
    gv = _tril_scores(gd, vd)
    dq = gv @ kd
    dk = gv.transpose(-1, -2) @ qd
    dv = _tril_scores(qd, kd).transpose(-1, -2) @ gd
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
