"""Gated RMSNorm on the CPU: a row at a time, float32, each pass a loop LLVM vectorises.

A decode step's call (a row of a model's width) is what this serves: the ``torch`` backend runs
it as seven small ops forward and fifteen backward, a microsecond each, where here the math of a
row of 1024 costs about one, and the call numba's dispatch of the tensors' addresses.

Each row takes a pass for the gate's ``exp``, one for ``sigmoid``, one for each group's sum of
squares (and in the backward its dot product) and one for the results. ``exp`` is
:func:`_exp`, in float32 arithmetic: ``libm``'s ``expf`` is a call per element that keeps a loop
scalar (four times slower here), and numba vectorises it only with Intel's SVML installed. A loop
fusing ``exp`` with a division is left scalar by LLVM's cost model, hence the separate passes.

Inputs of ``SERIAL_BELOW`` elements or more run their rows on numba's threads (``prange``, under
the launch lock), a block of rows at a time; smaller ones in one call on the calling thread,
with no lock (converted to float32 whole: at most 128 KiB). The backward sums
``dweight`` in ``CHUNKS`` contiguous ranges of rows, then the ranges in order: deterministic,
whatever the number of threads.

The kernels take the addresses of float32 C-contiguous tensors (other dtypes and layouts are
converted ``BLOCK_ELEMENTS`` at a time, so the copies stay bounded), not numpy arrays:
``Tensor.numpy()`` costs four times an address, and marks the tensor's storage as one that can
never be resized again, which breaks FSDP2, whose parameters' storage is freed by resizing it.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from cakeops.helpers import as_dtype
from cakeops_numba.cpu._njit import (
    F32,
    FASTMATH,
    as_float32,
    compiled,
    floats,
    int_as_float,
    launching,
)

BLOCK_ELEMENTS = 1 << 20
#: Inputs smaller than this run on the calling thread, with no launch lock: waking numba's threads
#: costs more than the rows.
SERIAL_BELOW = 1 << 15
#: Ranges of rows whose ``dweight`` terms the backward sums apart, then in order.
CHUNKS = 16

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 in two parts: k * _LN2_HI is exact for |k| < 2^9
_LN2_LO = np.float32(-2.1219444005469057e-4)
_EXP_MAX = np.float32(88.72283935546875)  # above: inf
_EXP_MIN = np.float32(-87.33654022216797)  # below: 0 (e^x < 2^-126, a subnormal, flushed)
_C1, _C2, _C3 = np.float32(1.0), np.float32(1.0 / 2), np.float32(1.0 / 6)
_C4, _C5, _C6, _C7 = (np.float32(1.0 / f) for f in (24, 120, 720, 5040))


@njit(fastmath=FASTMATH, error_model="numpy", inline="always")
def _exp(x):  # pragma: no cover - compiled
    """``e^x`` in float32 to about 1.3 ulp: ``2^k e^r`` with ``k = round(x / ln 2)``, ``|r| <=
    ln(2) / 2`` and ``e^r`` from its Taylor polynomial to ``r^7`` (truncation below 1e-8);
    ``2^k`` as two powers of two, each built from its exponent bits, so ``k = 128`` still
    gives a finite result. inf above ``_EXP_MAX``, 0 below ``_EXP_MIN``, NaN for NaN."""
    xc = x if x < _EXP_MAX else _EXP_MAX  # (NaN: _EXP_MAX, replaced below)
    xc = xc if xc > _EXP_MIN else _EXP_MIN
    kf = np.floor(xc * _LOG2E + np.float32(0.5))
    r = xc - kf * _LN2_HI - kf * _LN2_LO
    p = r * _C7 + _C6  # Horner, unrolled: a loop here would keep the caller's loop scalar
    p = p * r + _C5
    p = p * r + _C4
    p = p * r + _C3
    p = p * r + _C2
    p = p * r + _C1
    p = p * r + _C1
    k = np.int32(kf)
    half = k >> np.int32(1)
    e = p * int_as_float((half + np.int32(127)) << np.int32(23))
    e = e * int_as_float((k - half + np.int32(127)) << np.int32(23))
    e = e if x <= _EXP_MAX else np.float32(np.inf)
    e = e if x >= _EXP_MIN else np.float32(0.0)
    return e if x == x else x


@compiled(parallel=False)
def _sigmoid_row(z, sig):  # pragma: no cover - compiled
    """``sig[:] = sigmoid(z)`` (two loops: see the module's docstring)."""
    for i in range(z.shape[0]):
        sig[i] = _exp(-z[i])
    for i in range(z.shape[0]):
        sig[i] = np.float32(1.0) / (np.float32(1.0) + sig[i])


@compiled(parallel=False, fastmath={"reassoc", "contract"})
def _rstd(v, eps):  # pragma: no cover - compiled
    """``rsqrt(mean(v^2) + eps)``; without "arcp", which turns ``1 / sqrt`` into an estimate
    and a Newton step, and that gives NaN, not 0, for an infinite sum (the other elements of
    an infinite one's group are then 0, as in the reference, not NaN)."""
    s = np.float32(0.0)
    for i in range(v.shape[0]):
        s += v[i] * v[i]
    return np.float32(1.0) / np.sqrt(s / np.float32(v.shape[0]) + np.float32(eps))


@compiled(parallel=False)
def _normed(x, z, sig, v, norm_before_gate):  # pragma: no cover - compiled
    """``sig[:] = sigmoid(z)``, ``v[:]`` the vector the norm scales: ``x`` or ``x * silu(z)``."""
    _sigmoid_row(z, sig)
    for i in range(x.shape[0]):
        v[i] = x[i] if norm_before_gate else x[i] * (z[i] * sig[i])


@compiled(parallel=False)
def _forward_group(v, z, sig, w, y, eps, norm_before_gate):  # pragma: no cover - compiled
    """One group of ``y``."""
    rstd = _rstd(v, eps)
    if norm_before_gate:
        for i in range(v.shape[0]):
            y[i] = v[i] * rstd * w[i] * (z[i] * sig[i])
    else:
        for i in range(v.shape[0]):
            y[i] = v[i] * rstd * w[i]


@compiled(parallel=False)
def _forward_row(x, z, w, y, v, sig, eps, group_size, norm_before_gate):  # pragma: no cover
    """One row of ``y``; ``v`` and ``sig``: scratch rows. Each group's loops run over slices
    (indices from 0: a loop from a runtime start checks each index's sign, and stays scalar)."""
    _normed(x, z, sig, v, norm_before_gate)
    for lo in range(0, x.shape[0], group_size):
        g = slice(lo, lo + group_size)
        _forward_group(v[g], z[g], sig[g], w[g], y[g], eps, norm_before_gate)


def _forward_rows(x, z, w, y, rows, D, eps, group_size, norm_before_gate):  # pragma: no cover
    """``y`` from ``x`` and ``z``: the addresses of C-contiguous float32 ``(rows, D)`` arrays
    (``w``: ``(D,)``)."""
    x2, z2, y2 = floats(x, (rows, D)), floats(z, (rows, D)), floats(y, (rows, D))
    w1 = floats(w, (D,))
    chunks = min(CHUNKS, rows)
    for c in prange(chunks):
        v, sig = np.empty(D, np.float32), np.empty(D, np.float32)
        for r in range(rows * c // chunks, rows * (c + 1) // chunks):
            _forward_row(x2[r], z2[r], w1, y2[r], v, sig, eps, group_size, norm_before_gate)


@compiled(parallel=False)
def _backward_group(g, x, z, w, dx, dz, dw, v, sig, eps, norm_before_gate):  # pragma: no cover
    """One group of ``dx`` and ``dz``, its ``dweight`` terms added to ``dw``.

    With ``n = v * rstd`` and ``gn`` the gradient reaching ``n``, ``dv = rstd * (gn - n *
    mean(gn * n))``; with one feature per group that difference cancels catastrophically, and
    its exact form ``gn * eps * rstd^3`` is used instead.
    """
    size = v.shape[0]
    rstd = _rstd(v, eps)
    dot = np.float32(0.0)
    for i in range(size):
        gy = g[i] * (z[i] * sig[i]) if norm_before_gate else g[i]
        dot += gy * w[i] * v[i]
    mean = dot * rstd / np.float32(size)  # mean(gn * n)
    cube = rstd * rstd * rstd * np.float32(eps)
    for i in range(size):
        s, zi = sig[i], z[i]
        gate = zi * s
        dsilu = s * (np.float32(1.0) + zi * (np.float32(1.0) - s))
        n = v[i] * rstd
        gy = g[i] * gate if norm_before_gate else g[i]
        gn = gy * w[i]
        dw[i] += gy * n
        dv = gn * cube if size == 1 else rstd * (gn - n * mean)
        if norm_before_gate:
            dx[i] = dv
            dz[i] = g[i] * n * w[i] * dsilu
        else:
            dx[i] = dv * gate
            dz[i] = dv * x[i] * dsilu


@compiled(parallel=False)
def _backward_row(g, x, z, w, dx, dz, dw, v, sig, eps, group_size, norm_before_gate):
    """One row of ``dx`` and ``dz``, its ``dweight`` terms added to ``dw``; ``v`` and ``sig``:
    scratch rows."""
    _normed(x, z, sig, v, norm_before_gate)
    for lo in range(0, x.shape[0], group_size):
        s = slice(lo, lo + group_size)
        _backward_group(g[s], x[s], z[s], w[s], dx[s], dz[s], dw[s], v[s], sig[s], eps,
                        norm_before_gate)  # fmt: skip


def _backward_rows(g, x, z, w, dx, dz, dw, rows, D, eps, group_size, norm_before_gate):
    """``dx``, ``dz`` and ``dweight`` added to ``dw``: addresses as :func:`_forward_rows`'."""
    g2, x2, z2 = floats(g, (rows, D)), floats(x, (rows, D)), floats(z, (rows, D))
    dx2, dz2 = floats(dx, (rows, D)), floats(dz, (rows, D))
    w1, dw1 = floats(w, (D,)), floats(dw, (D,))
    chunks = min(CHUNKS, rows)
    partials = np.zeros((chunks, D), np.float32)
    for c in prange(chunks):
        v, sig = np.empty(D, np.float32), np.empty(D, np.float32)
        for r in range(rows * c // chunks, rows * (c + 1) // chunks):
            _backward_row(g2[r], x2[r], z2[r], w1, dx2[r], dz2[r], partials[c], v, sig, eps,
                          group_size, norm_before_gate)  # fmt: skip
    for c in range(chunks):
        for i in range(D):
            dw1[i] += partials[c, i]


# One Python function each, compiled twice: on the calling thread (``prange`` runs as ``range``)
# and on numba's threads.
_forward_serial, _forward_parallel = (compiled(p)(_forward_rows) for p in (False, True))
_backward_serial, _backward_parallel = (compiled(p)(_backward_rows) for p in (False, True))


def _row_blocks(rows: int, D: int):
    step = max(1, BLOCK_ELEMENTS // D)
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def forward(x, z, weight, eps, group_size, norm_before_gate):
    D, w = x.shape[-1], as_float32(weight)
    options = (eps, group_size, norm_before_gate)
    if x.numel() < SERIAL_BELOW:  # a decode step's: one call on this thread, no lock, no blocks
        xf, zf = as_float32(x), as_float32(z)
        y = torch.empty_like(xf)  # (a third of torch.empty(shape, dtype=...)'s cost)
        _forward_serial(xf.data_ptr(), zf.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() // D,
                        D, *options)  # fmt: skip
        return as_dtype(y, x.dtype)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xr, zr, yr = x.reshape(-1, D), z.reshape(-1, D), y.view(-1, D)
    with launching():
        for b in _row_blocks(xr.shape[0], D):
            xb, zb, yb = as_float32(xr[b]), as_float32(zr[b]), yr[b]
            out = yb if y.dtype is torch.float32 else torch.empty(xb.shape, **F32)
            _forward_parallel(xb.data_ptr(), zb.data_ptr(), w.data_ptr(), out.data_ptr(),
                              xb.shape[0], D, *options)  # fmt: skip
            if out is not yb:
                yb.copy_(out)
    return y


def backward(g, x, z, weight, eps, group_size, norm_before_gate):
    D, w = x.shape[-1], as_float32(weight)
    options = (eps, group_size, norm_before_gate)
    dweight = torch.zeros(D, **F32)
    if x.numel() < SERIAL_BELOW:
        gf, xf, zf = as_float32(g), as_float32(x), as_float32(z)
        dx, dz = torch.empty_like(xf), torch.empty_like(xf)
        addresses = (gf, xf, zf, w, dx, dz, dweight)
        _backward_serial(*(t.data_ptr() for t in addresses), x.numel() // D, D, *options)
        return as_dtype(dx, x.dtype), as_dtype(dz, z.dtype), as_dtype(dweight, weight.dtype)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dz = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    gr, xr, zr = g.reshape(-1, D), x.reshape(-1, D), z.reshape(-1, D)
    dxr, dzr = dx.view(-1, D), dz.view(-1, D)
    with launching():
        for b in _row_blocks(xr.shape[0], D):
            gb, xb, zb = as_float32(gr[b]), as_float32(xr[b]), as_float32(zr[b])
            outs = (dxr[b], dzr[b])
            if x.dtype is not torch.float32:
                outs = (torch.empty(xb.shape, **F32), torch.empty(xb.shape, **F32))
            addresses = (gb, xb, zb, w, *outs, dweight)
            _backward_parallel(*(t.data_ptr() for t in addresses), xb.shape[0], D, *options)
            if x.dtype is not torch.float32:
                dxr[b].copy_(outs[0])
                dzr[b].copy_(outs[1])
    return dx, dz, as_dtype(dweight, weight.dtype)
