"""Causal linear attention on the CPU: one float32 ``E x M`` state per head, updated step by step.

``prange`` runs the heads in parallel; each head walks its positions in order with a state small
enough to stay in cache (16 KiB at E = M = 64), so there is no chunk score matrix and no BLAS
call per chunk: 4EM flops per position forward, 10EM backward, against the chunked form's
``2C(E + M) + 4EM``. The backward is two scans: the forward kernel on ``(g, v, k)`` gives
``dq`` (``dq_i = sum_{j<=i} (g_i . v_j) k_j``), a reverse-time scan ``dk_j = R_j v_j`` and
``dv_j = R_j^T k_j`` with ``R_j = sum_{i>=j} q_i g_i^T``. Every sum runs in a fixed order:
deterministic.

The kernels take float32 ``(heads, L, E)`` blocks: float32 contiguous inputs as they are, others
(float16, bfloat16, strided) converted a block of heads at a time, so the float32 copies stay
bounded.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch
from numba import njit, prange

# Reassociation lets the inner loops vectorise; no "nnan"/"ninf", so NaN and inf propagate.
FASTMATH = {"reassoc", "contract", "arcp"}
BLOCK_ELEMENTS = 1 << 21  # per converted float32 block of one tensor
# numba's "workqueue" threading layer (used when neither OpenMP nor TBB is found) aborts on
# concurrent launches from two Python threads: launches take turns.
_LAUNCH = threading.Lock()


def _compiled(fn):
    """``fn`` compiled on first use, cached on disk (in ``__pycache__`` or numba's user cache
    directory) so later processes skip the seconds of compiling; without a writable cache
    location, compiled once per process."""
    try:
        return njit(parallel=True, fastmath=FASTMATH, cache=True)(fn)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return njit(parallel=True, fastmath=FASTMATH)(fn)


@_compiled
def _forward(q, k, v, out):  # pragma: no cover - compiled
    heads, L, E = q.shape
    M = v.shape[2]
    for h in prange(heads):
        S = np.zeros((E, M), np.float32)
        for i in range(L):
            for e in range(E):
                ke = k[h, i, e]
                for m in range(M):
                    S[e, m] += ke * v[h, i, m]
            for m in range(M):
                out[h, i, m] = 0.0
            for e in range(E):
                qe = q[h, i, e]
                for m in range(M):
                    out[h, i, m] += qe * S[e, m]


@_compiled
def _reverse(g, q, k, v, dk, dv):  # pragma: no cover - compiled
    """The reverse-time scan: ``dk_j = R_j v_j``, ``dv_j = R_j^T k_j`` with
    ``R_j = sum_{i>=j} q_i g_i^T``."""
    heads, L, E = q.shape
    M = v.shape[2]
    for h in prange(heads):
        R = np.zeros((E, M), np.float32)
        for i in range(L - 1, -1, -1):
            for m in range(M):
                dv[h, i, m] = 0.0
            for e in range(E):
                qe = q[h, i, e]
                ke = k[h, i, e]
                acc = np.float32(0.0)
                for m in range(M):
                    R[e, m] += qe * g[h, i, m]
                    acc += R[e, m] * v[h, i, m]
                    dv[h, i, m] += R[e, m] * ke
                dk[h, i, e] = acc


def _as_float32(t: torch.Tensor) -> np.ndarray:
    """A float32 C-contiguous ``(heads, L, d)`` numpy view of a ``(n, h, L, d)`` block (a copy
    only when needed)."""
    return t.float().contiguous().view(-1, *t.shape[-2:]).numpy()


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
    """``kernel(*inputs, *outputs)`` on float32 ``(heads, L, d)`` views of ``(N, H, L, d)``
    tensors (outputs fresh and contiguous): all heads at once when nothing needs converting,
    else blocks of heads whose float32 copies hold at most ``BLOCK_ELEMENTS`` each."""
    N, H, L = inputs[0].shape[:3]
    if N * H * L == 0:
        return
    tensors = (*inputs, *outputs)
    in_place = all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
    widest = max(t.shape[-1] for t in tensors)
    heads = N * H if in_place else max(1, BLOCK_ELEMENTS // max(1, L * widest))
    with _LAUNCH:
        numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
        for block in _blocks(N, H, heads):
            results = [_as_float32(t[block]) for t in outputs]  # views of float32 outputs
            kernel(*(_as_float32(t[block]) for t in inputs), *results)
            for t, r in zip(outputs, results, strict=True):
                if t.dtype != torch.float32:
                    t[block].copy_(torch.from_numpy(r).view(t[block].shape))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    N, H, L, _ = q.shape
    out = torch.empty((N, H, L, v.shape[-1]), dtype=q.dtype)
    _run(_forward, (q, k, v), (out,))
    return out


def backward(
    g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype) for t in (q, k, v))
    # dq_i = sum_{j<=i} (g_i . v_j) k_j: the forward scan with (g, v, k) in the roles of (q, k, v)
    _run(_forward, (g, v, k), (dq,))
    _run(_reverse, (g, q, k, v), (dk, dv))
    return dq, dk, dv
