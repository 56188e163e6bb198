"""The gradients of ``causal_dot_product``'s log multipliers (``log_decay``, ``log_gates``) in
two launches, where the spec's batched PyTorch helper makes about 200 a step.

The gradient of ``lm_t`` is the sum of the terms ``exp(lm_{j+1} + ... + lm_i) (q_i . k_j)
(g_i . v_j)`` of the pairs ``j < t <= i`` that cross ``t`` (the initial state a pair before the
sequence, the final state's gradient one after it: see
:func:`cakeops.helpers.log_multiplier_grads`), summed chunk by chunk as exactly those terms,
never as a difference of running sums: the pairs inside a chunk, its positions against the state
entering it and the gradient leaving it, and the pairs spanning it. :func:`_entering_states`
walks the chunks forward and stores the state entering each (in the inputs' dtype, as the
products that read it round it); :func:`_crossing_sums` walks them backward carrying the
state's gradient in float32 and writes each position's sum. A program takes a block of the
values' columns; the blocks' sums add up (one sum over them after the launch).

Supports what the scan does (grouped key heads through the given views, packed sequences,
``initial_state``, the final state's gradient) for key heads up to ``MAX_E`` wide; wider ones
take the spec helper, whose tiles a thread could not hold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cakeops.helpers import log_multiplier_grads, split_log_grads
from cakeops_triton._common import (
    INTERPRET,
    dot,
    dot_precision,
    round_to,
    unit_stride_rows,
    untuned,
)
from cakeops_triton.causal_dot_product.gaps import chunk_sums

#: Positions per chunk: the ``CHUNK x CHUNK`` float32 squares (scores, the values' products,
#: the decays, the pairs) beside the ``E x BLOCK_M`` state and its gradient stay within a
#: thread's registers at ``WARPS`` warps (32 positions spilled at E = 128 on sm_90: nox -s
#: gpu_compile). The interpreter takes short chunks, so that the suite's sequences cross
#: several.
CHUNK = 8 if INTERPRET else 16
WARPS = 8
#: Widest key head (the states' rows) the kernels take: at 256 the crossing sums spill on
#: sm_80 and sm_90 at any column block; wider heads take the spec helper.
MAX_E = 128
#: Elements of a float32 ``E x BLOCK_M`` tile (half for float32 inputs, whose ``q`` and ``k``
#: tiles take twice the registers) of the crossing sums and of the states' walk: 16 and 32
#: registers a thread at ``WARPS`` warps. Both kernels are chains of chunks: fewer, wider
#: programs make fewer waves of them; these are the widest that compile without spilling at
#: every head size up to ``MAX_E`` on sm_90 and sm_80 (``nox -s gpu_compile``). Small under
#: the interpreter, so that the suite's heads take several column blocks (summed after).
STATE_TILE = 256 if INTERPRET else 4096
WALK_TILE = 512 if INTERPRET else 8192


def supported(q: torch.Tensor) -> bool:
    """Whether these kernels take the call: key heads up to ``MAX_E``."""
    return q.shape[-1] <= MAX_E


def _blocks(E: int, M: int, dtype: torch.dtype, tile: int) -> tuple[int, int]:
    """The key head's block and the values' columns per program: float32 ``E x BLOCK_M``
    tiles of ``tile`` elements (half for float32 inputs)."""
    block_e = max(16, triton.next_power_of_2(E))
    tile = tile // (2 if dtype == torch.float32 else 1)
    block_m = max(16, min(64, tile // block_e, triton.next_power_of_2(M)))
    return block_e, block_m


@triton.jit
def _sequence(CU, L, seq, PACKED):
    """``(n, first, end)``: the batch row and the positions of one program's sequence."""
    n = seq
    first = (L * 0).to(tl.int32)
    end = L.to(tl.int32)
    if PACKED:
        n = seq * 0
        first = tl.load(CU + seq).to(tl.int32)
        end = tl.load(CU + seq + 1).to(tl.int32)
    return n, first, end


def _entering_states_kernel(
    K, V, LM, INIT, STATES, CU, L, H, E, M, NC,
    sk_n, sk_h, sk_l, sv_n, sv_h, sv_l, si_s, si_h, si_e, si_m,
    HAS_INIT, PACKED, PRECISION: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Stores the state entering each chunk of one sequence, head and block of columns:
    ``S <- exp(lm_t) S + k_t v_t^T`` from ``initial_state`` (or zeros)."""
    pid_nh = tl.program_id(0)
    h = (pid_nh % H).to(tl.int64)
    seq = (pid_nh // H).to(tl.int64)
    n, first, end = _sequence(CU, L, seq, PACKED)
    # a sequence's chunks start at first // CHUNK + seq: never past the next sequence's start
    base = first // CHUNK + seq if PACKED else seq * 0
    e = tl.arange(0, BLOCK_E)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = tl.arange(0, CHUNK)
    em = (e < E)[:, None] & (m < M)[None, :]
    state = tl.zeros((BLOCK_E, BLOCK_M), dtype=tl.float32)
    if HAS_INIT:
        init = INIT + seq * si_s + h * si_h + e.to(tl.int64)[:, None] * si_e + m[None, :] * si_m
        state = tl.load(init, mask=em, other=0.0).to(tl.float32)
    rows = STATES + ((n * H + h) * NC + base) * E * M + e.to(tl.int64)[:, None] * M + m[None, :]
    lm_row = LM + (n * H + h) * L
    dtype = V.dtype.element_ty
    for i in range(0, tl.cdiv(end - first, CHUNK)):
        tl.store(rows + i * E * M, round_to(state, STATES.dtype.element_ty), mask=em)
        pos = first + i * CHUNK + t
        pos64 = pos.to(tl.int64)
        ok = pos < end
        k = tl.load(K + n * sk_n + h * sk_h + pos64[:, None] * sk_l + e[None, :],
                    mask=ok[:, None] & (e < E)[None, :], other=0.0)  # fmt: skip
        v = tl.load(V + n * sv_n + h * sv_h + pos64[:, None] * sv_l + m[None, :],
                    mask=ok[:, None] & (m < M)[None, :], other=0.0)  # fmt: skip
        _, _, tail, last = chunk_sums(lm_row, pos, end, CHUNK)
        kw = round_to(k.to(tl.float32) * tl.exp(tail)[:, None], dtype)
        state = dot(tl.trans(kw), v, state * tl.exp(last), PRECISION)


def _crossing_sums_kernel(
    Q, K, V, G, LM, STATES, FINAL, OUT, CU, L, H, E, M, NC,
    sq_n, sq_h, sq_l, sk_n, sk_h, sk_l, sv_n, sv_h, sv_l, sg_n, sg_h, sg_l,
    sf_s, sf_h, sf_e, sf_m,
    HAS_FINAL, PACKED, PRECISION: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Walks one sequence's chunks backward carrying ``R``, the gradient of the state leaving
    the chunk (from the final state's), and writes each position's crossing sum over this
    program's columns to ``OUT[n, h, pid_m]``."""
    pid_nh = tl.program_id(0)
    pid_m = tl.program_id(1)
    h = (pid_nh % H).to(tl.int64)
    seq = (pid_nh // H).to(tl.int64)
    n, first, end = _sequence(CU, L, seq, PACKED)
    base = first // CHUNK + seq if PACKED else seq * 0
    e = tl.arange(0, BLOCK_E)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = tl.arange(0, CHUNK)
    em = (e < E)[:, None] & (m < M)[None, :]
    grad = tl.zeros((BLOCK_E, BLOCK_M), dtype=tl.float32)
    if HAS_FINAL:
        final = FINAL + seq * sf_s + h * sf_h + e.to(tl.int64)[:, None] * sf_e + m[None, :] * sf_m
        grad = tl.load(final, mask=em, other=0.0).to(tl.float32)
    rows = STATES + ((n * H + h) * NC + base) * E * M + e.to(tl.int64)[:, None] * M + m[None, :]
    lm_row = LM + (n * H + h) * L
    out_row = OUT + ((n * H + h) * tl.num_programs(1) + pid_m) * L
    dtype = V.dtype.element_ty
    later = t[:, None] > t[None, :]  # [i, j]: i after j
    earlier = t[:, None] < t[None, :]  # [j, t]: j before t
    chunks = tl.cdiv(end - first, CHUNK)
    for r in range(0, chunks):
        i = chunks - 1 - r
        pos = first + i * CHUNK + t
        pos64 = pos.to(tl.int64)
        ok = pos < end
        qe = ok[:, None] & (e < E)[None, :]
        cm = ok[:, None] & (m < M)[None, :]
        q = tl.load(Q + n * sq_n + h * sq_h + pos64[:, None] * sq_l + e[None, :], mask=qe,
                    other=0.0)  # fmt: skip
        k = tl.load(K + n * sk_n + h * sk_h + pos64[:, None] * sk_l + e[None, :], mask=qe,
                    other=0.0)  # fmt: skip
        v = tl.load(V + n * sv_n + h * sv_h + pos64[:, None] * sv_l + m[None, :], mask=cm,
                    other=0.0)  # fmt: skip
        g = tl.load(G + n * sg_n + h * sg_h + pos64[:, None] * sg_l + m[None, :], mask=cm,
                    other=0.0)  # fmt: skip
        state = tl.load(rows + i * E * M, mask=em, other=0.0)
        hi, lo, tail, last = chunk_sums(lm_row, pos, end, CHUNK)
        into = tl.exp(hi + lo)  # from the chunk's start to i
        zero = tl.zeros((CHUNK, BLOCK_M), dtype=tl.float32)
        # positions i against the state entering the chunk, positions j against the gradient
        # leaving it, and the pairs spanning it
        qs = dot(q, state.to(dtype), zero, PRECISION)
        entering = into * tl.sum(qs * g.to(tl.float32), axis=1)
        kr = dot(k, round_to(grad, dtype), zero, PRECISION)
        leaving = tl.exp(tail) * tl.sum(kr * v.to(tl.float32), axis=1)
        spanning = tl.exp(last) * tl.sum(tl.sum(state.to(tl.float32) * grad, axis=1), axis=0)
        # the pairs inside: [i, j] = exp(lm_{j+1} + .. + lm_i) (q_i . k_j) (g_i . v_j), i > j
        square = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
        scores = dot(q, tl.trans(k), square, PRECISION)
        values = dot(g, tl.trans(v), square, PRECISION)
        gap = (hi[:, None] - hi[None, :]) + (lo[:, None] - lo[None, :])
        decay = tl.exp(tl.where(later, gap, -float("inf")))
        pair = tl.where(decay == 0, 0.0, scores * values * decay)
        # inside_t = sum over j < t <= i of pair[i, j]: each row's sums over j < t (a product
        # with the mask [j < t]), then the rows i >= t of each column t
        rows_before = tl.dot(pair, earlier.to(tl.float32), square, input_precision="ieee")
        inside = tl.sum(tl.where(earlier, 0.0, rows_before), axis=0)  # [i, t] for i >= t
        before = tl.cumsum(leaving, axis=0) - leaving
        total = tl.cumsum(entering, axis=0, reverse=True) + before + inside + spanning
        tl.store(out_row + pos64, total, mask=ok)
        # the gradient leaving the chunk before: exp(lm over the chunk) R + sum_i into_i q_i g_i^T
        qw = round_to(q.to(tl.float32) * into[:, None], dtype)
        grad = dot(tl.trans(qw), g, grad * tl.exp(last), PRECISION)


_entering_states = untuned(_entering_states_kernel)
_crossing_sums = untuned(_crossing_sums_kernel)


def gradients(gs, g_final, q, k, v, lm, initial_state, cu_seqlens, log_decay, log_gates):
    """``(dlog_decay, dlog_gates)`` as :func:`cakeops.helpers.log_multiplier_grads` computes
    them, ``q`` and ``k`` per value head (views), ``gs`` the output's gradient with the scale
    in it, ``lm`` float32 ``(N, H, L)``. Key heads wider than ``MAX_E``: the helper."""
    if not supported(q) or q.shape[2] == 0:
        return log_multiplier_grads(gs, g_final, q, k, v, lm, initial_state, cu_seqlens,
                                    log_decay, log_gates)  # fmt: skip
    q, k, v, gs = (unit_stride_rows(x) for x in (q, k, v, gs))
    lm = lm.to(torch.float32).contiguous()
    N, H, L, E = q.shape
    M = v.shape[-1]
    packed = cu_seqlens is not None
    sequences = cu_seqlens.numel() - 1 if packed else N
    cu = cu_seqlens.to(torch.int64).contiguous() if packed else lm.new_empty(0, dtype=torch.int64)
    chunks = L // CHUNK + sequences + 1 if packed else triton.cdiv(L, CHUNK)
    block_e, walk_m = _blocks(E, M, v.dtype, WALK_TILE)
    block_m = _blocks(E, M, v.dtype, STATE_TILE)[1]
    grid = (sequences * H, triton.cdiv(M, block_m))
    # the states in the inputs' dtype: the products that read them round them there
    states = torch.empty((N, H, chunks, E, M), dtype=v.dtype, device=v.device)
    sums = torch.empty((N, H, grid[1], L), dtype=torch.float32, device=v.device)
    unused = lm.new_empty(0)
    init = unused if initial_state is None else initial_state
    final = unused if g_final is None else g_final
    zeros4 = (0, 0, 0, 0)
    meta = {"PRECISION": dot_precision(v.dtype), "CHUNK": CHUNK, "BLOCK_E": block_e,
            "num_warps": WARPS, "num_stages": 1}  # fmt: skip
    _entering_states[(grid[0], triton.cdiv(M, walk_m))](
        k, v, lm, init, states, cu, L, H, E, M, chunks,
        *k.stride()[:3], *v.stride()[:3],
        *(zeros4 if initial_state is None else initial_state.stride()),
        int(initial_state is not None), int(packed), BLOCK_M=walk_m, **meta,
    )  # fmt: skip
    _crossing_sums[grid](
        q, k, v, gs, lm, states, final, sums, cu, L, H, E, M, chunks,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *gs.stride()[:3],
        *(zeros4 if g_final is None else g_final.stride()),
        int(g_final is not None), int(packed), BLOCK_M=block_m, **meta,
    )  # fmt: skip
    dlm = sums[:, :, 0] if grid[1] == 1 else sums.sum(2)
    return split_log_grads(dlm, lm, log_decay, log_gates)
