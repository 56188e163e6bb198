"""Gated RMSNorm in numba-cuda: float32 math, one rounding at the store, ``rstd`` recomputed.

A block owns one row at a time (grid-stride over rows). Groups wider than ``SMALL_GROUP`` are
reduced by the whole block (a fixed shared-memory tree, so the sum is the same every run);
narrower groups belong to one thread each, which walks its group alone. Either way a column is
always handled by the same thread of a block, so the backward accumulates ``dweight`` per
(block, column) in float32 without atomics, and the host sums the block partials in block order.

CPU tensors go to the ``njit`` kernels of :mod:`cakeops_numba.cpu.rmsnorm_silu_gate` (in the
simulator, to the CUDA kernels above).
"""

from __future__ import annotations

import math

import torch
from numba import cuda, float32

from cakeops_numba import SIMULATOR, on_cpu_kernels
from cakeops_numba._elements import sigmoid, store, widen
from cakeops_numba._launch import THREADS, blocks_for, on_stream, view
from cakeops_numba.cpu import rmsnorm_silu_gate as cpu

#: The largest input chosen implicitly on the CPU: a decode step's rows (16 of 1024, 4 of 4096),
#: where the njit kernel's passes beat the torch backend's dozen ops in float32, bfloat16 and
#: float16 alike; wider inputs, where torch's vectorised ops (then its compiled kernel) win the
#: forward, go to torch.
CPU_NORM_ELEMENTS = 1 << 14


def not_preferred_reasons(inputs) -> list[str]:
    """Passed over on the CPU above a decode step's size (the backend's
    ``not_preferred_reasons``)."""
    if on_cpu_kernels(inputs.x) and inputs.x.numel() > CPU_NORM_ELEMENTS:
        return [
            f"its CPU kernel is chosen implicitly for up to {CPU_NORM_ELEMENTS} elements "
            f"(a decode step's), got {inputs.x.numel()}"
        ]
    return []


SMALL_GROUP = 32
SIM_SWITCH_INTERVAL_S = 1e-3  # long loops between barriers: see _launch


@cuda.jit(device=True)
def _block_sum(buf, value):
    """Sum of ``value`` over the block's threads, the same tree every time."""
    tid = cuda.threadIdx.x
    buf[tid] = value
    cuda.syncthreads()
    step = THREADS // 2
    while step > 0:
        if tid < step:
            buf[tid] += buf[tid + step]
        cuda.syncthreads()
        step //= 2
    total = buf[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def _silu(z):
    sig = sigmoid(z)
    return sig, z * sig


@cuda.jit(device=True)
def _v(x, z, row, c, norm_before_gate):
    """The normalised quantity: ``x``, or ``x * silu(z)`` when the gate comes first."""
    v = widen(x[row, c])
    if not norm_before_gate:
        v *= _silu(widen(z[row, c]))[1]
    return v


@cuda.jit(device=True)
def _sum_sq(x, z, row, lo, hi, stride, norm_before_gate):
    acc = float32(0.0)
    for c in range(lo, hi, stride):
        v = _v(x, z, row, c, norm_before_gate)
        acc += v * v
    return acc


@cuda.jit(device=True)
def _forward_span(x, z, w, y, row, lo, hi, stride, rstd, norm_before_gate):
    for c in range(lo, hi, stride):
        n = _v(x, z, row, c, norm_before_gate) * rstd * widen(w[c])
        if norm_before_gate:
            n *= _silu(widen(z[row, c]))[1]
        store(y, (row, c), n)


@cuda.jit
def _forward(x, z, w, y, eps, group_size, norm_before_gate):
    buf = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    rows, D = x.shape
    small = group_size <= SMALL_GROUP
    inv_g = float32(1.0) / float32(group_size)  # keeps the math in float32
    for row in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
        if small:
            for start in range(tid * group_size, D, THREADS * group_size):
                end = start + group_size
                ss = _sum_sq(x, z, row, start, end, 1, norm_before_gate)
                rstd = float32(1.0) / math.sqrt(ss * inv_g + eps)
                _forward_span(x, z, w, y, row, start, end, 1, rstd, norm_before_gate)
        else:
            for start in range(0, D, group_size):
                lo, end = start + tid, start + group_size
                ss = _block_sum(buf, _sum_sq(x, z, row, lo, end, THREADS, norm_before_gate))
                rstd = float32(1.0) / math.sqrt(ss * inv_g + eps)
                _forward_span(x, z, w, y, row, lo, end, THREADS, rstd, norm_before_gate)


@cuda.jit(device=True)
def _gn_dot_n(x, z, w, g, row, lo, hi, stride, rstd, norm_before_gate):
    """``sum(gn * n)`` over a span, ``gn`` the gradient reaching the normalised ``n``."""
    acc = float32(0.0)
    for c in range(lo, hi, stride):
        n = _v(x, z, row, c, norm_before_gate) * rstd
        gy = widen(g[row, c])
        if norm_before_gate:
            gy *= _silu(widen(z[row, c]))[1]
        acc += gy * widen(w[c]) * n
    return acc


@cuda.jit(device=True)
def _backward_span(
    x, z, w, g, dx, dz, dw, row, lo, hi, stride, rstd, mean, eps, one, norm_before_gate
):
    blk = cuda.blockIdx.x
    for c in range(lo, hi, stride):
        xv, zv, gv, wv = widen(x[row, c]), widen(z[row, c]), widen(g[row, c]), widen(w[c])
        sig, gate = _silu(zv)
        dsilu = sig * (float32(1.0) + zv * (float32(1.0) - sig))
        v = xv if norm_before_gate else xv * gate
        n = v * rstd
        gy = gv * gate if norm_before_gate else gv
        gn = gy * wv
        dw[blk, c] += gy * n
        # With one feature per group, rstd * (gn - n * mean(gn * n)) cancels catastrophically;
        # gn * eps * rstd^3 is its exact form.
        dv = gn * eps * rstd * rstd * rstd if one else rstd * (gn - n * mean)
        if norm_before_gate:
            store(dx, (row, c), dv)
            store(dz, (row, c), gv * n * wv * dsilu)
        else:
            store(dx, (row, c), dv * gate)
            store(dz, (row, c), dv * xv * dsilu)


@cuda.jit
def _backward(x, z, w, g, dx, dz, dw, eps, group_size, norm_before_gate):
    buf = cuda.shared.array(THREADS, float32)
    tid = cuda.threadIdx.x
    rows, D = x.shape
    small = group_size <= SMALL_GROUP
    inv_g = float32(1.0) / float32(group_size)  # keeps the math in float32
    one = group_size == 1
    for row in range(cuda.blockIdx.x, rows, cuda.gridDim.x):
        if small:
            for start in range(tid * group_size, D, THREADS * group_size):
                end = start + group_size
                ss = _sum_sq(x, z, row, start, end, 1, norm_before_gate)
                rstd = float32(1.0) / math.sqrt(ss * inv_g + eps)
                dot = _gn_dot_n(x, z, w, g, row, start, end, 1, rstd, norm_before_gate)
                _backward_span(
                    x, z, w, g, dx, dz, dw, row, start, end, 1,
                    rstd, dot * inv_g, eps, one, norm_before_gate,
                )  # fmt: skip
        else:
            for start in range(0, D, group_size):
                lo, end = start + tid, start + group_size
                ss = _block_sum(buf, _sum_sq(x, z, row, lo, end, THREADS, norm_before_gate))
                rstd = float32(1.0) / math.sqrt(ss * inv_g + eps)
                dot = _block_sum(
                    buf, _gn_dot_n(x, z, w, g, row, lo, end, THREADS, rstd, norm_before_gate)
                )
                _backward_span(
                    x, z, w, g, dx, dz, dw, row, lo, end, THREADS,
                    rstd, dot * inv_g, eps, False, norm_before_gate,
                )  # fmt: skip


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(rows, D)``, a view where the layout allows (strided rows stay in place)."""
    return t.reshape(-1, t.shape[-1])


def forward(x, z, weight, eps, group_size, norm_before_gate):
    if x.device.type == "cpu" and not SIMULATOR:
        return cpu.forward(x, z, weight, eps, group_size, norm_before_gate)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    xr = _rows(x)
    if xr.numel() == 0:
        return y
    grid = blocks_for(xr.shape[0], x.device)
    with on_stream(x.device, SIM_SWITCH_INTERVAL_S) as stream:
        _forward[grid, THREADS, stream](
            view(xr), view(_rows(z)), view(weight), view(y.view(xr.shape)),
            float32(eps), group_size, norm_before_gate,
        )  # fmt: skip
    return y


def backward(g, x, z, weight, eps, group_size, norm_before_gate):
    if x.device.type == "cpu" and not SIMULATOR:
        return cpu.backward(g, x, z, weight, eps, group_size, norm_before_gate)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dz = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    xr = _rows(x)
    D = x.shape[-1]
    if xr.numel() == 0:
        return dx, dz, torch.zeros_like(weight)
    grid = blocks_for(xr.shape[0], x.device)
    partials = torch.zeros((grid, D), dtype=torch.float32, device=x.device)
    with on_stream(x.device, SIM_SWITCH_INTERVAL_S) as stream:
        _backward[grid, THREADS, stream](
            view(xr), view(_rows(z)), view(weight), view(_rows(g)),
            view(dx.view(xr.shape)), view(dz.view(xr.shape)), view(partials),
            float32(eps), group_size, norm_before_gate,
        )  # fmt: skip
    return dx, dz, partials.sum(0).to(weight.dtype)
