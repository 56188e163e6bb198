"""Gated RMSNorm in plain PyTorch: float32 math, analytic backward recomputing ``rstd``.

Rows are processed in blocks of about ``BLOCK_ELEMENTS`` elements: each block's float32
temporaries stay in cache and are small enough for the allocator to reuse, so the dozen
elementwise passes of the math cost cache bandwidth, not memory bandwidth and page faults.
Results are written straight into the outputs; ``dweight`` is summed block by block in a fixed
order (deterministic).
"""

from __future__ import annotations

import torch

from cakeops import compute_dtype

BLOCK_ELEMENTS = 1 << 18


def _blocks(rows: int, D: int):
    step = max(1, BLOCK_ELEMENTS // max(D, 1))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(rows, D)``, a view where the layout allows (strided rows stay in place)."""
    return t.reshape(-1, t.shape[-1])


def _rstd(v: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """``rsqrt(mean(v^2) + eps)`` per group, shape ``(rows, groups, 1)``."""
    groups = v.unflatten(-1, (-1, group_size))
    return (
        torch.linalg.vector_norm(groups, dim=-1, keepdim=True)
        .square_()
        .div_(group_size)
        .add_(eps)
        .rsqrt_()
    )


def _scale_groups(t: torch.Tensor, r: torch.Tensor, group_size: int) -> torch.Tensor:
    """``t * r`` broadcasting ``r`` over each group, in place."""
    t.unflatten(-1, (-1, group_size)).mul_(r)
    return t


def forward(x, z, weight, eps, group_size, norm_before_gate):
    ct = compute_dtype(x.dtype)
    xr, zr = _rows(x), _rows(z)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    yr = y.view(-1, x.shape[-1])
    w = weight.to(ct)
    for b in _blocks(xr.shape[0], xr.shape[1]):
        zb = zr[b].to(ct)
        gate = torch.nn.functional.silu(zb)
        v = xr[b].to(ct, copy=True)
        if not norm_before_gate:
            v.mul_(gate)
        _scale_groups(v, _rstd(v, group_size, eps), group_size).mul_(w)
        if norm_before_gate:
            v.mul_(gate)
        yr[b].copy_(v)
    return y


def _norm_backward(gn, n, r, group_size, eps):
    """In place: ``gn <- r * (gn - n * mean(gn * n))``, the gradient through ``n = v * r``.

    With one feature per group that difference is ``gn * (1 - n^2)`` and cancels catastrophically;
    its exact form ``gn * eps * r^3`` is used instead.
    """
    if group_size == 1:
        return gn.mul_(r.flatten(-2).pow(3).mul_(eps))
    gn_g, n_g = gn.unflatten(-1, (-1, group_size)), n.unflatten(-1, (-1, group_size))
    mean = (gn_g * n_g).mean(-1, keepdim=True)
    gn_g.sub_(n_g * mean)
    return _scale_groups(gn, r, group_size)


def backward(g, x, z, weight, eps, group_size, norm_before_gate):
    ct = compute_dtype(x.dtype)
    D = x.shape[-1]
    gr, xr, zr = _rows(g), _rows(x), _rows(z)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dz = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    dxr, dzr = dx.view(-1, D), dz.view(-1, D)
    w = weight.to(ct)
    dweight = torch.zeros(D, dtype=ct, device=x.device)
    for b in _blocks(xr.shape[0], D):
        gb, xb, zb = gr[b].to(ct), xr[b].to(ct), zr[b].to(ct)
        sig = torch.sigmoid(zb)
        gate = zb * sig
        # silu'(z) = sigma(z) * (1 + z * (1 - sigma(z)))
        dsilu = torch.rsub(sig, 1).mul_(zb).add_(1).mul_(sig)
        if norm_before_gate:
            r = _rstd(xb, group_size, eps)
            n = _scale_groups(xb.clone(), r, group_size)
            gn = gb * gate  # dL/d(n * weight)
            dweight.add_((gn * n).sum(0))
            # dz = g * n * weight * silu'(z), built in the dsilu buffer
            dzr[b].copy_(dsilu.mul_(gb).mul_(n).mul_(w))
            dxr[b].copy_(_norm_backward(gn.mul_(w), n, r, group_size, eps))
        else:
            v = xb * gate
            r = _rstd(v, group_size, eps)
            n = _scale_groups(v, r, group_size)
            dweight.add_((gb * n).sum(0))
            dv = _norm_backward(gb * w, n, r, group_size, eps)
            dzr[b].copy_(dsilu.mul_(xb).mul_(dv))
            dxr[b].copy_(dv.mul_(gate))
    return dx, dz, dweight.to(weight.dtype)
