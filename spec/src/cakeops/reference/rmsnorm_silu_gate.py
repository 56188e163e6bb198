"""Float64 reference math of ``rmsnorm_silu_gate``: the plain composite, differentiable."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def math(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
) -> torch.Tensor:
    """The op in float64, written the obvious way; autograd of this is the reference gradient."""
    x, z, weight = x.double(), z.double(), weight.double()
    gate = F.silu(z)
    v = x if norm_before_gate else x * gate
    groups = v.unflatten(-1, (-1, group_size))
    n = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    y = n * weight
    return y * gate if norm_before_gate else y


def forward(x, z, weight, eps, group_size, norm_before_gate):
    return math(x, z, weight, eps, group_size, norm_before_gate).to(x.dtype)


def backward(g, x, z, weight, eps, group_size, norm_before_gate):
    """The op page's backward formulas in float64 (the suite checks them against autograd of
    ``math``)."""
    dtypes = (x.dtype, z.dtype, weight.dtype)
    g, x, z, w = g.double(), x.double(), z.double(), weight.double()
    sig = torch.sigmoid(z)
    gate = z * sig
    dsilu = sig * (1 + z * (1 - sig))

    def grouped(t):
        return t.unflatten(-1, (-1, group_size))

    v = x if norm_before_gate else x * gate
    r = torch.rsqrt(grouped(v).pow(2).mean(-1, keepdim=True) + eps)
    n = (grouped(v) * r).flatten(-2)
    gn = w * g * gate if norm_before_gate else w * g  # dL/dn
    dv = (r * (grouped(gn) - grouped(n) * grouped(gn * n).mean(-1, keepdim=True))).flatten(-2)
    if norm_before_gate:
        dx, dz, dw = dv, g * n * w * dsilu, g * gate * n
    else:
        dx, dz, dw = dv * gate, dv * x * dsilu, g * n
    dw = dw.reshape(-1, x.shape[-1]).sum(0)
    return dx.to(dtypes[0]), dz.to(dtypes[1]), dw.to(dtypes[2])
