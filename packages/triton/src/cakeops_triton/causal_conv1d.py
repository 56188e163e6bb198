"""The depthwise causal convolution in Triton: a tile of positions x channels per program.

One kernel, three passes. The forward loads its ``BL x BC`` tile's ``W`` shifted windows (from
x, or from the sequence's initial state where a window reaches before the sequence's start) and
writes ``act(bias + sum_j w_j window_j)``. The backward runs it twice:

1. the forward's windows again, giving ``dpre = dy act'(pre)`` (stored in float32) and, per
   program, its sums over positions of ``dpre window_j`` and ``dpre`` (the weight's and the
   bias's gradients, added up in a fixed order afterwards: deterministic, no atomics);
2. ``dx_t = sum_j w_j dpre_{t + W - 1 - j}`` within the sequence, plus the final state's
   gradient for the last ``W - 1`` positions.

The weight, the bias and the states are small and come in float32, and the width is a run-time
value: every call in one dtype of x shares one binary. The final state and the initial state's
gradient touch ``W - 1`` positions per sequence: gathered by :mod:`cakeops.helpers` on the
device, without synchronising. Packed sequences read each position's sequence from a table
made once per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cakeops.helpers import conv_final_state, conv_initial_state_grad
from cakeops_triton._common import INTERPRET, round_to, serialised, untuned


def not_supported_reasons(inputs) -> list[str]:
    """The kernel indexes within a row of ``x`` in 32 bits (the backend's
    ``not_supported_reasons``)."""
    if _row_extent(inputs.x) >= 2**31:
        return ["indexes within a row of x in 32 bits: C * L below 2**31 elements"]
    return []


def _row_extent(x: torch.Tensor) -> int:
    """Elements one row of ``(N, C, L)`` spans in memory (at least ``C * L``)."""
    _, C, L = x.shape
    return max(C * L, 1 + (C - 1) * abs(x.stride(1)) + (L - 1) * abs(x.stride(2)))


#: Positions and channels per program: 4 elements a thread on 4 warps, a row of 64 channels
#: (128 bytes in 16 bits) per position. The tiles' addresses and masks, hoisted out of the
#: loop over the taps, take about 15 registers an element: about 105 registers a thread, so
#: that 4 programs fit a multiprocessor (16 positions took 236: 2 programs; ``nox -s
#: gpu_compile`` sweeps the widths). Small under the interpreter, so that its test shapes
#: cross blocks.
BL, BC = (8, 8) if INTERPRET else (8, 64)
WARPS = 4
#: every launch's options, in one order (Triton's cache key reads them in the order given)
LAUNCH = {"num_warps": WARPS, "num_stages": 1}
#: Blocks of positions one backward program takes in turn: fewer partial sums to add up.
SPAN = 2 if INTERPRET else 16


@triton.jit
def _place(SEQ, CU, n, t, mt, L, PACKED):
    """Each position's ``(sequence, position within it, the sequence's end)``: row ``n`` of a
    batch, or (``PACKED``) one of the packed sequences."""
    seq, start, end = t * 0 + n, t * 0, t * 0 + L
    if PACKED:
        seq = tl.load(SEQ + t, mask=mt, other=0)
        start = tl.load(CU + seq, mask=mt, other=0)
        end = tl.load(CU + seq + 1, mask=mt, other=0)
    return seq, t - start, end


@triton.jit
def _window(x_row, INIT, seq, t, pos, c, mt, mc, j, W, sx_c, sx_l, si_s, si_c, si_k,
            HAS_INIT):  # fmt: skip
    """Tap ``j``'s inputs ``x[t - (W - 1) + j]`` of a tile, float32: from the initial state
    (or zeros) where they fall before the sequence's start."""
    rel = pos - (W - 1) + j
    inside = mt & (rel >= 0)
    m = inside[:, None] & mc[None, :]
    src = x_row + (t - (W - 1) + j)[:, None] * sx_l + c[None, :] * sx_c
    v = tl.load(src, mask=m, other=0.0).to(tl.float32)
    if HAS_INIT:
        before = (mt & (rel < 0))[:, None] & mc[None, :]
        slot = INIT + seq[:, None] * si_s + c[None, :] * si_c + (pos + j)[:, None] * si_k
        v += tl.load(slot, mask=before, other=0.0)
    return v


#: What a launch of :func:`_conv` computes.
FORWARD, GRAD, DX = 0, 1, 2


def _conv(
    X, WT, B, INIT, OUT, DY, DPRE, DW, DB, DFINAL, SEQ, CU,
    L, C, W, sx_n, sx_c, sx_l, si_s, si_c, si_k, so_n, so_c, so_l, sd_n, sd_c, sd_l,
    HAS_BIAS, HAS_INIT, HAS_DFINAL, PACKED, SILU, MODE, BLOCKS,
    TAPS: tl.constexpr, BL_: tl.constexpr, BC_: tl.constexpr,
):  # fmt: skip
    """One kernel for the three passes (one binary per dtype of x: the weight, the bias and
    the states come in float32), ``BLOCKS`` blocks of positions in turn per program:

    - ``FORWARD``: the output ``OUT`` (strides ``so_*``);
    - ``GRAD``: ``DPRE`` (float32 ``(N, C, L)``) from the upstream gradient ``DY`` (strides
      ``sd_*``), and the program's sums into ``DW`` ``(programs, C, TAPS)`` and ``DB``
      ``(programs, C)``;
    - ``DX``: ``OUT`` = dx from ``DPRE``, and the final state's gradient ``DFINAL``.
    """
    pid_l = tl.program_id(0)
    c = tl.program_id(1) * BC_ + tl.arange(0, BC_)
    n = tl.program_id(2)
    # a row's base in 64 bits, offsets within it in 32 (the host checks that they fit)
    x_row = X + n.to(tl.int64) * sx_n
    out_row = OUT + n.to(tl.int64) * so_n
    dy_row = DY + n.to(tl.int64) * sd_n
    dpre_row = DPRE + n.to(tl.int64) * C * L
    mc = c < C
    b = tl.zeros((BC_,), dtype=tl.float32)
    if HAS_BIAS:
        b = tl.load(B + c, mask=mc, other=0.0)
    dw_sums = tl.zeros((BC_, TAPS), dtype=tl.float32)  # TAPS: W up to a power of two
    db_sum = tl.zeros((BC_,), dtype=tl.float32)
    taps = tl.arange(0, TAPS)
    for block in range(pid_l * BLOCKS, tl.minimum((pid_l + 1) * BLOCKS, tl.cdiv(L, BL_))):
        t = block * BL_ + tl.arange(0, BL_)
        mt = t < L
        m = mt[:, None] & mc[None, :]
        seq, pos, end = _place(SEQ, CU, n, t, mt, L, PACKED)
        acc = tl.zeros((BL_, BC_), dtype=tl.float32)
        if MODE == 2:
            for j in range(W):  # the windows that read each position, within its sequence
                w = tl.load(WT + c * W + j, mask=mc, other=0.0)
                u = t + (W - 1) - j
                mu = (mt & (u < end))[:, None] & mc[None, :]
                d = tl.load(dpre_row + c[None, :] * L + u[:, None], mask=mu, other=0.0)
                acc += d * w[None, :]
            if HAS_DFINAL:
                k = t - end + (W - 1)  # the final state's slot of the last W - 1 positions
                tail = (mt & (k >= 0))[:, None] & mc[None, :]
                src = DFINAL + (seq[:, None] * C + c[None, :]) * (W - 1) + k[:, None]
                acc += tl.load(src, mask=tail, other=0.0)
        else:
            acc += b[None, :]
            for j in range(W):
                w = tl.load(WT + c * W + j, mask=mc, other=0.0)
                v = _window(x_row, INIT, seq, t, pos, c, mt, mc, j, W, sx_c, sx_l, si_s, si_c,
                            si_k, HAS_INIT)  # fmt: skip
                acc += v * w[None, :]
        if MODE == 1:
            dy = tl.load(dy_row + t[:, None] * sd_l + c[None, :] * sd_c, mask=m, other=0.0)
            dpre = dy.to(tl.float32)
            if SILU:
                s = 1.0 / (1.0 + tl.exp(-acc))
                dpre = dpre * s * (1.0 + acc * (1.0 - s))
            dpre = tl.where(m, dpre, 0.0)
            tl.store(dpre_row + c[None, :] * L + t[:, None], dpre, mask=m)
            db_sum += tl.sum(dpre, axis=0)
            for j in range(W):
                v = _window(x_row, INIT, seq, t, pos, c, mt, mc, j, W, sx_c, sx_l, si_s, si_c,
                            si_k, HAS_INIT)  # fmt: skip
                dw_j = tl.sum(dpre * v, axis=0)
                dw_sums += tl.where(taps[None, :] == j, dw_j[:, None], 0.0)
        else:
            if MODE == 0:  # noqa: SIM102 (``and`` of run-time ints does not compile)
                if SILU:
                    acc = acc / (1.0 + tl.exp(-acc))
            dst = out_row + t[:, None] * so_l + c[None, :] * so_c
            tl.store(dst, round_to(acc, OUT.dtype.element_ty), mask=m)
    if MODE == 1:
        program = n.to(tl.int64) * tl.num_programs(0) + pid_l
        tl.store(DW + (program * C + c[:, None]) * TAPS + taps[None, :], dw_sums,
                 mask=mc[:, None])  # fmt: skip
        tl.store(DB + program * C + c, db_sum, mask=mc)


_conv = untuned(_conv)


def _prepared(x, weight, bias, initial_state, cu_seqlens):
    """The kernel's shared arguments: the weight, bias and initial state in float32 (small:
    one binary per dtype of x), float32 stand-ins for the absent ones, each position's
    sequence when packed."""
    f32 = {"dtype": torch.float32, "device": x.device}
    dummy = torch.empty(0, **f32)
    seq = cu = torch.zeros(1, dtype=torch.int32, device=x.device)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(torch.int32)
        t = torch.arange(x.shape[2], device=x.device, dtype=torch.int32)
        seq = torch.searchsorted(cu[1:], t, right=True).to(torch.int32)
    init = dummy if initial_state is None else initial_state.float()
    init_strides = (0, 0, 0) if initial_state is None else init.stride()
    b = dummy if bias is None else bias.float()
    return weight.float().contiguous(), b, init, init_strides, seq, cu, dummy


def _taps(W: int) -> int:
    """The weight-gradient tile's width: 8 serves every model's width (up to 8) with one
    binary."""
    return max(8, triton.next_power_of_2(W))


def _grid(L, C, N, blocks=1):
    return (triton.cdiv(triton.cdiv(L, BL), blocks), triton.cdiv(C, BC), N)


@serialised
def forward(x, weight, bias, activation, initial_state, output_final_state, cu_seqlens):
    N, C, L = x.shape
    W = weight.shape[1]
    out = torch.empty_like(x)
    w, b, init, init_strides, seq, cu, dummy = _prepared(x, weight, bias, initial_state,
                                                         cu_seqlens)  # fmt: skip
    if out.numel():
        _conv[_grid(L, C, N)](
            x, w, b, init, out, x, dummy, dummy, dummy, dummy, seq, cu,
            L, C, W, *x.stride(), *init_strides, *out.stride(), 0, 0, 0,
            int(bias is not None), int(initial_state is not None), 0, int(cu_seqlens is not None),
            int(activation == "silu"), FORWARD, 1, TAPS=_taps(W), BL_=BL, BC_=BC, **LAUNCH,
        )  # fmt: skip
    if not output_final_state:
        return out, x.new_empty(0)
    dtype = x.dtype if initial_state is None else initial_state.dtype
    return out, conv_final_state(x, initial_state, W, cu_seqlens, dtype)


@serialised
def backward(g_out, g_final, x, weight, bias, activation, initial_state, output_final_state,
             cu_seqlens):  # fmt: skip
    N, C, L = x.shape
    W = weight.shape[1]
    w, b, init, init_strides, seq, cu, dummy = _prepared(x, weight, bias, initial_state,
                                                         cu_seqlens)  # fmt: skip
    grid = _grid(L, C, N, SPAN)
    programs = N * grid[0]
    f32 = {"dtype": torch.float32, "device": x.device}
    dpre = torch.empty((N, C, L), **f32)
    dw = torch.empty((programs, C, _taps(W)), **f32)  # every program writes its partial sums
    db = torch.empty((programs, C), **f32)
    dx = torch.empty_like(x)
    has_dfinal = output_final_state and g_final.numel() > 0
    dfinal = g_final.float().contiguous() if has_dfinal else dummy
    if x.numel():
        flags = (int(bias is not None), int(initial_state is not None), int(has_dfinal),
                 int(cu_seqlens is not None), int(activation == "silu"))  # fmt: skip
        _conv[grid](
            x, w, b, init, x, g_out, dpre, dw, db, dfinal, seq, cu,
            L, C, W, *x.stride(), *init_strides, 0, 0, 0, *g_out.stride(),
            *flags, GRAD, SPAN, TAPS=_taps(W), BL_=BL, BC_=BC, **LAUNCH,
        )  # fmt: skip
        _conv[_grid(L, C, N)](
            x, w, b, init, dx, g_out, dpre, dw, db, dfinal, seq, cu,
            L, C, W, *x.stride(), *init_strides, *dx.stride(), *g_out.stride(),
            *flags, DX, 1, TAPS=_taps(W), BL_=BL, BC_=BC, **LAUNCH,
        )  # fmt: skip
    dinit = None
    if initial_state is not None:
        reaching = g_final if has_dfinal else g_final.new_empty(0)
        dinit = conv_initial_state_grad(dpre, weight, reaching, cu_seqlens)
        dinit = dinit.to(initial_state.dtype)
    dweight = dw.sum(0)[:, :W].to(weight.dtype)
    dbias = None if bias is None else db.sum(0).to(bias.dtype)
    return dx, dweight, dbias, dinit
