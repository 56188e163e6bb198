"""The depthwise causal convolution in numba-cuda: a thread per output element.

A thread sums its element's ``W`` taps, reading the sequence's initial state (or zeros) where a
tap falls before the sequence's start. Threads run along the dimension x has contiguous (the
channels in the models' ``(N, L, C)`` layout passed as ``transpose(1, 2)``, else the
positions), so neighbouring threads read neighbouring elements. The backward:

1. ``dpre = dy act'(pre)`` per element (the pre-activation recomputed), float32;
2. the weight's and the bias's gradients, a thread per (row, channel, span of ``SPAN``
   positions) summing its span tap by tap into its own partial (the host adds the partials up
   in a fixed order: deterministic, no atomics);
3. ``dx_t = sum_j w_j dpre_{t + W - 1 - j}`` within the sequence, plus the final state's
   gradient for its last ``W - 1`` positions, per element.

The final state and the initial state's gradient (``W - 1`` positions per sequence) are
gathered on the device by :mod:`cakeops.helpers`.
"""

from __future__ import annotations

import math

import torch
from numba import cuda, float32

from cakeops.helpers import conv_final_state, conv_initial_state_grad
from cakeops_numba import SIMULATOR
from cakeops_numba._elements import sigmoid, store, widen
from cakeops_numba._launch import THREADS, blocks_for, on_stream, view

#: Positions per partial sum of the weight's gradient.
SPAN = 8 if SIMULATOR else 256


@cuda.jit(device=True)
def _element(i, C, L, rows):
    """Flat index ``i`` as ``(n, c, t)``: channels fastest when x has them contiguous."""
    if rows:
        return i // (L * C), i % C, (i // C) % L
    return i // (C * L), (i // L) % C, i % L


@cuda.jit(device=True)
def _place(seq_of, cu, n, t, L, packed):
    """``(sequence, position within it, its end)`` of position ``t`` of row ``n``."""
    if packed:
        seq = seq_of[t]
        return seq, t - cu[seq], cu[seq + 1]
    return n, t, L


@cuda.jit(device=True)
def _tap(x, init, n, c, t, seq, pos, j, W, has_init):
    """Tap ``j``'s input of output ``(n, c, t)``, float32."""
    rel = pos - (W - 1) + j
    if rel >= 0:
        return widen(x[n, c, t - (W - 1) + j])
    if has_init:
        return widen(init[seq, c, pos + j])
    return float32(0.0)


@cuda.jit(device=True)
def _pre(x, w, b, init, n, c, t, seq, pos, has_bias, has_init):
    W = w.shape[1]
    acc = widen(b[c]) if has_bias else float32(0.0)
    for j in range(W):
        acc += widen(w[c, j]) * _tap(x, init, n, c, t, seq, pos, j, W, has_init)
    return acc


@cuda.jit
def _forward(x, w, b, init, out, dy, dpre, seq_of, cu, has_bias, has_init, packed, silu, rows,
             grad):  # fmt: skip
    """The output; with ``grad``, ``dpre`` (float32) from the upstream gradient ``dy``."""
    N, C, L = x.shape
    for i in range(cuda.grid(1), N * C * L, cuda.gridsize(1)):
        n, c, t = _element(i, C, L, rows)
        seq, pos, _ = _place(seq_of, cu, n, t, L, packed)
        pre = _pre(x, w, b, init, n, c, t, seq, pos, has_bias, has_init)
        if grad:
            d = widen(dy[n, c, t])
            if silu:
                s = sigmoid(pre)
                d *= s * (float32(1.0) + pre * (float32(1.0) - s))
            dpre[n, c, t] = d
        elif silu:
            store(out, (n, c, t), pre * sigmoid(pre))
        else:
            store(out, (n, c, t), pre)


@cuda.jit
def _weight_sums(x, init, dpre, dw, db, seq_of, cu, has_init, packed, span):
    """Thread ``(n, span, c)``: its span's sums of ``dpre`` times each tap's input into
    ``dw[n * spans + span, c]``, and of ``dpre`` into ``db[n * spans + span, c]``."""
    N, C, L = x.shape
    W = dw.shape[2]
    spans = (L + span - 1) // span
    for i in range(cuda.grid(1), N * spans * C, cuda.gridsize(1)):
        c = i % C
        part = i // C
        n = part // spans
        first = (part % spans) * span
        last = min(first + span, L)
        total = float32(0.0)
        for t in range(first, last):
            total += dpre[n, c, t]
        db[part, c] = total
        for j in range(W):
            total = float32(0.0)
            for t in range(first, last):
                seq, pos, _ = _place(seq_of, cu, n, t, L, packed)
                total += dpre[n, c, t] * _tap(x, init, n, c, t, seq, pos, j, W, has_init)
            dw[part, c, j] = total


@cuda.jit
def _dx(dpre, w, dfinal, dx, seq_of, cu, has_dfinal, packed, rows):
    """``dx``: the windows reading each position within its sequence, and the final state's
    gradient for a sequence's last ``W - 1`` positions."""
    N, C, L = dpre.shape
    W = w.shape[1]
    for i in range(cuda.grid(1), N * C * L, cuda.gridsize(1)):
        n, c, t = _element(i, C, L, rows)
        seq, _, end = _place(seq_of, cu, n, t, L, packed)
        acc = float32(0.0)
        for j in range(W):
            u = t + (W - 1) - j
            if u < end:
                acc += widen(w[c, j]) * dpre[n, c, u]
        k = t - end + (W - 1)
        if has_dfinal and k >= 0:
            acc += widen(dfinal[seq, c, k])
        store(dx, (n, c, t), acc)


def _prepared(x, bias, initial_state, cu_seqlens):
    """Arrays for the absent arguments, each position's sequence when packed, and whether x has
    its channels contiguous."""
    dummy = torch.zeros(1, 1, 1, dtype=torch.float32, device=x.device)
    seq_of = cu = torch.zeros(2, dtype=torch.int64, device=x.device)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(torch.int64)
        t = torch.arange(x.shape[2], device=x.device)
        seq_of = torch.searchsorted(cu[1:], t, right=True)
    b = dummy[0, 0] if bias is None else bias
    init = dummy if initial_state is None else initial_state
    rows = x.shape[1] > 1 and x.stride(1) < x.stride(2)
    return view(b), view(init), view(seq_of), view(cu), rows


def _blocks(elements, device):
    return blocks_for(math.ceil(elements / THREADS), device)


def forward(x, weight, bias, activation, initial_state, output_final_state, cu_seqlens):
    out = torch.empty_like(x)
    if x.numel():
        b, init, seq_of, cu, rows = _prepared(x, bias, initial_state, cu_seqlens)
        xv = view(x)
        with on_stream(x.device) as stream:
            _forward[_blocks(x.numel(), x.device), THREADS, stream](
                xv, view(weight), b, init, view(out), xv, xv, seq_of, cu, bias is not None,
                initial_state is not None, cu_seqlens is not None, activation == "silu", rows,
                False,
            )  # fmt: skip
    if not output_final_state:
        return out, x.new_empty(0)
    dtype = x.dtype if initial_state is None else initial_state.dtype
    return out, conv_final_state(x, initial_state, weight.shape[1], cu_seqlens, dtype)


def backward(g_out, g_final, x, weight, bias, activation, initial_state, output_final_state,
             cu_seqlens):  # fmt: skip
    N, C, L = x.shape
    W = weight.shape[1]
    f32 = {"dtype": torch.float32, "device": x.device}
    spans = -(-L // SPAN)
    # every element, and every span's partial sums, is written by the kernels
    dpre = torch.empty((N, C, L), **f32)
    dw = torch.empty((N * spans, C, W), **f32)
    db = torch.empty((N * spans, C), **f32)
    dx = torch.empty_like(x)
    has_dfinal = output_final_state and g_final.numel() > 0
    if x.numel():
        b, init, seq_of, cu, rows = _prepared(x, bias, initial_state, cu_seqlens)
        xv, wv, dprev = view(x), view(weight), view(dpre)
        packed, has_init = cu_seqlens is not None, initial_state is not None
        with on_stream(x.device) as stream:
            _forward[_blocks(x.numel(), x.device), THREADS, stream](
                xv, wv, b, init, xv, view(g_out), dprev, seq_of, cu, bias is not None,
                has_init, packed, activation == "silu", rows, True,
            )  # fmt: skip
            _weight_sums[_blocks(N * spans * C, x.device), THREADS, stream](
                xv, init, dprev, view(dw), view(db), seq_of, cu, has_init, packed, SPAN
            )
            dfinal = view(g_final) if has_dfinal else dprev
            _dx[_blocks(x.numel(), x.device), THREADS, stream](
                dprev, wv, dfinal, view(dx), seq_of, cu, has_dfinal, packed, rows
            )
    dinit = None
    if initial_state is not None:
        reaching = g_final if has_dfinal else g_final.new_empty(0)
        dinit = conv_initial_state_grad(dpre, weight, reaching, cu_seqlens)
        dinit = dinit.to(initial_state.dtype)
    return dx, dw.sum(0).to(weight.dtype), None if bias is None else db.sum(0).to(bias.dtype), dinit
