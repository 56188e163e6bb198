"""The gated delta rule (and KDA) on the CPU: one float32 ``K x V`` state per (sequence, value
head), updated step by step, the tasks in parallel (``prange``).

Each step makes two passes over the state's rows, each a contiguous loop over the value columns
that the compiler vectorises::

    pass 1, row e:  S[e] <- a_e S[e];  p += k_e S[e]          (a_e = exp(g_t), KDA: exp(g_t[e]))
    between:        u = beta_t (v_t - p)
    pass 2, row e:  S[e] <- S[e] + k_e u;  o += q_e S[e]      (o_t = scale o)

A head's state (64 KiB at K = V = 128) stays in a core's cache, with no ``C x C`` or
``C x C x K`` chunk factors and no BLAS call per chunk: for KDA, whose per-channel gates have no
matrix-product form, this is what wins on the CPU. Gates enter only as ``exp(g_t)`` of one step
(``g_t <= 0``): a gate of ``-inf`` is an exact reset.

The backward walks back with the state's gradient ``dS`` (two passes a step as well, see
:func:`_step_back`), which needs every step's ``S_{t-1}``: a task first runs its forward,
keeping the state at the start of every stretch of ``chunk`` steps, then recomputes one stretch
at a time into a scratch of ``chunk`` states before walking it back. Each of numba's threads
takes every ``threads``-th task with a work area of its own (a PyTorch tensor). ``chunk`` is
about ``sqrt(L) / 2``, so a thread holds ``~2.5 sqrt(L)`` states at a time, whatever ``L``.
Every sum runs in a fixed order: deterministic. Inputs arrive as float32 contiguous tensors
(q and k already normalised with ``use_qk_l2norm``); the gradients of the value heads that
share a key head are added by the caller.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch
from numba import prange

from cakeops.helpers import state_floor
from cakeops_numba.cpu._njit import F32, array_at, as_float32, compiled, launching

#: The fewest steps between the backward's stored states.
MIN_CHUNK = 16


def chunk_for(length: int) -> int:
    """Steps between the backward's stored states: ``~sqrt(length) / 2``, so that a thread holds
    ``~2.5 sqrt(length)`` states (``length / chunk`` stored, ``chunk`` recomputed), the
    recomputed ones, walked back and forth, the fewer."""
    return max(MIN_CHUNK, (math.isqrt(max(length - 1, 0)) + 2) // 2)


@compiled(parallel=False, inline=True)
def _task(task, Hv, L, cu, packed):  # pragma: no cover - compiled
    """Task ``task``'s ``(batch row, value head, first position, end)``: a batch row, or
    (``packed``) one of the packed sequences of row 0."""
    hv, s = task % Hv, task // Hv
    if packed:
        return 0, hv, cu[s], cu[s + 1]
    return s, hv, 0, L


@compiled(parallel=False, inline=True)
def _decays(g, a, floor):  # pragma: no cover - compiled
    """``a[e] = exp(g[e])`` (KDA) or ``exp(g[0])`` for every row (a scalar gate), exactly 0
    under ``exp(floor)`` (NaN stays NaN)."""
    K = a.shape[0]
    if g.shape[0] == K:
        for e in range(K):
            a[e] = np.float32(0.0) if g[e] < floor else np.exp(g[e])
    else:
        x = np.float32(0.0) if g[0] < floor else np.exp(g[0])
        for e in range(K):
            a[e] = x


@compiled(parallel=False, inline=True)
def _advance(S_in, S, q, k, v, a, beta, p, o):  # pragma: no cover - compiled
    """One step from ``S_in`` into ``S`` (the same array for in place); ``o`` gets
    ``S^T q`` unless ``q`` is empty."""
    K, V = S.shape
    p[:] = 0.0
    for e in range(K):
        ae, ke = a[e], k[e]
        for m in range(V):
            x = S_in[e, m] * ae
            S[e, m] = x
            p[m] += ke * x
    for m in range(V):
        p[m] = beta * (v[m] - p[m])  # u, in p's place
    if q.shape[0]:
        o[:] = 0.0
    for e in range(K):
        ke = k[e]
        if q.shape[0]:
            qe = q[e]
            for m in range(V):
                x = S[e, m] + ke * p[m]
                S[e, m] = x
                o[m] += qe * x
        else:
            for m in range(V):
                S[e, m] += ke * p[m]


@compiled(parallel=True)
def _forward(q, k, v, g, beta, cu, packed, group, scale, floor, state, out):  # pragma: no cover
    """``q, k``: (N, H, L, K); ``v``: (N, Hv, L, V); ``g``: (N, Hv, L, 1 or K); ``beta``:
    (N, Hv, L); ``floor``: gates under it decay by exactly 0 (see :func:`_floor`); ``state``
    (tasks, K, V): the starting states, left holding the last ones;
    ``out`` (N, Hv, L, V); ``cu`` (sequences + 1,): the packed sequences' offsets along L."""
    Hv, L, V = v.shape[1], v.shape[2], v.shape[3]
    K = q.shape[3]
    for task in prange(state.shape[0]):
        n, hv, first, end = _task(task, Hv, L, cu, packed)
        h = hv // group
        S = state[task]
        a = np.empty(K, np.float32)
        p = np.empty(V, np.float32)
        for t in range(first, end):
            _decays(g[n, hv, t], a, floor)
            o = out[n, hv, t]
            _advance(S, S, q[n, h, t], k[n, h, t], v[n, hv, t], a, beta[n, hv, t], p, o)
            for m in range(V):
                o[m] *= scale


@compiled(parallel=False, inline=True)
def _step_back(S_prev, D, q, k, v, a, beta, do, scale, dq, dk, dv, dg, r, u, du):
    """Step ``t``'s gradients from ``S_prev = S_{t-1}`` and ``D = dS_t`` (the gradient of the
    state after step ``t``, updated in place to ``dS_{t-1}``)::

        Sd = a o S_prev    p = Sd^T k    r = v - p    u = beta r    S_t = Sd + k u^T
        D += scale q do^T;  du = D^T k;  dv = beta du;  dbeta = du . r;  dp = -beta du
        dq = scale (Sd do + k (u . do));   dk = D u + Sd dp
        dSd = D + k dp^T;   dg_e = dSd[e] . Sd[e];   dS_{t-1} = a o dSd

    Returns ``dbeta``; ``dg`` (K,) gets the rows' gate sums. Pass 1 forms ``p``, ``D`` and
    ``du`` and ``dq``'s first term; pass 2 the rest."""
    K, V = D.shape
    r[:] = 0.0
    du[:] = 0.0
    for e in range(K):
        ae, ke, qe = a[e], k[e], scale * q[e]
        x_dq = np.float32(0.0)
        for m in range(V):
            sd = S_prev[e, m] * ae
            r[m] += ke * sd
            d = D[e, m] + qe * do[m]
            D[e, m] = d
            du[m] += ke * d
            x_dq += sd * do[m]
        dq[e] = scale * x_dq
    db = np.float32(0.0)
    ud = np.float32(0.0)
    for m in range(V):
        r[m] = v[m] - r[m]
        u[m] = beta * r[m]
        ud += u[m] * do[m]
        db += du[m] * r[m]
        dv[m] = beta * du[m]
        du[m] = -beta * du[m]  # dp, in du's place
    for e in range(K):
        ae, ke = a[e], k[e]
        dq[e] += scale * ke * ud
        x_dk = np.float32(0.0)
        x_dg = np.float32(0.0)
        for m in range(V):
            sd = S_prev[e, m] * ae
            d = D[e, m]
            x_dk += d * u[m] + sd * du[m]
            dsd = d + ke * du[m]
            x_dg += dsd * sd
            D[e, m] = ae * dsd
        dk[e] = x_dk
        dg[e] = x_dg
    return db


@compiled(parallel=True)
def _backward(q, k, v, g, beta, do, cu, packed, group, scale, floor, chunk, state, D, work, dq,
              dk, dv, dg, db):  # fmt: skip  # pragma: no cover - compiled
    """The gradients, walking back (arguments as in :func:`_forward`; ``state`` the starting
    states, read only). ``D`` (tasks, K, V): the final states' gradients, left holding the
    starting states'; ``work`` (workers, stretches + chunk, K, V): each worker's stored and
    recomputed states (worker ``w`` takes tasks ``w, w + workers, ...``); ``dq``, ``dk``
    (N, Hv, L, K) per value head; ``dv`` (N, Hv, L, V); ``dg`` (N, Hv, L, 1 or K); ``db``
    (N, Hv, L)."""
    Hv, L, V = v.shape[1], v.shape[2], v.shape[3]
    K = q.shape[3]
    tasks, workers = state.shape[0], work.shape[0]
    none = np.empty(0, np.float32)
    for w in prange(workers):
        a = np.empty(K, np.float32)
        x = np.empty(V, np.float32)
        y = np.empty(V, np.float32)
        z = np.empty(V, np.float32)
        gsum = np.empty(K, np.float32)
        stored = work[w, : work.shape[1] - chunk]
        scratch = work[w, work.shape[1] - chunk :]
        for task in range(w, tasks, workers):
            n, hv, first, end = _task(task, Hv, L, cu, packed)
            h = hv // group
            stretches = (end - first + chunk - 1) // chunk
            S = scratch[0]
            S[:] = state[task]
            for t in range(first, end):  # the forward, keeping each stretch's first state
                if (t - first) % chunk == 0:
                    stored[(t - first) // chunk] = S
                _decays(g[n, hv, t], a, floor)
                _advance(S, S, none, k[n, h, t], v[n, hv, t], a, beta[n, hv, t], x, y)
            for i in range(stretches):
                c = stretches - 1 - i
                start = first + c * chunk
                stop = min(start + chunk, end)
                scratch[0] = stored[c]
                for t in range(start, stop - 1):  # the stretch's states S_{t-1}
                    j = t - start
                    _decays(g[n, hv, t], a, floor)
                    _advance(scratch[j], scratch[j + 1], none, k[n, h, t], v[n, hv, t], a,
                             beta[n, hv, t], x, y)  # fmt: skip
                for t in range(stop - 1, start - 1, -1):
                    _decays(g[n, hv, t], a, floor)
                    db[n, hv, t] = _step_back(
                        scratch[t - start], D[task], q[n, h, t], k[n, h, t], v[n, hv, t], a,
                        beta[n, hv, t], do[n, hv, t], scale, dq[n, hv, t], dk[n, hv, t],
                        dv[n, hv, t], gsum, x, y, z,
                    )  # fmt: skip
                    if g.shape[3] == K:
                        dg[n, hv, t] = gsum
                    else:
                        dg[n, hv, t, 0] = gsum.sum()


def _floor(*states) -> np.float32:
    """Where a gate's factor is taken as 0: ``cakeops.helpers.state_floor`` of the given
    states, as the torch backend does. Such a factor is far below float32's rounding of the
    terms beside it, and kept, its products with the state reach float32's subnormal range,
    which x86 CPUs compute tens of times slower (the strong gates models start from)."""
    return np.float32(float(state_floor(*states, dtype=torch.float32)))


def _sequences(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> tuple[np.ndarray, bool, int]:
    """``(cu as int64 numpy, packed, sequences)``."""
    if cu_seqlens is None:
        return np.zeros(2, np.int64), False, q.shape[0]
    cu = cu_seqlens.to(torch.int64, copy=True).cpu().numpy()
    return cu, True, cu.shape[0] - 1


def _arrays(q, k, v, g, beta):
    """The inputs as float32 contiguous tensors, ``g`` as (N, Hv, L, 1 or K)."""
    g4 = g if g.dim() == 4 else g.unsqueeze(-1)
    return [as_float32(x) for x in (q, k, v, g4, beta)]


def _states(x: torch.Tensor | None, tasks: int, K: int, V: int) -> torch.Tensor:
    """A float32 copy of ``x`` as (tasks, K, V), or zeros."""
    if x is None:
        return torch.zeros((tasks, K, V), **F32)
    return x.to(torch.float32, copy=True).reshape(tasks, K, V).contiguous()


def forward(qn, kn, v, g, beta, scale, initial_state, cu_seqlens):
    """``(out (N, Hv, L, V) float32, final states (sequences, Hv, K, V) float32)`` from the
    (normalised) float32 ``qn``, ``kn`` and the other inputs."""
    q32, k32, v32, g32, b32 = _arrays(qn, kn, v, g, beta)
    N, H, L, K = q32.shape
    Hv, V = v32.shape[1], v32.shape[3]
    cu, packed, sequences = _sequences(q32, cu_seqlens)
    state = _states(initial_state, sequences * Hv, K, V)
    floor = _floor((initial_state, kn, v))
    out = torch.zeros((N, Hv, L, V), **F32)
    with launching():
        _forward(array_at(q32), array_at(k32), array_at(v32), array_at(g32), array_at(b32), cu,
                 packed, Hv // H, np.float32(scale), floor, array_at(state),
                 array_at(out))  # fmt: skip
    return out, state.view(sequences, Hv, K, V)


def backward(g_out, g_final, qn, kn, v, g, beta, scale, initial_state, cu_seqlens):
    """``(dq, dk (N, Hv, L, K) per value head, dv, dg (N, Hv, L, 1 or K), dbeta, d_initial
    (sequences, Hv, K, V))``, float32, with respect to the (normalised) ``qn``, ``kn``."""
    q32, k32, v32, g32, b32 = _arrays(qn, kn, v, g, beta)
    do = as_float32(g_out)
    N, H, L, K = q32.shape
    Hv, V = v32.shape[1], v32.shape[3]
    cu, packed, sequences = _sequences(q32, cu_seqlens)
    tasks = sequences * Hv
    state = _states(initial_state, tasks, K, V)
    final = g_final if g_final is not None and g_final.numel() else None
    D = _states(final, tasks, K, V)
    floor = _floor((initial_state, kn, v), (final, qn, g_out))
    dq = torch.zeros((N, Hv, L, K), **F32)
    dk = torch.zeros((N, Hv, L, K), **F32)
    dv = torch.zeros((N, Hv, L, V), **F32)
    dg = torch.zeros(g32.shape, **F32)
    db = torch.zeros((N, Hv, L), **F32)
    longest = L if not packed else int((cu[1:] - cu[:-1]).max(initial=0))
    chunk = chunk_for(longest)
    with launching():
        workers = min(numba.get_num_threads(), tasks)
        # a PyTorch allocation, so that its memory shows where PyTorch's is measured
        work = torch.empty((workers, -(-longest // chunk) + chunk, K, V), **F32)
        _backward(
            array_at(q32), array_at(k32), array_at(v32), array_at(g32), array_at(b32),
            array_at(do), cu, packed, Hv // H, np.float32(scale), floor, chunk, array_at(state),
            array_at(D), array_at(work), array_at(dq), array_at(dk), array_at(dv),
            array_at(dg), array_at(db),
        )  # fmt: skip
    return dq, dk, dv, dg, db, D.view(sequences, Hv, K, V)
