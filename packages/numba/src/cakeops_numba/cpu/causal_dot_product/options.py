"""Causal linear attention on the CPU with the options: log multipliers (decay, gates),
initial and final states, packed sequences, key heads shared by groups of value heads. Four
positions per pass as in :mod:`.plain`, the multipliers applied relative to the pass's first
position; the backward also sums the log multipliers' gradients."""

from __future__ import annotations

import numpy as np
import torch
from numba import prange

from cakeops_numba.cpu._njit import F32 as _F32
from cakeops_numba.cpu._njit import as_float32, launching, view_of
from cakeops_numba.cpu._njit import compiled as _compiled

# --------------------------------------------------------------------------------------------
# The options: log multipliers (decay, gates), initial and final states, packed sequences.
# Four positions per pass as above, the multipliers applied relative to the pass's first
# position: a pass's outputs are ``exp(B_t) (c_t . X)`` from the state it starts from plus
# ``exp(B_t - B_j) (c_t . a_j) b_j`` within it, and the state moves on as ``exp(B_3) X +
# sum_j exp(B_3 - B_j) a_j b_j^T`` (``B`` the multipliers' running sum within the pass: every
# factor is <= 1). A short pass is padded with zero rows and zero log multipliers.


@_compiled(parallel=False)
def _pass_decays(lf, D):  # pragma: no cover - compiled
    """``D[t, j] = exp(lf[j+1] + ... + lf[t])`` for ``j <= t`` (1 on the diagonal): products of
    the steps' factors, each ``<= 1``, so nothing overflows (four ``exp`` a pass, not ten)."""
    for t in range(lf.shape[0]):
        D[t, t] = 1.0
        f = np.exp(lf[t])
        for j in range(t):
            D[t, j] = D[t - 1, j] * f


@_compiled(parallel=False)
def _carried(lf):  # pragma: no cover - compiled
    """``(kept, change)`` with ``kept + change`` the pass's factor ``exp(B_3)`` on the state it
    carries on, applied as ``kept X + change X``. Near 1 (almost no decay) ``(1, exp(B_3) -
    1)``: a float32 ``exp(B_3)`` is off by up to half an ulp of 1, the same error every pass of
    a constant decay, which compounds over a long sequence (3e-5 at 4096 steps of
    ``exp(-1e-4)``); ``expm1`` keeps the small difference from 1 to full precision. Below 1/2
    ``(0, exp(B_3))``: there ``1 + (exp(B_3) - 1)`` would lose the factor to rounding (a
    factor of ``exp(-66)`` on a state of ``1e30`` left 0 where the state is 22). ``(0, 0)``
    for a factor of 0 (a reset)."""
    total = np.float64(lf[1] + lf[2] + lf[3] + lf[4])
    if total > -0.6931471805599453:
        return np.float32(1.0), np.float32(np.expm1(total))
    return np.float32(0.0), np.float32(np.exp(total))


#: positions between the dq scan's kept states (a multiple of the passes' 4): the reverse scan
#: recomputes the states before its passes a segment at a time from them
SEGMENT = 64


@_compiled(parallel=False)
def _scan_with_logs(c, ch, a, ah, b, bh, lm, h, start, end, state, y, yh, scale, marks,
                    add):  # pragma: no cover - compiled  # fmt: skip
    """``X_t = exp(lm_t) X_{t-1} + a_t b_t^T`` and ``y_t = scale X_t^T c_t`` over positions
    ``start..end-1`` (``c``, ``a``: ``(heads, L, P)``; ``b``, ``y``: ``(heads, L, Q)``; rows
    ``ch``, ``ah``, ``bh``, ``yh`` of them, ``h`` of ``lm``; ``y_t`` added to ``y`` with
    ``add``), from the state ``X``, kept transposed in ``state`` ``(Q, P)`` as in
    :func:`_forward_head` and left at ``X_end``: the forward with ``(q, k, v)`` (``S^T``),
    ``dq`` with ``(g, v, k)`` (``S``). With ``marks`` not empty, ``marks[s]`` is left holding
    the state before position ``start + s * SEGMENT`` (for :func:`_reverse_with_logs`)."""
    Q, P = state.shape
    XT = state.copy()  # a local array: the compiler knows nothing else writes it
    cb = np.zeros((4, P), np.float32)
    aw = np.zeros((4, P), np.float32)  # a_j weighted by exp(B_3 - B_j)
    bb = np.zeros((4, Q), np.float32)
    acc = np.empty((4, Q), np.float32)
    lf = np.zeros(5, np.float32)  # lf[0]: the factor into the pass, lf[1 + t]: into step t
    D = np.zeros((5, 5), np.float32)
    W = np.zeros((4, 4), np.float32)
    for s0 in range(start, end, 4):
        n = min(4, end - s0)
        if marks.shape[0] and (s0 - start) % SEGMENT == 0:
            mark = marks[(s0 - start) // SEGMENT]
            for j in range(Q):
                for p in range(P):
                    mark[j, p] = XT[j, p]
        # element loops: numba's slice assignments cost more than the pass's arithmetic here
        for t in range(4):
            live = t < n
            lf[t + 1] = lm[h, s0 + t] if live else np.float32(0.0)
            if live:
                for p in range(P):
                    cb[t, p] = c[ch, s0 + t, p]
                    aw[t, p] = a[ah, s0 + t, p]
                for j in range(Q):
                    bb[t, j] = b[bh, s0 + t, j]
            else:
                for p in range(P):
                    cb[t, p] = 0.0
                    aw[t, p] = 0.0
                for j in range(Q):
                    bb[t, j] = 0.0
        # D[1 + t, 0] = exp(B_t) (the state into step t), D[1 + t, 1 + j] = exp(B_t - B_j)
        _pass_decays(lf, D)
        for t in range(4):
            for j in range(t + 1):
                dot = np.float32(0.0)
                for p in range(P):
                    dot += cb[t, p] * aw[j, p]
                W[t, j] = D[1 + t, 1 + j] * dot
        for t in range(3):
            w = D[4, 1 + t]
            for p in range(P):
                aw[t, p] = w * aw[t, p]
        f0, f1, f2, f3 = D[1, 0], D[2, 0], D[3, 0], D[4, 0]
        kept, c3 = _carried(lf)
        w00, w10, w11, w20, w21, w22 = W[0, 0], W[1, 0], W[1, 1], W[2, 0], W[2, 1], W[2, 2]
        w30, w31, w32, w33 = W[3, 0], W[3, 1], W[3, 2], W[3, 3]
        for j in range(Q):
            b0, b1, b2, b3 = bb[0, j], bb[1, j], bb[2, j], bb[3, j]
            s_0 = s_1 = s_2 = s_3 = np.float32(0.0)
            for p in range(P):
                x = XT[j, p]
                s_0 += cb[0, p] * x
                s_1 += cb[1, p] * x
                s_2 += cb[2, p] * x
                s_3 += cb[3, p] * x
                added = aw[0, p] * b0 + aw[1, p] * b1 + aw[2, p] * b2 + aw[3, p] * b3
                XT[j, p] = kept * x + c3 * x + added
            # the pass's own positions: only i <= t (a masked zero times a NaN would leak it)
            acc[0, j] = f0 * s_0 + w00 * b0
            acc[1, j] = f1 * s_1 + w10 * b0 + w11 * b1
            acc[2, j] = f2 * s_2 + w20 * b0 + w21 * b1 + w22 * b2
            acc[3, j] = f3 * s_3 + w30 * b0 + w31 * b1 + w32 * b2 + w33 * b3
        for t in range(n):
            for j in range(Q):
                if add:
                    y[yh, s0 + t, j] += scale * acc[t, j]
                else:
                    y[yh, s0 + t, j] = scale * acc[t, j]
    state[:, :] = XT


@_compiled(parallel=False)
def _pass_states(k, kh, v, lm, h, s0, end, S, out):  # pragma: no cover - compiled
    """``out[p]`` = the state before position ``s0 + 4p`` (``S_{s0 + 4p - 1}``), for the passes
    of the segment from ``s0`` (``S``: the state before ``s0``, ``(E, M)``) up to ``end`` (row
    ``kh`` of ``k``, ``h`` of the others)."""
    E, M = S.shape
    X = S.copy()
    row = np.empty(M, np.float32)
    for p in range(out.shape[0]):
        p0 = s0 + 4 * p
        if p0 >= end:
            break
        for e in range(E):
            for m in range(M):
                out[p, e, m] = X[e, m]
        for t in range(p0, min(p0 + 4, end)):
            f = np.exp(lm[h, t])
            for m in range(M):
                row[m] = v[h, t, m]
            for e in range(E):
                ke = k[kh, t, e]
                for m in range(M):
                    X[e, m] = f * X[e, m] + ke * row[m]


@_compiled(parallel=False)
def _reverse_with_logs(q, g, k, v, lm, h, kh, dkh, start, end, grad, dk, dv, dlm,
                       marks):  # pragma: no cover - compiled  # fmt: skip
    """The reverse-time scan with log multipliers over positions ``start..end-1`` of value head
    ``h`` (row ``kh`` of ``q`` and ``k``; ``dk_t`` added to row ``dkh`` of ``dk``):
    ``R_t = exp(lm_{t+1}) R_{t+1} + q_t g_t^T`` from ``grad`` (the final state's gradient,
    with the scale in ``g``), ``dk_t = R_t v_t``, ``dv_t = R_t^T k_t``; leaves ``R_start`` in
    ``grad``. The passes take the four positions ``p0..p0+3`` the forward's passes take
    (aligned to ``start``, the short one last in time).

    ``dlm[h, t] = exp(lm_t) <R_t, S_{t-1}>``, the log multiplier's gradient, as the sum of the
    pair terms that cross ``t``: with ``S`` the state before the pass (recomputed a segment of
    ``SEGMENT`` positions at a time from ``marks``, the dq scan's states) and ``R`` the gradient
    after it, ``<R_t, S_{t-1}>`` is ``<R, S>``, ``k_j . (R v_j)`` of the pass's positions
    before ``t``, ``q_i . (S g_i)`` of those from ``t`` on, and the pass's own pairs across
    ``t``, each with the factors between (never a difference that cancels)."""
    E, M = grad.shape
    R = grad.copy()  # a local array: the compiler knows nothing else writes it
    qb = np.zeros((4, E), np.float32)
    kb = np.zeros((4, E), np.float32)
    gb = np.zeros((4, M), np.float32)
    vb = np.zeros((4, M), np.float32)
    yk = np.empty((4, E), np.float32)
    zv = np.empty((4, M), np.float32)
    lf = np.zeros(5, np.float32)
    D = np.zeros((5, 5), np.float32)
    GV = np.zeros((4, 4), np.float32)
    QK = np.zeros((4, 4), np.float32)
    PAIR = np.zeros((4, 4), np.float32)  # [i, j]: (q_j . k_i)(g_j . v_i), no factor
    alpha = np.zeros(4, np.float32)
    beta = np.zeros(4, np.float32)
    states = np.empty((SEGMENT // 4, E, M), np.float32)
    loaded = -1
    s1 = end
    while s1 > start:  # the pass takes positions s1 - 1, s1 - 2, ... (step i)
        n = (s1 - start - 1) % 4 + 1
        p0 = s1 - n
        segment = (p0 - start) // SEGMENT
        if segment != loaded:
            _pass_states(k, kh, v, lm, h, start + segment * SEGMENT, end, marks[segment], states)
            loaded = segment
        S = states[((p0 - start) % SEGMENT) // 4]
        for i in range(4):  # element loops, as in _scan_with_logs
            t = s1 - 1 - i
            live = i < n
            lf[i + 1] = lm[h, t + 1] if live and t + 1 < end else np.float32(0.0)
            if live:
                for e in range(E):
                    qb[i, e] = q[kh, t, e]
                    kb[i, e] = k[kh, t, e]
                for m in range(M):
                    gb[i, m] = g[h, t, m]
                    vb[i, m] = v[h, t, m]
                    zv[i, m] = 0.0
            else:
                for e in range(E):
                    qb[i, e] = 0.0
                    kb[i, e] = 0.0
                for m in range(M):
                    gb[i, m] = 0.0
                    vb[i, m] = 0.0
                    zv[i, m] = 0.0
        _pass_decays(lf, D)
        for i in range(4):
            for j in range(i + 1):
                gv = np.float32(0.0)
                for m in range(M):
                    gv += gb[j, m] * vb[i, m]
                qk = np.float32(0.0)
                for e in range(E):
                    qk += qb[j, e] * kb[i, e]
                decay = D[1 + i, 1 + j]
                GV[i, j] = decay * gv
                QK[i, j] = decay * qk
                PAIR[i, j] = qk * gv
        kept, c3 = _carried(lf)
        w0, w1, w2 = D[4, 1], D[4, 2], D[4, 3]
        across = np.float32(0.0)
        for i in range(4):
            alpha[i] = 0.0
            beta[i] = 0.0
        for e in range(E):
            k0, k1, k2, k3 = kb[0, e], kb[1, e], kb[2, e], kb[3, e]
            a0, a1, a2, a3 = w0 * qb[0, e], w1 * qb[1, e], w2 * qb[2, e], qb[3, e]
            y0 = y1 = y2 = y3 = np.float32(0.0)
            u0 = u1 = u2 = u3 = np.float32(0.0)
            for m in range(M):
                r = R[e, m]
                x = S[e, m]
                across += r * x
                u0 += x * gb[0, m]
                u1 += x * gb[1, m]
                u2 += x * gb[2, m]
                u3 += x * gb[3, m]
                y0 += r * vb[0, m]
                y1 += r * vb[1, m]
                y2 += r * vb[2, m]
                y3 += r * vb[3, m]
                zv[0, m] += k0 * r
                zv[1, m] += k1 * r
                zv[2, m] += k2 * r
                zv[3, m] += k3 * r
                added = a0 * gb[0, m] + a1 * gb[1, m] + a2 * gb[2, m] + a3 * gb[3, m]
                R[e, m] = kept * r + c3 * r + added
            yk[0, e], yk[1, e], yk[2, e], yk[3, e] = y0, y1, y2, y3
            alpha[0] += qb[0, e] * u0
            alpha[1] += qb[1, e] * u1
            alpha[2] += qb[2, e] * u2
            alpha[3] += qb[3, e] * u3
            beta[0] += k0 * y0
            beta[1] += k1 * y1
            beta[2] += k2 * y2
            beta[3] += k3 * y3
        first = np.exp(lm[h, p0])  # the factor into the pass's first position
        for i in range(n):
            t = s1 - 1 - i
            # R_t = fi R + sum_{j <= i} D[1+i, 1+j] q_j g_j^T; S_{t-1} = ei S + sum_{j > i}
            # D[j+1, i+2] k_j v_j^T (positions j before t in time)
            fi = D[1 + i, 0]
            ei = np.float32(1.0) if i == n - 1 else first * D[n, i + 2]
            total = fi * ei * across
            for j in range(i + 1, n):
                total += fi * D[j + 1, i + 2] * beta[j]
            for j in range(i + 1):
                total += ei * D[1 + i, 1 + j] * alpha[j]
                for jj in range(i + 1, n):
                    total += D[1 + i, 1 + j] * D[jj + 1, i + 2] * PAIR[jj, j]
            dlm[h, t] = np.exp(lm[h, t]) * total
            for e in range(E):
                yk[i, e] *= fi
            for m in range(M):
                zv[i, m] *= fi
            for j in range(i + 1):
                wk, wv = GV[i, j], QK[i, j]
                for e in range(E):
                    yk[i, e] += wk * qb[j, e]
                for m in range(M):
                    zv[i, m] += wv * gb[j, m]
            for e in range(E):
                dk[dkh, t, e] += yk[i, e]
            for m in range(M):
                dv[h, t, m] = zv[i, m]
        s1 = p0
    grad[:, :] = R


@_compiled(parallel=True)
def _forward_options(q, k, v, lm, cu, H, G, states, out, scale):  # pragma: no cover - compiled
    """Every (value head, sequence) on its own thread: ``states[task]`` ``(E, M)`` holds the
    initial state and is left holding the final one (task = (row * sequences + s) * H + h);
    value head ``h`` reads key head ``h // G`` of q and k."""
    S = cu.shape[0] - 1
    heads = v.shape[0]
    for task in prange(heads * S):
        nh, s = task // S, task % S
        kh = (nh // H) * (H // G) + (nh % H) // G
        X = states[((nh // H) * S + s) * H + nh % H]
        none = np.empty((0, 1, 1), np.float32)  # no states kept
        _scan_with_logs(q, kh, k, kh, v, nh, lm, nh, cu[s], cu[s + 1], X, out, nh, scale, none,
                        False)  # fmt: skip


@_compiled(parallel=True)
def _backward_options(g, q, k, v, lm, cu, H, G, P, states, grads, dq, dk, dv,
                      dlm):  # pragma: no cover - compiled  # fmt: skip
    """``dq`` forward in time (``states``: the initial states in, the final ones out; every
    ``SEGMENT``-th state kept), then ``dk``, ``dv`` and the log multipliers' gradient ``dlm``
    in reverse (``grads``: the final states' gradients in, those reaching each sequence's
    start out, before its first multiplier). A task is (key head row, slab ``p`` of ``P``,
    sequence): the value heads ``p, p + P, ...`` of the key head's group of ``G``, one after
    another, adding their dq and dk to the slab's rows (``dq``, ``dk``: ``(P * key rows, L,
    E)``, zeros in; summed over the slabs after). Every sum in a fixed order: deterministic."""
    S = cu.shape[0] - 1
    keys = q.shape[0]
    Hk = H // G
    E, M = states.shape[1], states.shape[2]
    for task in prange(keys * P * S):
        s, p, kh = task % S, (task // S) % P, task // (S * P)
        n = kh // Hk
        row = p * keys + kh
        start, end = cu[s], cu[s + 1]
        marks = np.empty(((end - start + SEGMENT - 1) // SEGMENT, E, M), np.float32)
        for j in range(p, G, P):
            h = (kh % Hk) * G + j
            nh = n * H + h
            i = (n * S + s) * H + h
            _scan_with_logs(g, nh, v, nh, k, kh, lm, nh, start, end, states[i], dq, row,
                            np.float32(1.0), marks, True)  # fmt: skip
            _reverse_with_logs(q, g, k, v, lm, nh, kh, row, start, end, grads[i], dk, dv, dlm,
                               marks)  # fmt: skip


#: Problems smaller than this (positions x E x M: a decoding step) run on one thread: waking
#: numba's threads would cost more than the work.
SERIAL_BELOW = 1 << 16
#: Tasks the backward gives numba's threads at least, where value heads share key heads: a
#: group's heads are split into as many slabs as that takes (each a dq and dk of the key heads'
#: size), so one key head for 32 value heads (Mamba2) neither runs on one thread nor keeps 32
#: per-head copies of dq and dk.
GROUP_TASKS = 16


def _heads(t: torch.Tensor) -> np.ndarray:
    """A float32 ``(heads, L, d)`` numpy view of ``(n, h, L, d)`` with unit stride along ``d``:
    the tensor itself where its strides allow (a transposed view, or heads sharing one tensor
    through a stride of 0 as Mamba2's B and C do: no copy per head), else a contiguous copy. The
    kernels read each position's row into a local buffer before their loops."""
    f = t.float()
    if f.stride(-1) == 1:
        try:
            return view_of(f.view(-1, *f.shape[-2:]), t)
        except RuntimeError:  # rows and heads not one stride apart
            pass
    return f.contiguous().view(-1, *f.shape[-2:]).numpy()


def _launch(kernel, work: int, *args, serial_below: int = SERIAL_BELOW) -> None:
    """``kernel`` on numba's threads, or one of them below ``serial_below`` units of ``work``."""
    with launching(serial=work < serial_below):
        kernel(*args)


def _layout(q, v, lm, cu_seqlens):
    """The kernels' log multipliers ``(value heads, L)`` float32 (zeros without any) and
    offsets."""
    N, H, L = v.shape[:3]
    lm = torch.zeros((N, H, L), **_F32) if lm is None else as_float32(lm)
    cu = torch.tensor([0, L], device=_F32["device"]) if cu_seqlens is None else cu_seqlens.long()
    return lm.view(N * H, L), cu


def _scratch(x, tasks: int, shape=None, transpose: bool = False) -> torch.Tensor:
    """A float32 contiguous copy of the states ``x`` as ``(tasks, E, M)`` (``(tasks, M, E)``
    with ``transpose``), which the kernels overwrite; zeros of ``shape`` when None."""
    if x is None:
        E, M = shape
        return torch.zeros((tasks, M, E) if transpose else (tasks, E, M), **_F32)
    x = x.float().reshape(tasks, *x.shape[-2:])
    x = x.transpose(-1, -2) if transpose else x
    return x.clone(memory_format=torch.contiguous_format)


def forward_options(q, k, v, lm, initial_state, cu_seqlens, scale):
    """``(out, final states float32)`` with the options (``lm``: the summed log multipliers
    ``(N, H, L)`` or None)."""
    N, Hk, L, E = q.shape
    H, M = v.shape[1], v.shape[-1]
    lm, cu = _layout(q, v, lm, cu_seqlens)
    S = cu.numel() - 1
    # transposed: the kernel's XT = S^T (a final state handed back is laid out so already)
    states = _scratch(initial_state, N * S * H, (E, M), transpose=True)
    out = torch.empty((N, H, L, M), **_F32)
    if N * H * L:
        s = np.float32(1.0 if scale is None else scale)
        _launch(_forward_options, N * H * L * E * M, _heads(q), _heads(k), _heads(v), lm.numpy(),
                cu.numpy(), H, H // Hk,
                states.numpy(), out.view(N * H, L, M).numpy(), s)  # fmt: skip
    return out.to(q.dtype), states.view(N * S, H, M, E).transpose(-1, -2)


def backward_options(g, g_final, q, k, v, lm, initial_state, cu_seqlens):
    """``(dq, dk, dv float32, gradient reaching each initial state, the log multipliers'
    gradient per position)`` with the options; ``g`` carries the scale,
    ``g_final`` None for none."""
    N, Hk, L, E = q.shape
    H, M = v.shape[1], v.shape[-1]
    G = H // Hk
    lm, cu = _layout(q, v, lm, cu_seqlens)
    S = cu.numel() - 1
    states = _scratch(initial_state, N * S * H, (E, M))  # the dq run's XT = S
    grads = _scratch(g_final, N * S * H, (E, M))  # R_T
    # a group's value heads add their dq, dk to P slabs, P only as large as the threads need
    P = min(G, max(1, -(-GROUP_TASKS // (N * Hk * S))))
    dqs, dks = torch.zeros((P, N, Hk, L, E), **_F32), torch.zeros((P, N, Hk, L, E), **_F32)
    dv = torch.empty((N, H, L, M), **_F32)
    dlm = torch.zeros((N, H, L), **_F32)
    if N * H * L:
        outs = (t.view(-1, L, t.shape[-1]).numpy() for t in (dqs, dks, dv))
        _launch(_backward_options, N * H * L * E * M, *(_heads(t) for t in (g, q, k, v)),
                lm.numpy(), cu.numpy(), H, G, P, states.numpy(), grads.numpy(), *outs,
                dlm.view(N * H, L).numpy())  # fmt: skip
    dq, dk = dqs[0], dks[0]
    for p in range(1, P):  # in a fixed order
        dq.add_(dqs[p])
        dk.add_(dks[p])
    # the gradient reaching S_0 is exp(lm_first) R_first (R_first itself for an empty sequence)
    first = torch.zeros((N, S, H), **_F32)
    if L:
        starts = cu[:-1].clamp(max=L - 1)
        lead = lm.view(N, H, L)[:, :, starts].transpose(1, 2)  # (N, S, H)
        first = torch.where((cu[1:] > cu[:-1])[None, :, None], lead, 0.0)
    d_init = grads.view(N * S, H, E, M) * torch.exp(first).view(N * S, H, 1, 1)
    return dq, dk, dv, d_init, dlm
