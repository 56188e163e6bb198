"""The gated delta rule (and KDA) in numba-cuda, step by step, one thread per value column.
CPU tensors go to the ``njit`` kernels of :mod:`cakeops_numba.cpu.gated_delta_rule` (in the
simulator, to the CUDA kernels).

The state's columns evolve independently (``u_t = beta_t (v_t - S^T k_t)`` is per column), so
a block owns a sequence, a value head and ``THREADS`` value columns, each thread walking its
column of the float32 state (a scratch in global memory: K is not bounded)::

    S <- exp(g_t) S   (KDA: a factor per key row)     u = beta_t (v_t - S^T k_t)
    S <- S + k_t u^T                                   o_t = scale S^T q_t

The forward needs no synchronisation. The backward walks back with the state's gradient
``dS``; it needs each step's ``S_{t-1}``: a first pass of the forward kernel stores the state at
the start of every chunk of ``CHUNK`` steps, and the backward recomputes a chunk's states into a
scratch before walking it back. Per step, each thread first takes its column's part (``u``,
``du``, ``dv``), then each thread one key row's sums over the block's columns (``dq``, ``dk``,
KDA's ``dg``), from the columns' values the block shares: a fixed order, deterministic. Sums
over blocks of columns and over value heads that share a key head are added afterwards.
``use_qk_l2norm`` normalises q and k before the kernels (float32) and takes the gradient
through the normalisation after them. Gates enter only as ``exp(g_t)`` of one step
(``g_t <= 0``): a gate of ``-inf`` is an exact reset.
"""

from __future__ import annotations

import math

import torch
from numba import cuda, float32

from cakeops.ops.gated_delta_rule import L2NORM_EPS
from cakeops_numba import SIMULATOR, on_cpu_kernels
from cakeops_numba._elements import store, widen
from cakeops_numba._launch import THREADS, on_stream, view
from cakeops_numba.cpu import gated_delta_rule as cpu

#: The shortest call chosen implicitly on the CPU: from two positions the njit recurrence beats
#: the torch backend, forward and backward, both gate forms; a decode step, where its backward is
#: the slower, goes to torch (``packages/numba/benchmarks/cpu_gated_delta_rule.py``).
CPU_DELTA_RULE_FROM = 2


def not_preferred_reasons(inputs) -> list[str]:
    """Passed over on the CPU for a decode step (the backend's ``not_preferred_reasons``)."""
    if on_cpu_kernels(inputs.q) and inputs.q.shape[2] < CPU_DELTA_RULE_FROM:
        return [
            f"its CPU kernel is chosen implicitly from {CPU_DELTA_RULE_FROM} positions on "
            f"(a decode step goes to torch), got {inputs.q.shape[2]}"
        ]
    return []


#: Steps between stored states in the backward's first pass, and per recomputed stretch; 4 in
#: the simulator, so that its short test sequences cross chunks.
CHUNK = 4 if SIMULATOR else 64


@cuda.jit(device=True)
def _decay(g, n, hv, t, e, kda):
    return math.exp(widen(g[n, hv, t, e]) if kda else widen(g[n, hv, t, 0]))


@cuda.jit(device=True)
def _sequence(task, v, cu, packed, group):
    """Block ``task``'s ``(value head, sequence, key head, row, first, end)``: a batch row, or
    (``packed``) one of the packed sequences of row 0."""
    Hv = v.shape[1]
    hv, s = task % Hv, task // Hv
    n, first, end = s, 0, v.shape[2]
    if packed:
        n, first, end = 0, cu[s], cu[s + 1]
    return hv, s, hv // group, n, first, end


@cuda.jit
def _forward(q, k, v, g, beta, out, state, saved, cu, offsets, packed, group, scale, kda, save,
             write):  # fmt: skip
    """``q, k``: (N, H, L, K) float32; ``v``: (N, Hv, L, V); ``g``: (N, Hv, L, 1 or K);
    ``beta``: (N, Hv, L); ``out``: (N, Hv, L, V), written with ``write``; ``state``:
    (S * Hv, K, V) float32, the starting states, left holding the last ones; with ``save``,
    ``saved`` (slots, Hv, K, V) gets the state at the start of every chunk (chunk ``c`` of
    sequence ``s`` in slot ``offsets[s] + c``); ``cu``: (S + 1,) offsets along L of the packed
    sequences (``packed``). One block per (sequence, value head) and ``THREADS`` columns."""
    task = cuda.blockIdx.x
    V, K = v.shape[3], q.shape[3]
    hv, s, h, n, first, end = _sequence(task, v, cu, packed, group)
    m = cuda.blockIdx.y * THREADS + cuda.threadIdx.x
    if m >= V:
        return
    for t in range(first, end):
        if save and (t - first) % CHUNK == 0:
            slot = offsets[s] + (t - first) // CHUNK
            for e in range(K):
                saved[slot, hv, e, m] = state[task, e, m]
        p = float32(0.0)
        for e in range(K):
            x = state[task, e, m] * _decay(g, n, hv, t, e, kda)
            state[task, e, m] = x
            p += x * k[n, h, t, e]
        u = widen(beta[n, hv, t]) * (widen(v[n, hv, t, m]) - p)
        o = float32(0.0)
        for e in range(K):
            x = state[task, e, m] + k[n, h, t, e] * u
            state[task, e, m] = x
            o += x * q[n, h, t, e]
        if write:
            store(out, (n, hv, t, m), o * scale)


@cuda.jit
def _backward(q, k, v, g, beta, do, saved, scratch, dS, cu, offsets, packed, group, scale, kda,
              dq, dk, dv, dg, db):  # fmt: skip
    """The gradients, walking back (arguments as in :func:`_forward`). ``dS`` (S * Hv, K, V)
    float32: the final states' gradients, left holding the initial states'; ``scratch``
    (S * Hv, CHUNK, K, V) float32; ``dq``, ``dk`` ``(blocks, N, Hv, L, K)``, ``dg``
    ``(blocks, N, Hv, L, 1 or K)``, ``db`` ``(blocks, N, Hv, L)``: float32 sums over each
    block's columns; ``dv`` ``(N, Hv, L, V)``."""
    shared_u = cuda.shared.array(THREADS, float32)
    shared_dp = cuda.shared.array(THREADS, float32)
    shared_do = cuda.shared.array(THREADS, float32)
    shared_rdu = cuda.shared.array(THREADS, float32)  # du * r: dbeta's terms
    shared_gs = cuda.shared.array(THREADS, float32)  # a column's <d decayed, decayed>
    tid = cuda.threadIdx.x
    task = cuda.blockIdx.x
    block = cuda.blockIdx.y
    V, K = v.shape[3], q.shape[3]
    hv, s, h, n, first, end = _sequence(task, v, cu, packed, group)
    col0 = block * THREADS
    m = col0 + tid
    cols = min(THREADS, V - col0)
    chunks = (end - first + CHUNK - 1) // CHUNK
    for i in range(chunks):
        c = chunks - 1 - i
        start = first + c * CHUNK
        stop = min(start + CHUNK, end)
        if m < V:  # the chunk's states S_{t-1}, recomputed into the scratch
            slot = offsets[s] + c
            for e in range(K):
                scratch[task, 0, e, m] = saved[slot, hv, e, m]
            for t in range(start, stop - 1):
                j = t - start
                p = float32(0.0)
                for e in range(K):
                    x = scratch[task, j, e, m] * _decay(g, n, hv, t, e, kda)
                    scratch[task, j + 1, e, m] = x
                    p += x * k[n, h, t, e]
                u = widen(beta[n, hv, t]) * (widen(v[n, hv, t, m]) - p)
                for e in range(K):
                    scratch[task, j + 1, e, m] += k[n, h, t, e] * u
        cuda.syncthreads()
        for t in range(stop - 1, start - 1, -1):
            j = t - start
            bt = widen(beta[n, hv, t])
            if m < V:  # the column's part: u, du (dS_t = dS + scale q do^T kept in dS), dv
                do_m = widen(do[n, hv, t, m])
                p = float32(0.0)
                for e in range(K):
                    p += scratch[task, j, e, m] * _decay(g, n, hv, t, e, kda) * k[n, h, t, e]
                r = widen(v[n, hv, t, m]) - p
                du = float32(0.0)
                for e in range(K):
                    x = dS[task, e, m] + scale * q[n, h, t, e] * do_m
                    dS[task, e, m] = x
                    du += x * k[n, h, t, e]
                store(dv, (n, hv, t, m), bt * du)
                dp = -bt * du
                gs = float32(0.0)
                for e in range(K):
                    decayed = scratch[task, j, e, m] * _decay(g, n, hv, t, e, kda)
                    gs += (dS[task, e, m] + k[n, h, t, e] * dp) * decayed
                shared_u[tid], shared_dp[tid], shared_do[tid] = bt * r, dp, do_m
                shared_rdu[tid], shared_gs[tid] = du * r, gs
            cuda.syncthreads()
            for e in range(tid, K, THREADS):  # a key row's sums over the block's columns
                a = _decay(g, n, hv, t, e, kda)
                ke = k[n, h, t, e]
                x_dq = float32(0.0)
                x_dk = float32(0.0)
                x_dg = float32(0.0)
                for jm in range(cols):
                    col = col0 + jm
                    decayed = scratch[task, j, e, col] * a
                    x_dq += (decayed + ke * shared_u[jm]) * shared_do[jm]
                    x_dk += dS[task, e, col] * shared_u[jm] + decayed * shared_dp[jm]
                    x_dg += (dS[task, e, col] + ke * shared_dp[jm]) * decayed
                dq[block, n, hv, t, e] = scale * x_dq
                dk[block, n, hv, t, e] = x_dk
                if kda:
                    dg[block, n, hv, t, e] = x_dg
            if tid == 0:
                x_db = float32(0.0)
                x_dg = float32(0.0)
                for jm in range(cols):
                    x_db += shared_rdu[jm]
                    x_dg += shared_gs[jm]
                db[block, n, hv, t] = x_db
                if not kda:
                    dg[block, n, hv, t, 0] = x_dg
            cuda.syncthreads()
            if m < V:  # dS_{t-1} = exp(g_t) (dS_t + k dp^T)
                dp = shared_dp[tid]
                for e in range(K):
                    a = _decay(g, n, hv, t, e, kda)
                    dS[task, e, m] = a * (dS[task, e, m] + k[n, h, t, e] * dp)
            cuda.syncthreads()


def _normalised(x: torch.Tensor, l2norm: bool):
    """``(x as float32 (normalised with l2norm), 1 / |x| or None)``."""
    x = x.float()
    if not l2norm:
        return x, None
    inv = torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)
    return x * inv, inv


def _layout(q, v, g, cu_seqlens):
    """``(g as (N, Hv, L, 1 or K), cu, offsets, packed, sequences, slots)``."""
    N, _, L, _ = q.shape
    g4 = g if g.dim() == 4 else g.unsqueeze(-1)
    packed = cu_seqlens is not None
    cu = cu_seqlens.long() if packed else torch.tensor([0, L], device=q.device)
    counts = torch.div(cu[1:] - cu[:-1] + CHUNK - 1, CHUNK, rounding_mode="floor")
    if not packed:
        counts = counts.expand(N)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    sequences = cu.numel() - 1 if packed else N
    slots = (L // CHUNK + sequences) if packed else N * -(-L // CHUNK)
    return g4, cu, offsets, packed, sequences, max(slots, 1)


def _run_forward(qn, kn, v, g, beta, scale, initial_state, layout, save, write):
    """``(out, final states (S, Hv, K, V) float32, stored states)``; ``layout`` is
    :func:`_layout`'s."""
    N, H, L, K = qn.shape
    Hv, V = v.shape[1], v.shape[3]
    g4, cu, offsets, packed, sequences, slots = layout
    out = torch.empty((N, Hv, L, V), dtype=v.dtype, device=v.device)
    if initial_state is None:
        state = torch.zeros((sequences * Hv, K, V), dtype=torch.float32, device=v.device)
    else:
        state = initial_state.to(torch.float32, copy=True).reshape(sequences * Hv, K, V)
    saved = torch.empty((slots if save else 1, Hv, K, V), dtype=torch.float32, device=v.device)
    grid = (sequences * Hv, -(-V // THREADS))
    with on_stream(v.device) as stream:
        _forward[grid, THREADS, stream](
            view(qn), view(kn), view(v), view(g4), view(beta), view(out), view(state),
            view(saved), view(cu), view(offsets), packed, Hv // H, float32(scale),
            g.dim() == 4, save, write,
        )  # fmt: skip
    return out, state.view(sequences, Hv, K, V), saved


def forward(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
            cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    qn, _ = _normalised(q, use_qk_l2norm)
    kn, _ = _normalised(k, use_qk_l2norm)
    if on_cpu_kernels(q):
        out, final = cpu.forward(qn, kn, v, g, beta, scale, initial_state, cu_seqlens)
    else:
        layout = _layout(q, v, g, cu_seqlens)
        out, final, _ = _run_forward(qn, kn, v, g, beta, scale, initial_state, layout,
                                     save=False, write=True)  # fmt: skip
    out = out.to(q.dtype)
    if not output_final_state:
        return out, q.new_empty(0)
    return out, final.to(initial_state.dtype if initial_state is not None else torch.float32)


def _cuda_backward(g_out, g_final, qn, kn, v, g, beta, scale, initial_state, cu_seqlens):
    """``(dq, dk (N, Hv, L, K) per value head, dv, dg (N, Hv, L, 1 or K), dbeta, d_initial)``
    from the CUDA kernels (float32 but ``dv``)."""
    layout = _layout(qn, v, g, cu_seqlens)
    _, _, saved = _run_forward(qn, kn, v, g, beta, scale, initial_state, layout, save=True,
                               write=False)  # fmt: skip
    N, H, L, K = qn.shape
    Hv, V = v.shape[1], v.shape[3]
    g4, cu, offsets, packed, sequences, _ = layout
    blocks = -(-V // THREADS)
    f32 = {"dtype": torch.float32, "device": v.device}
    if g_final is not None and g_final.numel():
        dS = g_final.to(torch.float32, copy=True).reshape(sequences * Hv, K, V)
    else:
        dS = torch.zeros((sequences * Hv, K, V), **f32)
    scratch = torch.empty((sequences * Hv, CHUNK, K, V), **f32)
    dq = torch.empty((blocks, N, Hv, L, K), **f32)
    dk = torch.empty((blocks, N, Hv, L, K), **f32)
    dv = torch.empty((N, Hv, L, V), dtype=v.dtype, device=v.device)
    dg = torch.empty((blocks, *g4.shape), **f32)
    db = torch.empty((blocks, N, Hv, L), **f32)
    with on_stream(v.device) as stream:
        _backward[(sequences * Hv, blocks), THREADS, stream](
            view(qn), view(kn), view(v), view(g4), view(beta), view(g_out), view(saved),
            view(scratch), view(dS), view(cu), view(offsets), packed, Hv // H, float32(scale),
            g.dim() == 4, view(dq), view(dk), view(dv), view(dg), view(db),
        )  # fmt: skip
    return dq.sum(0), dk.sum(0), dv, dg.sum(0), db.sum(0), dS.view(sequences, Hv, K, V)


def backward(g_out, g_final, q, k, v, g, beta, scale, initial_state=None,
             output_final_state=False, cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    qn, rq = _normalised(q, use_qk_l2norm)
    kn, rk = _normalised(k, use_qk_l2norm)
    g_final = g_final if output_final_state else None
    run = cpu.backward if on_cpu_kernels(q) else _cuda_backward
    dq, dk, dv, dg, db, d_init = run(g_out, g_final, qn, kn, v, g, beta, scale, initial_state,
                                     cu_seqlens)  # fmt: skip
    N, H, L, K = q.shape
    Hv = v.shape[1]
    # value heads that share a key head, added up
    dq = dq.view(N, H, Hv // H, L, K).sum(2)
    dk = dk.view(N, H, Hv // H, L, K).sum(2)
    if use_qk_l2norm:  # through x / |x|: (dx - x^ (x^ . dx)) / |x|, in place (fresh sums)
        dq = dq.sub_(qn * (qn * dq).sum(-1, keepdim=True)).mul_(rq)
        dk = dk.sub_(kn * (kn * dk).sum(-1, keepdim=True)).mul_(rk)
    d_init = d_init.to(initial_state.dtype) if initial_state is not None else None
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.view(g.shape).to(g.dtype),
            db.to(beta.dtype), d_init)  # fmt: skip
