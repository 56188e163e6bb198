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

import math

import torch
from numba import cuda, float32

from cakeops.helpers import (
    backward_by_scans,
    causal_step,
    key_head_sums,
    log_multiplier_grads,
    log_multipliers,
    split_log_grads,
    value_heads,
)
from cakeops_numba import on_cpu_kernels
from cakeops_numba._elements import store, widen
from cakeops_numba._launch import THREADS, on_stream, view
from cakeops_numba.cpu import causal_dot_product as cpu

CHUNK = 16


@cuda.jit
def _causal(a, b, c, out, state, reverse, lm, has_lm, cu, scale):
    """``a, b``: (N, H, L, E); ``c``, ``out``: (N, H, L, M); ``state``: (N * S * H, E, M), the
    starting states (zeros, or the initial ones), left holding the last ones; ``lm``:
    (N * H, L) log multipliers when ``has_lm``; ``cu``: (S + 1,) offsets of the sequences
    along L (``[0, L]`` unpacked); ``scale``: what ``out`` is multiplied by before it is
    rounded. One block per (row, sequence, head)."""
    scores = cuda.shared.array((CHUNK, CHUNK), float32)
    # The chunk's log multipliers (0 past its end), their sums from the chunk's start to each
    # position, and from after each position to the chunk's end: every factor below is the sum
    # of exactly the steps it spans, never a difference of sums (that loses a small gate beside
    # a large one, and gives NaN for a gate of -inf).
    steps = cuda.shared.array(CHUNK, float32)
    cum = cuda.shared.array(CHUNK, float32)
    tail = cuda.shared.array(CHUNK, float32)
    tid = cuda.threadIdx.x
    task = cuda.blockIdx.x
    H, E = a.shape[1], a.shape[3]
    M = c.shape[3]
    S = cu.shape[0] - 1
    h, ns = task % H, task // H
    n, s = ns // S, ns % S
    nh = n * H + h
    first, end = cu[s], cu[s + 1]
    m = cuda.blockIdx.y * THREADS + tid
    chunks = (end - first + CHUNK - 1) // CHUNK
    for step in range(chunks):
        start = first + ((chunks - 1 - step) if reverse else step) * CHUNK
        size = min(CHUNK, end - start)
        last = float32(0.0)
        if has_lm:
            if tid == 0:
                acc = float32(0.0)
                for i in range(CHUNK):
                    steps[i] = lm[nh, start + i] if i < size else float32(0.0)
                    acc += steps[i]
                    cum[i] = acc
                acc = float32(0.0)
                for i in range(CHUNK - 1, -1, -1):
                    tail[i] = acc
                    acc += steps[i]
            cuda.syncthreads()
            last = cum[CHUNK - 1]
        # The chunk's masked scores, computed once by the whole block.
        for k in range(tid, CHUNK * CHUNK, THREADS):
            i, j = k // CHUNK, k % CHUNK
            x = float32(0.0)
            causal = j >= i if reverse else j <= i
            if causal and i < size and j < size:
                for e in range(E):
                    x += widen(a[n, h, start + i, e]) * widen(b[n, h, start + j, e])
                if has_lm:  # the steps from j to i (from i to j in reverse): never above 1
                    gap = float32(0.0)
                    for u in range(i + 1, j + 1) if reverse else range(j + 1, i + 1):
                        gap += steps[u]
                    x *= math.exp(gap)
            scores[i, j] = x
        cuda.syncthreads()
        if m < M:
            col = cuda.local.array(CHUNK, float32)  # this thread's column of the chunk's c
            for j in range(CHUNK):
                col[j] = widen(c[n, h, start + j, m]) if j < size else float32(0.0)
            for i in range(size):
                acc = float32(0.0)
                # only j in causal(i): a masked zero times a NaN or Inf of c would leak it
                for j in range(i, CHUNK) if reverse else range(i + 1):
                    acc += scores[i, j] * col[j]
                carried = float32(0.0)
                for e in range(E):
                    carried += widen(a[n, h, start + i, e]) * state[task, e, m]
                if has_lm:  # the state's decay to (from) position i
                    carried *= math.exp(tail[i] if reverse else cum[i])
                store(out, (n, h, start + i, m), (acc + carried) * scale)
            for e in range(E):
                acc = float32(0.0)
                for j in range(size):
                    w = widen(b[n, h, start + j, e]) * col[j]
                    if has_lm:  # to the chunk's end (its start, before the chunk, in reverse)
                        w *= math.exp(cum[j] if reverse else tail[j])
                    acc += w
                x = state[task, e, m]
                state[task, e, m] = (x * math.exp(last) if has_lm else x) + acc
        cuda.syncthreads()  # the next chunk's scores and sums overwrite these


def _run(a, b, c, reverse: bool, lm=None, states=None, cu=None, out_dtype=None,
         scale=None) -> torch.Tensor:  # fmt: skip
    """One scan (see the kernel). ``states`` (N * S * H, E, M) float32: the starting states,
    left holding the last ones (zeros when None)."""
    N, H, L, E = a.shape
    M = c.shape[-1]
    out = torch.empty((N, H, L, M), dtype=out_dtype or c.dtype, device=c.device)
    if cu is None:
        cu = torch.tensor([0, L], device=c.device)
    S = cu.numel() - 1
    if states is None:
        states = torch.zeros((N * S * H, E, M), dtype=torch.float32, device=c.device)
    if out.numel() == 0:
        return out
    if E == 0:
        return out.zero_()
    grid = (N * S * H, (M + THREADS - 1) // THREADS)
    lm_ = lm.view(N * H, L) if lm is not None else states.new_zeros((1, 1))
    with on_stream(c.device) as stream:
        arrays = (view(a), view(b), view(c), view(out), view(states))
        s = float32(1.0 if scale is None else scale)
        _causal[grid, THREADS, stream](*arrays, reverse, view(lm_), lm is not None, view(cu.long()),
                                       s)  # fmt: skip
    return out


def _states(x, tasks: int, E: int, M: int, transpose: bool = False) -> torch.Tensor:
    """The kernel's float32 ``(tasks, E, M)`` starting states from ``x`` (``(.., M, E)``
    transposed with ``transpose``; zeros when None)."""
    if x is None:
        return torch.zeros((tasks, E, M), dtype=torch.float32, device="cpu")
    x = x.to(torch.float32, copy=True).reshape(tasks, *x.shape[-2:])  # the kernel writes it
    return x.transpose(-1, -2).contiguous() if transpose else x


def _run_options(q, k, v, lm, initial_state, cu_seqlens, scale):
    """``(out, final states float32)`` on the CUDA kernel."""
    N, H, _, E = q.shape
    M = v.shape[-1]
    S = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    states = _states(initial_state, N * S * H, E, M).to(q.device)
    out = _run(q, k, v, False, lm, states, cu_seqlens, scale=scale)
    return out, states.view(N * S, H, E, M)


def _backward_options(g, g_final, q, k, v, lm, initial_state, cu_seqlens, wide=False):
    """``(dq, dk, dv, gradient reaching each initial state)`` as three runs of the kernel (``g``
    carries the scale): ``dq = (g, v, k)`` from ``S_0^T``, ``dk = (v, g, q)`` from
    ``g_final^T`` and ``dv = (k, q, g)`` from ``g_final`` in reverse, the last leaving the
    gradient that reaches ``S_0``; dq and dk in float32 with ``wide``."""
    wide_dtype = torch.float32 if wide else None
    N, H, _, E = q.shape
    M = v.shape[-1]
    S = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    tasks = N * S * H
    st = _states(initial_state, tasks, M, E, transpose=True).to(q.device)
    dq = _run(g, v, k, False, lm, st, cu_seqlens, out_dtype=wide_dtype)
    gt = _states(g_final, tasks, M, E, transpose=True).to(q.device)
    dk = _run(v, g, q, True, lm, gt, cu_seqlens, out_dtype=wide_dtype)
    gs = _states(g_final, tasks, E, M).to(q.device)
    dv = _run(k, q, g, True, lm, gs, cu_seqlens)
    return dq, dk, dv, gs.view(N * S, H, E, M)


def _plain(scale, lm, initial_state, output_final_state, cu_seqlens) -> bool:
    return (scale is None and lm is None and initial_state is None and not output_final_state
            and cu_seqlens is None)  # fmt: skip


def forward(q, k, v, scale=None, log_decay=None, log_gates=None, initial_state=None,
            output_final_state=False, cu_seqlens=None):  # fmt: skip
    if on_cpu_kernels(q) and q.shape[2] == 1 and cu_seqlens is None:  # a decode step
        options = (scale, log_decay, log_gates, initial_state, output_final_state)
        if v.shape[0] * v.shape[1] * q.shape[-1] * v.shape[-1] < cpu.STEP_FORWARD_BELOW:
            return cpu.step(q, k, v, *options)  # one pass over each head's state
        return causal_step(q, k, v, *options)  # the spec's few ops, on PyTorch's threads
    lm = log_multipliers(q, log_decay, log_gates)
    if not on_cpu_kernels(q):  # the CUDA kernel reads one key head per value head
        q, k = value_heads(q, v.shape[1]), value_heads(k, v.shape[1])
    # the CPU's plain kernels read one key head per value head; its others, any
    plain = _plain(scale, lm, initial_state, output_final_state, cu_seqlens)
    if plain and q.shape[1] == v.shape[1]:
        if on_cpu_kernels(q):
            return cpu.forward(q, k, v), q.new_empty(0)
        return _run(q, k, v, reverse=False), q.new_empty(0)
    elif on_cpu_kernels(q):
        out, final = cpu.forward_options(q, k, v, lm, initial_state, cu_seqlens, scale)
    else:
        out, final = _run_options(q, k, v, lm, initial_state, cu_seqlens, scale)
    if not output_final_state:
        return out, q.new_empty(0)
    return out, final.to(torch.float32 if initial_state is None else initial_state.dtype)


def _step_backward(g, g_final, q, k, v, scale, log_decay, log_gates, initial_state):
    """The gradients of a decode step in the CPU's one pass (:func:`cpu.step_backward`)."""
    dq, dk, dv, d_init, dlm = cpu.step_backward(g, g_final, q, k, v, log_decay, log_gates,
                                                initial_state, scale)  # fmt: skip
    d_decay = None if log_decay is None else dlm.sum((0, 2)).to(log_decay.dtype)
    d_gates = None if log_gates is None else dlm.to(log_gates.dtype)
    dq, dk = key_head_sums(dq, q.shape[1]), key_head_sums(dk, k.shape[1])
    d_init = None if initial_state is None else d_init.to(initial_state.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_decay, d_gates, d_init


def backward(g, g_final, q, k, v, scale=None, log_decay=None, log_gates=None,
             initial_state=None, output_final_state=False, cu_seqlens=None):  # fmt: skip
    g_final = g_final if output_final_state and g_final.numel() else None
    if on_cpu_kernels(q) and q.shape[2] == 1 and cu_seqlens is None:  # a decode step
        return _step_backward(g, g_final, q, k, v, scale, log_decay, log_gates, initial_state)
    key_heads, dtype = q.shape[1], q.dtype
    grouped = key_heads != v.shape[1]  # the CPU kernels sum a group's dq, dk themselves
    lm = log_multipliers(q, log_decay, log_gates)
    if _plain(scale, lm, initial_state, g_final is not None, cu_seqlens) and not grouped:
        if on_cpu_kernels(q):
            return (*cpu.backward(g, q, k, v), None, None, None)
        return (*backward_by_scans(_run, g, q, k, v), None, None, None)
    gs = g if scale is None else g.float() * scale  # the output's gradient carries the scale
    d_decay = d_gates = None
    if on_cpu_kernels(q):  # the CPU kernels also sum the log multipliers' gradient
        dq, dk, dv, d_init, dlm = cpu.backward_options(gs, g_final, q, k, v, lm,
                                                       initial_state, cu_seqlens)  # fmt: skip
        if lm is not None:
            d_decay, d_gates = split_log_grads(dlm, lm, log_decay, log_gates)
    else:  # per value head on CUDA (float32 when a group's are summed after)
        q, k = value_heads(q, v.shape[1]), value_heads(k, v.shape[1])
        dq, dk, dv, d_init = _backward_options(gs, g_final, q, k, v, lm, initial_state,
                                               cu_seqlens, wide=grouped)  # fmt: skip
        if lm is not None:
            d_decay, d_gates = log_multiplier_grads(gs, g_final, q, k, v, lm, initial_state,
                                                    cu_seqlens, log_decay, log_gates)  # fmt: skip
        dq, dk = key_head_sums(dq, key_heads), key_head_sums(dk, key_heads)
    d_init = None if initial_state is None else d_init.to(initial_state.dtype)
    return dq.to(dtype), dk.to(dtype), dv.to(v.dtype), d_decay, d_gates, d_init
