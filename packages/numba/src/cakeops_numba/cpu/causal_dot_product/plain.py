"""Plain causal linear attention on the CPU (no options): one float32 ``E x M`` state per
head, four positions per pass over it (a rank-4 update and read in registers,
:func:`_forward_head`); the backward as the forward's scan on ``(g, v, k)`` for ``dq`` and a
reverse-time scan for ``dk``, ``dv`` (:func:`_reverse_head`). Contiguous float32 and bfloat16
(as ``int16`` bits, widened as they load and rounded to nearest even as they store:
:func:`_widen`, :func:`_store`) are used in place; other inputs are converted a block of heads
at a time (at most ``BLOCK_ELEMENTS`` a copy)."""

from __future__ import annotations

import numpy as np
import torch
from numba import prange, types
from numba.core.extending import overload

from cakeops_numba.cpu._njit import array_at, launching, view_of
from cakeops_numba.cpu._njit import compiled as _compiled
from cakeops_numba.cpu._njit import float_as_int as _float_as_int
from cakeops_numba.cpu._njit import int_as_float as _int_as_float

BLOCK_ELEMENTS = 1 << 21  # per converted float32 block of one tensor


def _widen(v):  # compiled through the overload below
    raise NotImplementedError("_widen runs inside the njit kernels only")


def _store(arr, h, i, j, v):  # compiled through the overload below
    raise NotImplementedError("_store runs inside the njit kernels only")


@overload(_widen)
def _widen_impl(v):
    if isinstance(v, types.Integer):  # the bits of a bfloat16
        return lambda v: _int_as_float((np.int32(v) & 0xFFFF) << 16)
    return lambda v: np.float32(v)


@overload(_store)
def _store_impl(arr, h, i, j, v):
    if isinstance(arr.dtype, types.Integer):  # a bfloat16 array: round to nearest even

        def impl(arr, h, i, j, v):
            bits = _float_as_int(np.float32(v))
            top = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            if v != v:
                top = (bits >> 16) | 0x40
            arr[h, i, j] = top

        return impl

    def impl(arr, h, i, j, v):
        arr[h, i, j] = v

    return impl


@_compiled(parallel=False)
def _forward_head(q, k, v, out, h):  # pragma: no cover - compiled
    """Head ``h`` of ``out_i = sum_{j<=i} (q_i . k_j) v_j``, four positions per pass over the
    state.

    The state is kept transposed, ``St[m, e] = sum_j v_j[m] k_j[e]``, so a position's output
    element is a reduction along a contiguous row: each row of the state is loaded and stored
    once per four positions, and the four partial sums stay in registers.
    """
    L, E = q.shape[1], q.shape[2]
    M = v.shape[2]
    St = np.zeros((M, E), np.float32)
    kb = np.empty((4, E), np.float32)
    qb = np.empty((4, E), np.float32)
    vb = np.empty((4, M), np.float32)
    for start in range(0, L, 4):
        n = min(4, L - start)
        for t in range(n):
            for e in range(E):
                kb[t, e] = _widen(k[h, start + t, e])
                qb[t, e] = _widen(q[h, start + t, e])
            for m in range(M):
                vb[t, m] = _widen(v[h, start + t, m])
        if n == 4:
            for m in range(M):
                v0, v1, v2, v3 = vb[0, m], vb[1, m], vb[2, m], vb[3, m]
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for e in range(E):
                    s = St[m, e] + v0 * kb[0, e]
                    a0 += qb[0, e] * s
                    s += v1 * kb[1, e]
                    a1 += qb[1, e] * s
                    s += v2 * kb[2, e]
                    a2 += qb[2, e] * s
                    s += v3 * kb[3, e]
                    a3 += qb[3, e] * s
                    St[m, e] = s
                _store(out, h, start, m, a0)
                _store(out, h, start + 1, m, a1)
                _store(out, h, start + 2, m, a2)
                _store(out, h, start + 3, m, a3)
        else:
            for t in range(n):
                for m in range(M):
                    vm = vb[t, m]
                    acc = np.float32(0.0)
                    for e in range(E):
                        s = St[m, e] + vm * kb[t, e]
                        acc += qb[t, e] * s
                        St[m, e] = s
                    _store(out, h, start + t, m, acc)


@_compiled(parallel=False)
def _reverse_head(g, q, k, v, dk, dv, h):  # pragma: no cover - compiled
    """Head ``h`` of the reverse-time scan: ``dk_j = R_j v_j``, ``dv_j = R_j^T k_j`` with
    ``R_j = sum_{i>=j} q_i g_i^T``, four positions per pass over the state.

    Each row ``R[e]`` is loaded and stored once per four positions and updated in registers in
    between; the four ``dk`` elements are sums along the row, the four ``dv`` rows accumulate
    in a small buffer that stays in L1 and is stored once per pass.
    """
    L, E = q.shape[1], q.shape[2]
    M = v.shape[2]
    R = np.zeros((E, M), np.float32)
    qb = np.empty((4, E), np.float32)
    kb = np.empty((4, E), np.float32)
    gb = np.empty((4, M), np.float32)
    vb = np.empty((4, M), np.float32)
    dvb = np.empty((4, M), np.float32)
    for start in range(0, L, 4):
        n = min(4, L - start)
        last = L - 1 - start  # the pass takes positions last, last - 1, ... (t = 0, 1, ...)
        for t in range(n):
            for e in range(E):
                qb[t, e] = _widen(q[h, last - t, e])
                kb[t, e] = _widen(k[h, last - t, e])
            for m in range(M):
                gb[t, m] = _widen(g[h, last - t, m])
                vb[t, m] = _widen(v[h, last - t, m])
                dvb[t, m] = 0.0
        if n == 4:
            for e in range(E):
                q0, q1, q2, q3 = qb[0, e], qb[1, e], qb[2, e], qb[3, e]
                k0, k1, k2, k3 = kb[0, e], kb[1, e], kb[2, e], kb[3, e]
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for m in range(M):
                    r = R[e, m] + q0 * gb[0, m]
                    a0 += r * vb[0, m]
                    dvb[0, m] += r * k0
                    r += q1 * gb[1, m]
                    a1 += r * vb[1, m]
                    dvb[1, m] += r * k1
                    r += q2 * gb[2, m]
                    a2 += r * vb[2, m]
                    dvb[2, m] += r * k2
                    r += q3 * gb[3, m]
                    a3 += r * vb[3, m]
                    dvb[3, m] += r * k3
                    R[e, m] = r
                _store(dk, h, last, e, a0)
                _store(dk, h, last - 1, e, a1)
                _store(dk, h, last - 2, e, a2)
                _store(dk, h, last - 3, e, a3)
        else:
            for t in range(n):
                for e in range(E):
                    qe, ke = qb[t, e], kb[t, e]
                    acc = np.float32(0.0)
                    for m in range(M):
                        r = R[e, m] + qe * gb[t, m]
                        acc += r * vb[t, m]
                        dvb[t, m] += r * ke
                        R[e, m] = r
                    _store(dk, h, last - t, e, acc)
        for t in range(n):
            for m in range(M):
                _store(dv, h, last - t, m, dvb[t, m])


@_compiled(parallel=True)
def _forward(q, k, v, out):  # pragma: no cover - compiled
    for h in prange(q.shape[0]):
        _forward_head(q, k, v, out, h)


@_compiled(parallel=True)
def _backward(g, q, k, v, dq, dk, dv):  # pragma: no cover - compiled
    """Both scans of a head on one thread, one after the other: the reverse scan reads ``g``,
    ``k`` and ``v`` while the forward scan has left them in cache, and one launch serves the
    backward."""
    for h in prange(q.shape[0]):
        # dq_i = sum_{j<=i} (g_i . v_j) k_j: the forward scan with (g, v, k) as (q, k, v)
        _forward_head(g, v, k, dq, h)
        _reverse_head(g, q, k, v, dk, dv, h)


#: Dtypes the kernels read and write in place (bfloat16 as the int16 view of its bits).
_IN_PLACE = (torch.float32, torch.bfloat16)


def _in_place(t: torch.Tensor, ours: bool = False) -> np.ndarray:
    """``(heads, L, d)`` numpy view of a contiguous float32 or bfloat16 ``(n, h, L, d)`` tensor,
    sharing its memory (bfloat16 as ``int16`` bits); ``ours``: an output the op allocated."""
    bits = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    view = bits.view(-1, *t.shape[-2:])
    return view.numpy() if ours else array_at(view)


def _as_float32(t: torch.Tensor) -> np.ndarray:
    """A float32 C-contiguous ``(heads, L, d)`` numpy view of a ``(n, h, L, d)`` block (a copy
    only when needed)."""
    return view_of(t.float().contiguous().view(-1, *t.shape[-2:]), t)


def _blocks(N: int, H: int, heads: int):
    """Index tuples of ``(N, H, ...)`` blocks of at most ``heads`` heads each: whole batch rows
    when a row of H heads fits, else heads of one batch row (either way a contiguous part of a
    fresh output)."""
    if heads >= H:
        step = heads // H
        for n in range(0, N, step):
            yield (slice(n, n + step),)
    else:
        for n in range(N):
            for h in range(0, H, heads):
                yield (slice(n, n + 1), slice(h, h + heads))


def _run(kernel, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]) -> None:
    """``kernel(*inputs, *outputs)`` on ``(heads, L, d)`` views of ``(N, H, L, d)`` tensors
    (outputs fresh and contiguous): all heads at once, in place, when every tensor is contiguous
    float32 or bfloat16; else blocks of heads whose float32 copies hold at most
    ``BLOCK_ELEMENTS`` each."""
    N, H, L = inputs[0].shape[:3]
    if N * H * L == 0:
        return
    tensors = (*inputs, *outputs)
    in_place = all(t.dtype in _IN_PLACE and t.is_contiguous() for t in tensors)
    widest = max(t.shape[-1] for t in tensors)
    with launching():
        if in_place:
            kernel(*(_in_place(t) for t in inputs), *(_in_place(t, ours=True) for t in outputs))
            return
        heads = max(1, BLOCK_ELEMENTS // max(1, L * widest))
        for block in _blocks(N, H, heads):
            results = [_as_float32(t[block]) for t in outputs]  # views of float32 outputs
            kernel(*(_as_float32(t[block]) for t in inputs), *results)
            for t, r in zip(outputs, results, strict=True):
                if t.dtype != torch.float32:
                    t[block].copy_(torch.from_numpy(r).view(t[block].shape))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    N, H, L, _ = q.shape
    out = torch.empty((N, H, L, v.shape[-1]), dtype=q.dtype, device=q.device)
    _run(_forward, (q, k, v), (out,))
    return out


def backward(
    g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    _run(_backward, (g, q, k, v), (dq, dk, dv))
    return dq, dk, dv
