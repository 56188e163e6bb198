"""Gated RMSNorm in plain PyTorch: float32 math, analytic backward recomputing ``rstd``.

Rows are processed in blocks of about ``BLOCK_ELEMENTS`` elements: each block's float32
temporaries stay in cache and are small enough for the allocator to reuse, so the dozen
elementwise passes of the math cost cache bandwidth, not memory bandwidth and page faults.
Results are written straight into the outputs; ``dweight`` is summed block by block in a fixed
order (deterministic).

On CPU, inputs of at least ``COMPILE_MIN_ELEMENTS`` run each block through one inductor-compiled
function instead (``torch.compile`` of ``_fused_forward``/``_fused_backward``): a single fused
loop rather than a dozen elementwise passes (:mod:`cakeops_torch._compile`: rows marked dynamic,
``CAKEOPS_TORCH_COMPILE=0`` to turn it off, the eager kernels where compiling fails).
"""

from __future__ import annotations

import functools

import torch

from cakeops import compute_dtype
from cakeops.helpers import as_dtype
from cakeops_torch._compile import FAILED, run_compiled, use_compiled

BLOCK_ELEMENTS = 1 << 18
# The fused forward keeps no temporaries: bigger blocks, fewer calls. The fused backward writes
# one float32 dweight term per element into a buffer reused by every block, summed outside: its
# blocks are sized for that buffer (4 MiB) to stay in the last-level cache between being written
# and summed (faster than blocks of 1 << 21 at D 4096 when no page faults hide it).
COMPILED_BLOCK_ELEMENTS = 1 << 21
COMPILED_BACKWARD_BLOCK_ELEMENTS = 1 << 20
COMPILE_MIN_ELEMENTS = 1 << 16
OP = "rmsnorm_silu_gate"


def _blocks(rows: int, D: int, elements: int = BLOCK_ELEMENTS):
    step = max(1, elements // max(D, 1))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(rows, D)``, a view where the layout allows (strided rows stay in place)."""
    return t.reshape(-1, t.shape[-1])


def _grouped(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """``t`` as ``(..., groups, group_size)``; itself when the row is one group (a view costs a
    decode step's call a microsecond a time)."""
    return t if group_size == t.shape[-1] else t.unflatten(-1, (-1, group_size))


@functools.lru_cache(maxsize=64)
def _eps_tensor(eps: float) -> torch.Tensor:
    """``eps`` as a CPU float64 scalar tensor: one ``addcmul`` adds it (in the other operands'
    dtype: a scalar tensor does not promote them)."""
    return torch.tensor(eps, dtype=torch.float64)


def _rstd(v: torch.Tensor, group_size: int, eps: float, cpu: bool | None = None) -> torch.Tensor:
    """``rsqrt(mean(v^2) + eps)`` per group, shape ``(rows, groups, 1)`` (``(rows, 1)`` for one
    group a row), from each group's vector norm. On a CPU (``cpu``, by default ``v``'s device)
    the norm's square, mean and ``eps`` in one ``addcmul`` with a cached ``eps`` tensor (a
    decode step's call: four ops on one number cost three microseconds more); elsewhere in
    four in-place ops (a device's ``eps`` tensor would be a copy from the host)."""
    groups = v if group_size == v.shape[-1] else v.unflatten(-1, (-1, group_size))
    n = torch.linalg.vector_norm(groups, dim=-1, keepdim=True)
    if v.device.type == "cpu" if cpu is None else cpu:
        return torch.addcmul(_eps_tensor(eps), n, n, value=1 / group_size).rsqrt_()
    return n.square_().div_(group_size).add_(eps).rsqrt_()


def _scale_groups(t: torch.Tensor, r: torch.Tensor, group_size: int) -> torch.Tensor:
    """``t * r`` broadcasting ``r`` over each group, in place."""
    _grouped(t, group_size).mul_(r)
    return t


def _fused_forward(y, x, z, w, eps: float, group_size: int, norm_before_gate: bool) -> None:
    """One block of the forward as a single expression written into ``y``, for inductor to fuse
    into one loop."""
    xf, zf, wf = x.float(), z.float(), w.float()
    gate = torch.nn.functional.silu(zf)
    v = xf if norm_before_gate else xf * gate
    vg = v.unflatten(-1, (-1, group_size))
    n = (vg * torch.rsqrt(vg.square().mean(-1, keepdim=True) + eps)).flatten(-2) * wf
    y.copy_(n * gate if norm_before_gate else n)


def _fused_backward(
    dx_out, dz_out, terms_out, g, x, z, w, eps: float, group_size: int, norm_before_gate: bool
) -> None:
    """One block of the backward, writing ``dx_out``, ``dz_out`` and, in ``terms_out``, the
    per-element ``dweight`` terms.

    The terms are summed over rows outside: inductor's CPU code for a reduction across rows walks
    the block once per vector of columns, several times slower than the eager column sum.
    """
    gf, xf, zf, wf = g.float(), x.float(), z.float(), w.float()
    sig = torch.sigmoid(zf)
    gate = zf * sig
    dsilu = sig * (1 + zf * (1 - sig))
    v = xf if norm_before_gate else xf * gate
    vg = v.unflatten(-1, (-1, group_size))
    r = torch.rsqrt(vg.square().mean(-1, keepdim=True) + eps)
    ng = vg * r
    gy = gf * gate if norm_before_gate else gf
    gn = (gy * wf).unflatten(-1, (-1, group_size))
    if group_size == 1:  # the exact form of r * (gn - n * mean(gn * n)), see _norm_backward
        dv = (gn * (r * r * r * eps)).flatten(-2)
    else:
        dv = (r * (gn - ng * (gn * ng).mean(-1, keepdim=True))).flatten(-2)
    n = ng.flatten(-2)
    if norm_before_gate:
        dx, dz = dv, gf * n * wf * dsilu
    else:
        dx, dz = dv * gate, dv * xf * dsilu
    dx_out.copy_(dx)
    dz_out.copy_(dz)
    terms_out.copy_(gy * n)


def _small_forward(x, z, weight, eps, group_size, norm_before_gate):
    """The forward of one block's worth of rows in the fewest ops (the gate, the norm, the
    products) and Python calls: a decode step's call, where the blocked code's twenty small ops
    cost four times the math, and each call of a helper microseconds with caches cold.
    (``F.rms_norm`` is not used: its CPU kernel costs more than the norms' form at D 1024; on
    an H200, torch 2.11, its float64 kernel made a whole row NaN for one infinite
    entry, where the math gives NaN there and zeros beside it.)"""
    out_dtype = x.dtype
    if out_dtype is not torch.float32 or weight.dtype is not torch.float32:
        ct = compute_dtype(out_dtype)
        x, z, weight = as_dtype(x, ct), as_dtype(z, ct), as_dtype(weight, ct)
    gate = torch.nn.functional.silu(z)
    v = x if norm_before_gate else x * gate
    y = _scaled(v, _rstd(v, group_size, eps), group_size).mul_(weight)
    if norm_before_gate:
        y.mul_(gate)
    return y if out_dtype is torch.float32 else as_dtype(y, out_dtype)


def _small(x: torch.Tensor) -> bool:
    """Whether ``x`` is one block or less that the compiled kernels do not take: the short
    forward and backward (below the compile threshold, use_compiled's reading of the
    environment is skipped)."""
    n = x.numel()
    return n <= BLOCK_ELEMENTS and (
        n < COMPILE_MIN_ELEMENTS or not use_compiled(x, COMPILE_MIN_ELEMENTS)
    )


def forward(x, z, weight, eps, group_size, norm_before_gate):
    if x.numel() < COMPILE_MIN_ELEMENTS or _small(x):
        return _small_forward(x, z, weight, eps, group_size, norm_before_gate)
    xr, zr = _rows(x), _rows(z)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    yr = y.view(-1, x.shape[-1])
    if use_compiled(x, COMPILE_MIN_ELEMENTS):
        for b in _blocks(xr.shape[0], xr.shape[1], COMPILED_BLOCK_ELEMENTS):
            args = (yr[b], xr[b], zr[b], weight, eps, group_size, norm_before_gate)
            if run_compiled(OP, _fused_forward, *args) is FAILED:
                break
        else:
            return y
    ct = compute_dtype(x.dtype)
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
        return gn.mul_(r.reshape(gn.shape).pow(3).mul_(eps))
    gn_g, n_g = _grouped(gn, group_size), _grouped(n, group_size)
    dots = torch.linalg.vecdot(gn_g, n_g).unsqueeze_(-1)  # group_size * mean(gn * n)
    gn_g.addcmul_(n_g, dots, value=-1 / group_size)
    return _scale_groups(gn, r, group_size)


def _scaled(t: torch.Tensor, r: torch.Tensor, group_size: int) -> torch.Tensor:
    """``t * r`` broadcasting ``r`` over each group, a new tensor."""
    if group_size == t.shape[-1]:
        return t * r
    return (t.unflatten(-1, (-1, group_size)) * r).flatten(-2)


def _row_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over its rows: ``(D,)`` (a view of ``t`` when it is one row)."""
    D = t.shape[-1]
    return t.reshape(D) if t.numel() == D else t.reshape(-1, D).sum(0)


def _block_backward(gb, xb, zb, w, eps, group_size, norm_before_gate):
    """``(dx, dz, dweight)`` of rows in the compute dtype (read, never written), in it: the
    gradients of the rows and their sum for ``weight`` (the gate's through ``silu_backward``,
    one op where its formula took five)."""
    gate = torch.nn.functional.silu(zb)
    if norm_before_gate:
        r = _rstd(xb, group_size, eps)
        n = _scaled(xb, r, group_size)
        gn = gb * gate  # dL/d(n * weight)
        dweight = _row_sum(gn * n)
        dz = torch.ops.aten.silu_backward(gb.mul(n).mul_(w), zb)  # g * n * weight * silu'(z)
        return _norm_backward(gn.mul_(w), n, r, group_size, eps), dz, dweight
    v = xb * gate
    r = _rstd(v, group_size, eps)
    n = _scale_groups(v, r, group_size)
    dweight = _row_sum(gb * n)
    dv = _norm_backward(gb * w, n, r, group_size, eps)
    dz = torch.ops.aten.silu_backward(dv * xb, zb)
    return dv.mul_(gate), dz, dweight


def backward(g, x, z, weight, eps, group_size, norm_before_gate):
    ct = compute_dtype(x.dtype)
    if _small(x):  # one block: no output buffers, copies or running sum (a decode step's call)
        if x.dtype == ct and z.dtype == ct and g.dtype == ct and weight.dtype == ct:
            # (no-op .to calls, seven of them, cost a decode step's backward a tenth)
            return _block_backward(g, x, z, weight, eps, group_size, norm_before_gate)
        dx, dz, dweight = _block_backward(g.to(ct), x.to(ct), z.to(ct), weight.to(ct), eps,
                                          group_size, norm_before_gate)  # fmt: skip
        return dx.to(x.dtype), dz.to(z.dtype), dweight.to(weight.dtype)
    D = x.shape[-1]
    gr, xr, zr = _rows(g), _rows(x), _rows(z)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dz = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    dxr, dzr = dx.view(-1, D), dz.view(-1, D)
    dweight = torch.zeros(D, dtype=ct, device=x.device)
    if use_compiled(x, COMPILE_MIN_ELEMENTS):
        blocks = list(_blocks(xr.shape[0], D, COMPILED_BACKWARD_BLOCK_ELEMENTS))
        terms = torch.empty((blocks[0].stop, D), dtype=torch.float32)  # rows >= 1 when compiled
        for b in blocks:
            t = terms[: b.stop - b.start]
            inputs = (gr[b], xr[b], zr[b], weight, eps, group_size, norm_before_gate)
            if run_compiled(OP, _fused_backward, dxr[b], dzr[b], t, *inputs) is FAILED:
                dweight.zero_()
                break
            dweight.add_(t.sum(0))
        else:
            return dx, dz, dweight.to(weight.dtype)
    w = weight.to(ct)
    for b in _blocks(xr.shape[0], D):
        dxb, dzb, dwb = _block_backward(gr[b].to(ct), xr[b].to(ct), zr[b].to(ct), w, eps,
                                        group_size, norm_before_gate)  # fmt: skip
        dxr[b].copy_(dxb)
        dzr[b].copy_(dzb)
        dweight.add_(dwb)
    return dx, dz, dweight.to(weight.dtype)
