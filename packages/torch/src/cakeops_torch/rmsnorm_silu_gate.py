"""Gated RMSNorm in plain PyTorch: float32 math, analytic backward recomputing ``rstd``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _normalize(v: torch.Tensor, group_size: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n, r)`` with ``n = v * r`` and ``r = rsqrt(mean(v^2) + eps)`` per group (r keeps a
    trailing group axis of size 1)."""
    groups = v.unflatten(-1, (-1, group_size))
    r = torch.rsqrt(groups.square().mean(-1, keepdim=True).add_(eps))
    return (groups * r).flatten(-2), r


def forward(x, z, weight, eps, group_size, norm_before_gate):
    ct = _compute_dtype(x.dtype)
    zf = z.to(ct)
    gate = F.silu(zf)
    v = x.to(ct) if norm_before_gate else x.to(ct) * gate  # never in place: x may be v
    n, _ = _normalize(v, group_size, eps)
    y = n.mul_(weight.to(ct))
    if norm_before_gate:
        y.mul_(gate)
    return y.to(x.dtype)


def _norm_backward(gn: torch.Tensor, n: torch.Tensor, r: torch.Tensor, group_size: int, eps):
    """Gradient through ``n = v * r`` given ``gn = dL/dn``: ``r * (gn - n * mean(gn * n))``.

    With one feature per group that difference is ``gn * (1 - n^2)`` and cancels catastrophically;
    its exact form ``gn * eps * r^2`` is used instead.
    """
    if group_size == 1:
        return gn * r.flatten(-2).square().mul_(eps).mul_(r.flatten(-2))
    gn_g = gn.unflatten(-1, (-1, group_size))
    n_g = n.unflatten(-1, (-1, group_size))
    mean = (gn_g * n_g).mean(-1, keepdim=True)
    return (gn_g - n_g * mean).mul_(r).flatten(-2)


def backward(g, x, z, weight, eps, group_size, norm_before_gate):
    ct = _compute_dtype(x.dtype)
    D = x.shape[-1]
    gf, xf, zf, wf = g.to(ct), x.to(ct), z.to(ct), weight.to(ct)
    sig = torch.sigmoid(zf)
    gate = zf * sig
    # silu'(z) = sigma(z) * (1 + z * (1 - sigma(z)))
    dsilu = (1 - sig).mul_(zf).add_(1).mul_(sig)
    if norm_before_gate:
        n, r = _normalize(xf, group_size, eps)
        gh = gf * gate
        dweight = (gh * n).reshape(-1, D).sum(0)
        dx = _norm_backward(gh.mul_(wf), n, r, group_size, eps)
        dz = n.mul_(wf).mul_(gf).mul_(dsilu)
    else:
        v = xf * gate
        n, r = _normalize(v, group_size, eps)
        dweight = (gf * n).reshape(-1, D).sum(0)
        dv = _norm_backward(gf * wf, n, r, group_size, eps)
        dz = (dv * xf).mul_(dsilu)
        dx = dv.mul_(gate)
    return dx.to(x.dtype), dz.to(z.dtype), dweight.to(weight.dtype)
