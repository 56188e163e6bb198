"""The gated delta rule (and KDA) step by step, with the state in registers.

One program owns a sequence, a value head and a block of ``BV`` value columns. The state's
columns evolve independently (``u_t = beta_t (v_t - S^T k_t)`` is per column), so the program
keeps its ``K x BV`` float32 slice of ``S`` in registers and walks the positions::

    S <- exp(g_t) S   (KDA: a factor per key row)     u = beta_t (v_t - S^T k_t)
    S <- S + k_t u^T                                   o_t = scale S^T q_t

The backward walks back with the state's gradient ``dS`` in registers. It needs each step's
``S_{t-1}``: a first pass of the forward kernel stores the state at the start of every chunk of
``CHUNK`` steps (float32, ``L / CHUNK`` states per head); the backward then, chunk after chunk from
the end, recomputes the chunk's ``CHUNK`` states into its own scratch (``CHUNK x K x BV`` float32
per program) and walks them back. Sums over the value columns (``dq``, ``dk``, ``dg``, ``dbeta``)
are per block of columns and per value head, added up afterwards (several value heads share a
key head). Gates enter only as ``exp(g_t)`` of one step (``g_t <= 0``): a gate of ``-inf`` is an
exact reset. Every sum runs in a fixed order: deterministic.

These kernels do one position at a time with no tensor cores: the path for short calls
(decoding) and for key heads wider than the chunked kernels take (:mod:`.chunk`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cakeops.ops import gated_delta_rule as spec
from cakeops_triton._common import (
    INTERPRET,
    multiprocessors,
    round_to,
    serialised,
    unit_stride_rows,
    untuned,
)

#: Steps between stored states in the backward's first pass, and per recomputed stretch
#: (``L / CHUNK + CHUNK`` states per program, least near ``CHUNK = sqrt(L)``); 4 under the
#: interpreter, so that its short test sequences cross chunks.
CHUNK = 4 if INTERPRET else 64
#: Elements of the float32 ``K x BV`` tiles, which live in registers on 4 warps: about 200 of a
#: thread's registers go to the rest (pointers, strides, a step's vectors), so the forward's
#: one state tile gets 16 a thread and the backward's five tiles 2 each. Wider ones spill on
#: sm_80 or sm_90 at head size 64 or 128 (``nox -s gpu_compile`` sweeps 64 to 256).
FORWARD_TILE = 2048
BACKWARD_TILE = 256
WARPS = 4
#: Most programs, and float32 copies of the gradients' sums, per (sequence, value head).
MAX_SPLITS = 4
EPS: tl.constexpr = tl.constexpr(spec.L2NORM_EPS)


@triton.jit
def _sequence(CU, pid, Hv, GROUP, L, PACKED):
    """Program ``pid``'s ``(value head, sequence, key head, row, first, end)``: a batch row,
    or (``PACKED``) one of the packed sequences of row 0."""
    hv = pid % Hv
    seq = pid // Hv
    n, first, end = seq, seq * 0, seq * 0 + L
    if PACKED:
        n, first, end = seq * 0, tl.load(CU + seq), tl.load(CU + seq + 1)
    return hv, seq, hv // GROUP, n, first, end


def _delta_forward(
    Q, K_, V_, G, BETA, O, INIT, FINAL, STATES, CU, OFFSETS,
    L, Hv, GROUP, K, V, SCALE,
    sq_n, sq_h, sq_l, sk_n, sk_h, sk_l, sv_n, sv_h, sv_l, sg_n, sg_h, sg_l, sg_k,
    sb_n, sb_h, sb_l, si_s, si_h, si_k, si_v,
    HAS_INIT, HAS_FINAL, PACKED, L2NORM, SAVE,
    CHUNK_: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """The outputs and the final states; with ``SAVE`` instead of the outputs, the state at
    the start of every chunk (``STATES`` ``(slots, Hv, K, V)`` float32)."""
    pid = tl.program_id(0).to(tl.int64)
    hv, seq, h, n, first, end = _sequence(CU, pid, Hv, GROUP, L, PACKED)
    kk = tl.arange(0, BK)
    vv = tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = kk < K, vv < V
    kv = kk[:, None] * V + vv[None, :]
    mkv = mk[:, None] & mv[None, :]
    q_row = Q + n * sq_n + h * sq_h
    k_row = K_ + n * sk_n + h * sk_h
    v_row = V_ + n * sv_n + hv * sv_h + vv
    g_row = G + n * sg_n + hv * sg_h
    b_row = BETA + n * sb_n + hv * sb_h
    o_row = O + (n * Hv + hv) * L * V + vv
    if HAS_INIT:
        init = INIT + seq * si_s + hv * si_h + kk[:, None] * si_k + vv[None, :] * si_v
        S = tl.load(init, mask=mkv, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BK, BV), dtype=tl.float32)
    for c in range(0, tl.cdiv(end - first, CHUNK_)):
        start = first + c * CHUNK_
        if SAVE:
            slot = seq * tl.cdiv(L, CHUNK_) + c
            if PACKED:
                slot = tl.load(OFFSETS + seq) + c
            tl.store(STATES + (slot * Hv + hv) * K * V + kv, S, mask=mkv)
        for t in range(start, tl.minimum(start + CHUNK_, end)):
            # (the steps are written out, not helper calls: the interpreter pays for each call)
            k = tl.load(k_row + t * sk_l + kk, mask=mk, other=0.0).to(tl.float32)
            if L2NORM:
                k = k / tl.sqrt(tl.sum(k * k, axis=0) + EPS)
            v = tl.load(v_row + t * sv_l, mask=mv, other=0.0).to(tl.float32)
            beta = tl.load(b_row + t * sb_l).to(tl.float32)
            a = tl.exp(tl.load(g_row + t * sg_l + kk * sg_k, mask=mk, other=0.0).to(tl.float32))
            S = S * a[:, None]
            u = beta * (v - tl.sum(S * k[:, None], axis=0))
            S += k[:, None] * u[None, :]
            if SAVE == 0:
                q = tl.load(q_row + t * sq_l + kk, mask=mk, other=0.0).to(tl.float32)
                if L2NORM:
                    q = q / tl.sqrt(tl.sum(q * q, axis=0) + EPS)
                o = tl.sum(S * q[:, None], axis=0) * SCALE
                tl.store(o_row + t * V, round_to(o, O.dtype.element_ty), mask=mv)
    if HAS_FINAL:
        tl.store(FINAL + (seq * Hv + hv) * K * V + kv, S, mask=mkv)


def _delta_backward(
    Q, K_, V_, G, BETA, DO, DFINAL, STATES, SCRATCH, CU, OFFSETS,
    DQ, DK, DV, DG, DB, DINIT,
    N, L, Hv, GROUP, K, V, SCALE, BLOCKS,
    sq_n, sq_h, sq_l, sk_n, sk_h, sk_l, sv_n, sv_h, sv_l, sg_n, sg_h, sg_l, sg_k,
    sb_n, sb_h, sb_l, sd_n, sd_h, sd_l, sd_v, sf_s, sf_h, sf_k, sf_v,
    HAS_DFINAL, HAS_DINIT, PACKED, L2NORM, KDA,
    CHUNK_: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """The gradients, walking back. Program ``(sequence x value head, split)`` takes the
    blocks of value columns ``split, split + splits, ...`` one after the other, adding its
    sums over their columns into its rows of ``DQ``, ``DK`` ``(splits, N, Hv, L, K)``, ``DG``
    ``(splits, N, Hv, L[, K])`` and ``DB`` ``(splits, N, Hv, L)`` (float32, zeros at first):
    the same order whatever the hardware. ``DV`` and ``DINIT`` are written per column."""
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    splits = tl.num_programs(1)
    hv, seq, h, n, first, end = _sequence(CU, pid, Hv, GROUP, L, PACKED)
    kk = tl.arange(0, BK)
    mk = kk < K
    q_row = Q + n * sq_n + h * sq_h
    k_row = K_ + n * sk_n + h * sk_h
    g_row = G + n * sg_n + hv * sg_h
    b_row = BETA + n * sb_n + hv * sb_h
    rows = (split * N + n) * Hv + hv  # the sums' row: (split, n, hv)
    dq_row = DQ + rows * L * K + kk
    dk_row = DK + rows * L * K + kk
    db_row = DB + rows * L
    # dg per key row (KDA), or one sum per step that the first lane writes
    dg_step = 1 + (K - 1) * KDA
    dg_row = DG + rows * L * dg_step + kk * KDA
    dg_lanes = mk & ((kk == 0) | (KDA != 0))
    scratch = SCRATCH + (pid * splits + split) * CHUNK_ * BK * BV
    tile = kk[:, None] * BV + tl.arange(0, BV)[None, :]
    chunks = tl.cdiv(end - first, CHUNK_)
    for block in range(split, BLOCKS, splits):
        vv = block * BV + tl.arange(0, BV)
        mv = vv < V
        mkv = mk[:, None] & mv[None, :]
        v_row = V_ + n * sv_n + hv * sv_h + vv
        do_row = DO + n * sd_n + hv * sd_h + vv * sd_v
        dv_row = DV + (n * Hv + hv) * L * V + vv
        dS = tl.zeros((BK, BV), dtype=tl.float32)
        if HAS_DFINAL:
            dfin = DFINAL + seq * sf_s + hv * sf_h + kk[:, None] * sf_k + vv[None, :] * sf_v
            dS = tl.load(dfin, mask=mkv, other=0.0).to(tl.float32)
        for i in range(0, chunks):
            c = chunks - 1 - i
            start = first + c * CHUNK_
            stop = tl.minimum(start + CHUNK_, end)
            slot = seq * tl.cdiv(L, CHUNK_) + c
            if PACKED:
                slot = tl.load(OFFSETS + seq) + c
            states = STATES + (slot * Hv + hv) * K * V
            S = tl.load(states + kk[:, None] * V + vv[None, :], mask=mkv, other=0.0)
            # the chunk's states S_{t-1}, recomputed into the scratch
            for t in range(start, stop):
                tl.store(scratch + (t - start) * BK * BV + tile, S)
                k = tl.load(k_row + t * sk_l + kk, mask=mk, other=0.0).to(tl.float32)
                if L2NORM:
                    k = k / tl.sqrt(tl.sum(k * k, axis=0) + EPS)
                v = tl.load(v_row + t * sv_l, mask=mv, other=0.0).to(tl.float32)
                beta = tl.load(b_row + t * sb_l).to(tl.float32)
                a = tl.load(g_row + t * sg_l + kk * sg_k, mask=mk, other=0.0).to(tl.float32)
                S = S * tl.exp(a)[:, None]
                S += k[:, None] * (beta * (v - tl.sum(S * k[:, None], axis=0)))[None, :]
            tl.debug_barrier()  # the scratch, written by every thread, read back by every one
            for j in range(0, stop - start):
                t = stop - 1 - j
                prev = tl.load(scratch + (t - start) * BK * BV + tile)
                # the sums so far (earlier blocks of this program): loaded by every thread
                # that holds a copy before any of them stores (the barrier below)
                dq_sum = tl.load(dq_row + t * K, mask=mk)
                dk_sum = tl.load(dk_row + t * K, mask=mk)
                dg_sum = tl.load(dg_row + t * dg_step, mask=dg_lanes)
                db_sum = tl.load(db_row + t)
                k = tl.load(k_row + t * sk_l + kk, mask=mk, other=0.0).to(tl.float32)
                q = tl.load(q_row + t * sq_l + kk, mask=mk, other=0.0).to(tl.float32)
                rk = tl.full((), 1.0, tl.float32)
                rq = tl.full((), 1.0, tl.float32)
                if L2NORM:
                    rk = 1.0 / tl.sqrt(tl.sum(k * k, axis=0) + EPS)
                    rq = 1.0 / tl.sqrt(tl.sum(q * q, axis=0) + EPS)
                    k, q = k * rk, q * rq
                v = tl.load(v_row + t * sv_l, mask=mv, other=0.0).to(tl.float32)
                do = tl.load(do_row + t * sd_l, mask=mv, other=0.0).to(tl.float32)
                beta = tl.load(b_row + t * sb_l).to(tl.float32)
                a = tl.load(g_row + t * sg_l + kk * sg_k, mask=mk, other=0.0).to(tl.float32)
                a = tl.exp(a)[:, None]
                decayed = prev * a
                r = v - tl.sum(decayed * k[:, None], axis=0)
                u = beta * r
                S = decayed + k[:, None] * u[None, :]
                # o_t = scale S_t^T q_t
                dS += SCALE * q[:, None] * do[None, :]
                dq = SCALE * tl.sum(S * do[None, :], axis=1)
                # S_t = decayed + k u^T, u = beta (v - decayed^T k)
                du = tl.sum(dS * k[:, None], axis=0)
                tl.store(dv_row + t * V, round_to(beta * du, DV.dtype.element_ty), mask=mv)
                db = tl.sum(tl.where(mv, du * r, 0.0), axis=0)
                dp = -beta * du
                dk = tl.sum(dS * u[None, :], axis=1) + tl.sum(decayed * dp[None, :], axis=1)
                d_decayed = dS + k[:, None] * dp[None, :]
                # decayed = exp(g_t) S_{t-1}: per key row (KDA) or summed
                dg = tl.sum(d_decayed * decayed, axis=1)
                if KDA == 0:
                    dg = tl.zeros_like(dg) + tl.sum(dg, axis=0)
                dS = d_decayed * a
                if L2NORM:  # through x / |x|: (dx - x^ (x^ . dx)) / |x|
                    dq = rq * (dq - q * tl.sum(q * dq, axis=0))
                    dk = rk * (dk - k * tl.sum(k * dk, axis=0))
                tl.debug_barrier()
                tl.store(dq_row + t * K, dq_sum + dq, mask=mk)
                tl.store(dk_row + t * K, dk_sum + dk, mask=mk)
                tl.store(dg_row + t * dg_step, dg_sum + dg, mask=dg_lanes)
                tl.store(db_row + t, db_sum + db)
            tl.debug_barrier()  # read back before the next chunk overwrites it
        if HAS_DINIT:
            d_init = DINIT + (seq * Hv + hv) * K * V + kk[:, None] * V + vv[None, :]
            tl.store(d_init, dS, mask=mkv)


# One binary per dtype and tile: no specialisation on sizes, strides or flags (the flags are
# uniform branches, a step's work dwarfs them).
_delta_forward = untuned(_delta_forward)
_delta_backward = untuned(_delta_backward)


def _block_v(K: int, V: int, tile: int) -> tuple[int, int]:
    """``(BK, BV)``: the key rows whole, value columns so that a tile holds ``tile``."""
    bk = max(16, triton.next_power_of_2(K))
    return bk, max(1, min(triton.next_power_of_2(V), tile // bk))


def _sequences(q, cu_seqlens) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1


def gate_strides(g: torch.Tensor) -> tuple[int, ...]:
    """``g``'s strides over ``(N, Hv, L, K)``: a scalar gate's over the key columns is 0 (one
    gate read for every key row)."""
    return (*g.stride()[:3], g.stride(3) if g.dim() == 4 else 0)


def _common(q, k, v, g, beta, cu_seqlens):
    """The arguments both kernels take first: the tensors, the packed sequences' offsets and
    where their stored states start (int64; unused placeholders unpacked), the strides (a gate
    per step is a KDA gate of stride 0 over the key rows), the sizes and the slots."""
    q, k, v = unit_stride_rows(q), unit_stride_rows(k), unit_stride_rows(v)
    g = unit_stride_rows(g) if g.dim() == 4 else g  # a KDA gate's rows; a (N, H, L) gate as is
    N, H, L, K = q.shape
    Hv, V = v.shape[1], v.shape[3]
    if cu_seqlens is None:
        cu = offsets = torch.empty(1, dtype=torch.int64, device=q.device)
        slots = N * triton.cdiv(L, CHUNK)
    else:
        cu = cu_seqlens.to(torch.int64).contiguous()
        counts = torch.div(cu[1:] - cu[:-1] + CHUNK - 1, CHUNK, rounding_mode="floor")
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        # at most L / CHUNK plus one per sequence: no host synchronisation
        slots = L // CHUNK + cu.numel()
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *gate_strides(g), *beta.stride())
    return (q, k, v, g, beta), cu, offsets, strides, (N, H, L, K, Hv, V), max(slots, 1)


def _forward(prepared, q, scale, initial_state, cu_seqlens, use_qk_l2norm, save: bool,
             want_final: bool):  # fmt: skip
    """``(out or None, final or None, stored states or None)``; ``prepared``: :func:`_common`'s."""
    tensors, cu, offsets, strides, sizes, slots = prepared
    N, H, L, K, Hv, V = sizes
    sequences = _sequences(q, cu_seqlens)
    f32 = {"dtype": torch.float32, "device": q.device}
    unused = torch.empty(0, **f32)
    out = None if save else torch.empty((N, Hv, L, V), dtype=q.dtype, device=q.device)
    final = torch.empty((sequences, Hv, K, V), **f32) if want_final else None
    states = torch.empty((slots, Hv, K, V), **f32) if save else None
    bk, bv = _block_v(K, V, FORWARD_TILE)
    init = initial_state
    init_strides = init.stride() if init is not None else (0, 0, 0, 0)
    _delta_forward[(sequences * Hv, triton.cdiv(V, bv))](
        *tensors, q if out is None else out, unused if init is None else init,
        unused if final is None else final, unused if states is None else states, cu, offsets,
        L, Hv, Hv // H, K, V, float(scale), *strides, *init_strides,
        int(init is not None), int(want_final), int(cu_seqlens is not None),
        int(use_qk_l2norm), int(save), CHUNK_=CHUNK, BK=bk, BV=bv, num_warps=WARPS, num_stages=1,
    )  # fmt: skip
    return out, final, states


@serialised
def forward(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
            cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    prepared = _common(q, k, v, g, beta, cu_seqlens)
    out, final, _ = _forward(prepared, q, scale, initial_state, cu_seqlens, use_qk_l2norm,
                             save=False, want_final=output_final_state)  # fmt: skip
    if final is None:
        return out, q.new_empty(0)
    return out, final.to(initial_state.dtype if initial_state is not None else torch.float32)


@serialised
def backward(g_out, g_final, q, k, v, g, beta, scale, initial_state=None,
             output_final_state=False, cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    prepared = _common(q, k, v, g, beta, cu_seqlens)  # once for both kernels
    _, _, states = _forward(prepared, q, scale, initial_state, cu_seqlens, use_qk_l2norm,
                            save=True, want_final=False)  # fmt: skip
    tensors, cu, offsets, strides, sizes, _ = prepared
    N, H, L, K, Hv, V = sizes
    sequences = _sequences(q, cu_seqlens)
    bk, bv = _block_v(K, V, BACKWARD_TILE)
    blocks = triton.cdiv(V, bv)
    # Blocks of columns in parallel only while the (sequence, value head) pairs leave the
    # multiprocessors idle: each split is a float32 copy of the sums (deterministic; no atomics).
    splits = max(1, min(blocks, MAX_SPLITS, -(-2 * multiprocessors(q.device) // (sequences * Hv))))
    f32 = {"dtype": torch.float32, "device": q.device}
    kda = g.dim() == 4
    dq, dk = (torch.zeros((splits, N, Hv, L, K), **f32) for _ in range(2))
    dg = torch.zeros((splits, N, Hv, L, *((K,) if kda else ())), **f32)
    db = torch.zeros((splits, N, Hv, L), **f32)
    dv = torch.empty((N, Hv, L, V), dtype=v.dtype, device=q.device)
    d_init = torch.empty((sequences, Hv, K, V), **f32)  # what reaches each starting state
    has_dfinal = output_final_state and g_final.numel() > 0
    d_final = g_final if has_dfinal else d_init
    scratch = torch.empty((sequences * Hv * splits, CHUNK, bk, bv), **f32)
    _delta_backward[(sequences * Hv, splits)](
        *tensors, g_out, d_final, states, scratch, cu, offsets, dq, dk, dv, dg, db, d_init,
        N, L, Hv, Hv // H, K, V, float(scale), blocks, *strides, *g_out.stride(),
        *(d_final.stride() if has_dfinal else (0, 0, 0, 0)), int(has_dfinal),
        int(initial_state is not None), int(cu_seqlens is not None), int(use_qk_l2norm),
        int(kda), CHUNK_=CHUNK, BK=bk, BV=bv, num_warps=WARPS, num_stages=1,
    )  # fmt: skip
    # blocks of value columns, and value heads that share a key head, added up
    dq = dq.view(splits, N, H, Hv // H, L, K).sum((0, 3))
    dk = dk.view(splits, N, H, Hv // H, L, K).sum((0, 3))
    dg = dg.sum(0)
    return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype), db.sum(0).to(beta.dtype),
            None if initial_state is None else d_init.to(initial_state.dtype))  # fmt: skip
