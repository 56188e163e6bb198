"""Gated RMSNorm in Triton: float32 math, one rounding at the store, ``rstd`` recomputed.

Each program owns ``BLOCK_R`` rows and walks their groups one after the other; inside a group it
loops over ``BLOCK_G``-wide column chunks, so any group size works (no 64 KB row limit: a group
is never held in registers whole). The backward is a persistent launch, a few programs per
multiprocessor each walking row blocks in a fixed order, and keeps one float32 ``dweight``
partial per program, which the host sums in program order: deterministic, no atomics, and the
partials are bounded by the number of programs, not by the rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cakeops_triton._common import (
    PROGRAMS_PER_SM,
    multiprocessors,
    round_to,
    serialised,
    untuned,
)

MIN_BLOCK_G, MAX_BLOCK_G = 64, 1024
# Elements per (BLOCK_R x BLOCK_G) tile, and threads per program: 8 elements a thread. Strides
# that are not multiples of 16 elements leave every element its own 64-bit address (no vector
# loads), so a thread's share of a tile bounds its registers at any D (nox -s gpu_compile
# sweeps D and group sizes).
TILE = 2048
WARPS = 8


@triton.jit
def _silu_parts(z):
    sig = 1.0 / (1.0 + tl.exp(-z))
    return sig, z * sig


@triton.jit
def _group_rstd(
    X, Z, rows64, row_ok, start, stride_x, stride_z, eps,
    G, NORM_BEFORE_GATE,
    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """``rsqrt(mean(v^2) + eps)`` over the group starting at column ``start`` of each row, with
    ``v = x`` (or ``x * silu(z)`` when the gate comes first)."""
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c in range(0, G, BLOCK_G):
        cols = start + c + tl.arange(0, BLOCK_G)
        m = row_ok[:, None] & (cols < start + G)[None, :]
        v = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
        v = v.to(tl.float32)
        if NORM_BEFORE_GATE == 0:
            z = tl.load(Z + rows64[:, None] * stride_z + cols[None, :], mask=m, other=0.0)
            v = v * _silu_parts(z.to(tl.float32))[1]
        acc += tl.sum(v * v, axis=1)
    return 1.0 / tl.sqrt(acc / G + eps)


@triton.jit
def _chunk(
    X, Z, W, GO, rows64, row_ok, cols, group_end, stride_x, stride_z,
    D, HAS_GRAD: tl.constexpr,
):  # fmt: skip
    """One ``BLOCK_R x BLOCK_G`` chunk of x, z (and the incoming gradient) and its weights, in
    float32, with the mask of valid entries."""
    col_ok = cols < group_end
    m = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    z = tl.load(Z + rows64[:, None] * stride_z + cols[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_GRAD:
        g = tl.load(GO + rows64[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    else:
        g = x
    return m, x, z, w, g


@triton.jit
def _norm_terms(x, z, w, g, r, NORM_BEFORE_GATE):
    """``(sigma(z), silu(z), n, a)``: the normalised ``n`` and its incoming gradient ``a``."""
    sig, gate = _silu_parts(z)
    if NORM_BEFORE_GATE:
        n = x * r[:, None]
        a = w[None, :] * g * gate
    else:
        n = x * gate * r[:, None]
        a = w[None, :] * g
    return sig, gate, n, a


def _forward_kernel(
    X, Z, W, Y,
    R, stride_x, stride_z,
    eps,
    D, G, NORM_BEFORE_GATE,
    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    rows64 = rows.to(tl.int64)
    for start in range(0, D, G):  # one group at a time
        r = _group_rstd(
            X, Z, rows64, row_ok, start, stride_x, stride_z, eps,
            G, NORM_BEFORE_GATE, BLOCK_R, BLOCK_G,
        )  # fmt: skip
        # y = v * r * weight (* silu(z)), rounded once
        for c in range(0, G, BLOCK_G):
            cols = start + c + tl.arange(0, BLOCK_G)
            m, x, z, w, _ = _chunk(
                X, Z, W, X, rows64, row_ok, cols, start + G, stride_x, stride_z, D, False
            )  # fmt: skip
            gate = _silu_parts(z)[1]
            if NORM_BEFORE_GATE:
                y = x * r[:, None] * w[None, :] * gate
            else:
                y = x * gate * r[:, None] * w[None, :]
            tl.store(
                Y + rows64[:, None] * D + cols[None, :], round_to(y, Y.dtype.element_ty), mask=m
            )


def _backward_kernel(
    GO, X, Z, W, DX, DZ, DW_PARTIAL,
    R, PROGRAMS, stride_x, stride_z,
    eps,
    D, G, NORM_BEFORE_GATE, SINGLE,
    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    for block in range(pid, tl.cdiv(R, BLOCK_R), PROGRAMS):
        _backward_rows(
            GO, X, Z, W, DX, DZ, DW_PARTIAL + pid.to(tl.int64) * D, block * BLOCK_R, R,
            stride_x, stride_z, eps, D, G, NORM_BEFORE_GATE, SINGLE, BLOCK_R, BLOCK_G,
        )  # fmt: skip
        # this program's partial is read back by other threads of it in the next block
        tl.debug_barrier()


@triton.jit
def _backward_rows(
    GO, X, Z, W, DX, DZ, DW_ROW, row0, R, stride_x, stride_z, eps,
    D, G, NORM_BEFORE_GATE, SINGLE,
    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """dx, dz of ``BLOCK_R`` rows from ``row0``, their dweight terms added to ``DW_ROW``."""
    rows = row0 + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    rows64 = rows.to(tl.int64)
    for start in range(0, D, G):
        r = _group_rstd(  # recomputed from the inputs
            X, Z, rows64, row_ok, start, stride_x, stride_z, eps,
            G, NORM_BEFORE_GATE, BLOCK_R, BLOCK_G,
        )  # fmt: skip
        # mean(a * n) with a = dL/dn
        an = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c in range(0, G, BLOCK_G):
            cols = start + c + tl.arange(0, BLOCK_G)
            m, x, z, w, g = _chunk(
                X, Z, W, GO, rows64, row_ok, cols, start + G, stride_x, stride_z, D, True
            )  # fmt: skip
            _, _, n, a = _norm_terms(x, z, w, g, r, NORM_BEFORE_GATE)
            an += tl.sum(a * n, axis=1)
        mean = an / G
        # dx, dz and this program's dweight partial
        for c in range(0, G, BLOCK_G):
            cols = start + c + tl.arange(0, BLOCK_G)
            m, x, z, w, g = _chunk(
                X, Z, W, GO, rows64, row_ok, cols, start + G, stride_x, stride_z, D, True
            )  # fmt: skip
            sig, gate, n, a = _norm_terms(x, z, w, g, r, NORM_BEFORE_GATE)
            dsilu = sig * (1.0 + z * (1.0 - sig))
            if SINGLE:  # groups of one feature
                # r * (a - n * a * n) = a * eps * r^3 exactly; the difference would cancel
                dv = a * (eps * r * r * r)[:, None]
            else:
                dv = r[:, None] * (a - n * mean[:, None])
            if NORM_BEFORE_GATE:
                dx = dv
                dz = g * n * w[None, :] * dsilu
                dw = g * gate * n
            else:
                dx = dv * gate
                dz = dv * x * dsilu
                dw = g * n
            out = rows64[:, None] * D + cols[None, :]
            tl.store(DX + out, round_to(dx, DX.dtype.element_ty), mask=m)
            tl.store(DZ + out, round_to(dz, DZ.dtype.element_ty), mask=m)
            col_ok = cols < start + G
            dw = tl.sum(tl.where(m, dw, 0.0), axis=0) + tl.load(DW_ROW + cols, mask=col_ok)
            tl.store(DW_ROW + cols, dw, mask=col_ok)


# Each kernel specialised on its sizes and strides, and untuned: one binary (per dtype) for
# inputs too small to need vector loads (fewer than UNTUNED_BELOW elements), in chunks of
# UNTUNED_BLOCK_G columns whatever the group size. The options (norm before gate, groups of one)
# are run-time flags: uniform branches in a memory-bound loop, and half the binaries each.
_forward_tuned = triton.jit(do_not_specialize=["R", "NORM_BEFORE_GATE"])(_forward_kernel)
_forward_untuned = untuned(_forward_kernel)
_backward_tuned = triton.jit(do_not_specialize=["R", "PROGRAMS", "NORM_BEFORE_GATE", "SINGLE"])(
    _backward_kernel
)
_backward_untuned = untuned(_backward_kernel)
UNTUNED_BELOW = 1 << 16
UNTUNED_BLOCK_G = 256


def _blocks(group_size: int, tuned: bool) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_G)``: chunks of the group's power of two, from 64 (narrower groups are
    masked: a handful of compilations serves every group size) up to ``MAX_BLOCK_G``; a
    problem too small to tune takes ``UNTUNED_BLOCK_G`` columns at a time."""
    if tuned:
        block_g = min(max(MIN_BLOCK_G, triton.next_power_of_2(group_size)), MAX_BLOCK_G)
    else:
        block_g = UNTUNED_BLOCK_G
    return max(1, min(64, TILE // block_g)), block_g


def _warps(block_g: int) -> int:
    """8 warps (8 elements a thread), but 4 for the widest chunks, whose column reductions
    across 8 warps spilled on sm_80."""
    return 4 if block_g >= MAX_BLOCK_G else WARPS


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(R, D)`` with a contiguous last dim; strided rows are read in place."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


@serialised
def forward(x, z, weight, eps, group_size, norm_before_gate):
    x2, z2 = _rows(x), _rows(z)
    R, D = x2.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tuned = R * D >= UNTUNED_BELOW
    block_r, block_g = _blocks(group_size, tuned)
    grid = (triton.cdiv(R, block_r),)
    kernel = _forward_tuned if tuned else _forward_untuned
    kernel[grid](
        x2, z2, weight.contiguous(), y,
        R, x2.stride(0), z2.stride(0),
        eps,
        D=D, G=group_size, NORM_BEFORE_GATE=int(norm_before_gate),
        BLOCK_R=block_r, BLOCK_G=block_g, num_warps=_warps(block_g), num_stages=1,
    )  # fmt: skip
    return y


@serialised
def backward(g, x, z, weight, eps, group_size, norm_before_gate):
    x2, z2 = _rows(x), _rows(z)
    R, D = x2.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dz = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    tuned = R * D >= UNTUNED_BELOW
    block_r, block_g = _blocks(group_size, tuned)
    programs = min(triton.cdiv(R, block_r), PROGRAMS_PER_SM * multiprocessors(x.device))
    partial = torch.zeros((programs, D), dtype=torch.float32, device=x.device)
    kernel = _backward_tuned if tuned else _backward_untuned
    kernel[(programs,)](
        g, x2, z2, weight.contiguous(), dx, dz, partial,
        R, programs, x2.stride(0), z2.stride(0),
        eps,
        D=D, G=group_size, NORM_BEFORE_GATE=int(norm_before_gate), SINGLE=int(group_size == 1),
        BLOCK_R=block_r, BLOCK_G=block_g, num_warps=_warps(block_g), num_stages=1,
    )  # fmt: skip
    return dx, dz, partial.sum(0).to(weight.dtype)
