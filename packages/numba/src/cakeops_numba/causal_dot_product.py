"""Causal linear attention in numba-cuda, chunked.

One kernel computes ``out_i = sum_{j in causal(i)} (a_i . b_j) c_j`` over chunks of ``CHUNK``
positions. A block owns one ``(n, h)`` and ``THREADS`` value columns, one thread per column. Per
chunk, the block computes the chunk's causally masked scores ``a_i . b_j`` once into shared
memory; each thread then forms its column of the output from the scores and from its column of
the running float32 ``E x M`` state, and adds the chunk to that column. There is one state per
``(n, h)`` for the whole sequence (a float32 scratch in global memory, since E is not bounded),
never one per step. ``causal(i)`` is ``j <= i``, or ``j >= i`` with ``reverse`` (chunks walked
from the end). The backward is three more runs: ``dq = (g, v, k)`` forward, ``dk = (v, g, q)``
and ``dv = (k, q, g)`` in reverse. Every sum runs in a fixed order: deterministic.

CPU tensors go to the ``njit`` kernels of :mod:`cakeops_numba.cpu.causal_dot_product` (in the
simulator, to the CUDA kernel above).
"""

from __future__ import annotations

import torch
from numba import cuda, float32

from cakeops.helpers import backward_by_scans, log_multiplier_grads, log_multipliers
from cakeops_numba import SIMULATOR
from cakeops_numba._elements import store, widen
from cakeops_numba._launch import THREADS, on_stream, view
from cakeops_numba.cpu import causal_dot_product as cpu

CHUNK = 16


@cuda.jit
def _causal(a, b, c, out, state, reverse):
    """``a, b``: (N, H, L, E); ``c``, ``out``: (N, H, L, M); ``state``: (N * H, E, M) zeros."""
    scores = cuda.shared.array((CHUNK, CHUNK), float32)
    tid = cuda.threadIdx.x
    nh = cuda.blockIdx.x
    _, H, L, E = a.shape
    M = c.shape[3]
    n, h = nh // H, nh % H
    m = cuda.blockIdx.y * THREADS + tid
    chunks = (L + CHUNK - 1) // CHUNK
    for step in range(chunks):
        start = (chunks - 1 - step) * CHUNK if reverse else step * CHUNK
        # The chunk's masked scores, computed once by the whole block.
        for k in range(tid, CHUNK * CHUNK, THREADS):
            i, j = k // CHUNK, k % CHUNK
            s = float32(0.0)
            causal = j >= i if reverse else j <= i
            if causal and start + i < L and start + j < L:
                for e in range(E):
                    s += widen(a[n, h, start + i, e]) * widen(b[n, h, start + j, e])
            scores[i, j] = s
        cuda.syncthreads()
        if m < M:
            col = cuda.local.array(CHUNK, float32)  # this thread's column of the chunk's c
            for j in range(CHUNK):
                col[j] = widen(c[n, h, start + j, m]) if start + j < L else float32(0.0)
            for i in range(min(CHUNK, L - start)):
                acc = float32(0.0)
                # only j in causal(i): a masked zero times a NaN or Inf of c would leak it
                for j in range(i, CHUNK) if reverse else range(i + 1):
                    acc += scores[i, j] * col[j]
                for e in range(E):
                    acc += widen(a[n, h, start + i, e]) * state[nh, e, m]
                store(out, (n, h, start + i, m), acc)
            for e in range(E):
                acc = state[nh, e, m]
                for j in range(min(CHUNK, L - start)):
                    acc += widen(b[n, h, start + j, e]) * col[j]
                state[nh, e, m] = acc
        cuda.syncthreads()  # the next chunk's scores overwrite these


def _run(a, b, c, reverse: bool) -> torch.Tensor:
    N, H, L, E = a.shape
    M = c.shape[-1]
    out = torch.empty((N, H, L, M), dtype=c.dtype, device=c.device)
    if out.numel() == 0:
        return out
    if E == 0:
        return out.zero_()
    state = torch.zeros((N * H, E, M), dtype=torch.float32, device=c.device)
    grid = (N * H, (M + THREADS - 1) // THREADS)
    with on_stream(c.device) as stream:
        _causal[grid, THREADS, stream](view(a), view(b), view(c), view(out), view(state), reverse)
    return out


def _on_cpu_kernels(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and not SIMULATOR


def _plain(scale, lm, initial_state, output_final_state, cu_seqlens) -> bool:
    return (scale is None and lm is None and initial_state is None and not output_final_state
            and cu_seqlens is None)  # fmt: skip


def forward(q, k, v, scale=None, log_decay=None, log_gates=None, initial_state=None,
            output_final_state=False, cu_seqlens=None):  # fmt: skip
    lm = log_multipliers(q, log_decay, log_gates)
    if _plain(scale, lm, initial_state, output_final_state, cu_seqlens):
        if _on_cpu_kernels(q):
            return cpu.forward(q, k, v), q.new_empty(0)
        return _run(q, k, v, reverse=False), q.new_empty(0)
    if _on_cpu_kernels(q):
        out, final = cpu.forward_options(q, k, v, lm, initial_state, cu_seqlens, scale)
    else:
        out, final = _run_options(q, k, v, lm, initial_state, cu_seqlens, scale)
    if not output_final_state:
        return out, q.new_empty(0)
    return out, final.to(torch.float32 if initial_state is None else initial_state.dtype)


def backward(g, g_final, q, k, v, scale=None, log_decay=None, log_gates=None,
             initial_state=None, output_final_state=False, cu_seqlens=None):  # fmt: skip
    lm = log_multipliers(q, log_decay, log_gates)
    g_final = g_final if output_final_state and g_final.numel() else None
    if _plain(scale, lm, initial_state, g_final is not None, cu_seqlens):
        if _on_cpu_kernels(q):
            return (*cpu.backward(g, q, k, v), None, None, None)
        return (*backward_by_scans(_run, g, q, k, v), None, None, None)
    gs = g if scale is None else g.float() * scale  # the output's gradient carries the scale
    if _on_cpu_kernels(q):
        dq, dk, dv, d_init, final = cpu.backward_options(gs, g_final, q, k, v, lm, initial_state,
                                                         cu_seqlens)  # fmt: skip
    else:
        dq, dk, dv, d_init, final = _backward_options(gs, g_final, q, k, v, lm, initial_state,
                                                      cu_seqlens)  # fmt: skip
    d_decay = d_gates = None
    if lm is not None:
        at_end = None if g_final is None else (g_final.float() * final).sum((-1, -2))
        d_decay, d_gates = log_multiplier_grads(q, k, dq, dk, cu_seqlens, at_end, log_decay,
                                                log_gates)  # fmt: skip
    d_init = None if initial_state is None else d_init.to(initial_state.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_decay, d_gates, d_init


def _run_options(*args):
    raise NotImplementedError("WIP #27: numba CUDA with options")


def _backward_options(*args):
    raise NotImplementedError("WIP #27: numba CUDA with options")
