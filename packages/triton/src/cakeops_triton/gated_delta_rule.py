"""The gated delta rule (and KDA) in Triton, step by step with the state in registers.

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

These kernels do one position at a time with no tensor cores: correct everywhere, and the
path for short calls (decoding), not yet the chunked tensor-core form long training sequences
want (see the op's page).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cakeops.ops.gated_delta_rule import L2NORM_EPS
from cakeops_triton._common import INTERPRET, round_to, serialised

#: Steps between stored states in the backward's first pass, and per recomputed stretch
#: (``L / CHUNK + CHUNK`` states per program, least near ``CHUNK = sqrt(L)``); 4 under the
#: interpreter, so that its short test sequences cross chunks.
CHUNK = 4 if INTERPRET else 64
#: The float32 ``K x BV`` tiles live in registers: elements per tile on 4 warps (32 a thread
#: forward, where the state is the one tile; 16 backward, which holds about five at once).
FORWARD_TILE = 4096
BACKWARD_TILE = 2048
WARPS = 4


@triton.jit
def _bounds(CU, seq, L, PACKED: tl.constexpr):
    """``(row, first, end)`` of the program's sequence."""
    if PACKED:
        return seq * 0, tl.load(CU + seq).to(tl.int64), tl.load(CU + seq + 1).to(tl.int64)
    return seq, seq * 0, seq * 0 + L


@triton.jit
def _slot(OFFSETS, seq, c, L, CHUNK_: tl.constexpr, PACKED: tl.constexpr):
    """The index of the stored state of the sequence's chunk ``c``."""
    if PACKED:
        return tl.load(OFFSETS + seq).to(tl.int64) + c
    return seq * tl.cdiv(L, CHUNK_) + c


@triton.jit
def _forward_kernel(
    Q, K_, V_, G, BETA, O, INIT, FINAL, STATES, CU, OFFSETS,
    L, Hv, GROUP, K, V, SCALE,
    sq_n, sq_h, sq_l, sk_n, sk_h, sk_l, sv_n, sv_h, sv_l, sg_n, sg_h, sg_l, sb_n, sb_h, sb_l,
    si_s, si_h, si_k, si_v,
    KDA: tl.constexpr, HAS_INIT: tl.constexpr, HAS_FINAL: tl.constexpr, PACKED: tl.constexpr,
    L2NORM: tl.constexpr, SAVE: tl.constexpr, CHUNK_: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """The outputs and the final states; with ``SAVE`` instead of the outputs, the state at
    the start of every chunk (``STATES`` ``(slots, Hv, K, V)`` float32)."""
    pid = tl.program_id(0).to(tl.int64)
    hv = pid % Hv
    seq = pid // Hv
    h = hv // GROUP
    n, first, end = _bounds(CU, seq, L, PACKED)
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
            slot = _slot(OFFSETS, seq, c, L, CHUNK_, PACKED)
            tl.store(STATES + (slot * Hv + hv) * K * V + kv, S, mask=mkv)
        for t in range(start, tl.minimum(start + CHUNK_, end)):
            # (the steps are written out, not helper calls: the interpreter pays for each call)
            k = tl.load(k_row + t * sk_l + kk, mask=mk, other=0.0).to(tl.float32)
            if L2NORM:
                k = k / tl.sqrt(tl.sum(k * k, axis=0) + L2NORM_EPS)
            v = tl.load(v_row + t * sv_l, mask=mv, other=0.0).to(tl.float32)
            beta = tl.load(b_row + t * sb_l).to(tl.float32)
            if KDA:
                S = S * tl.exp(tl.load(g_row + t * sg_l + kk, mask=mk, other=0.0).to(tl.float32))[:, None]
            else:
                S = S * tl.exp(tl.load(g_row + t * sg_l).to(tl.float32))
            u = beta * (v - tl.sum(S * k[:, None], axis=0))
            S += k[:, None] * u[None, :]
            if not SAVE:
                q = tl.load(q_row + t * sq_l + kk, mask=mk, other=0.0).to(tl.float32)
                if L2NORM:
                    q = q / tl.sqrt(tl.sum(q * q, axis=0) + L2NORM_EPS)
                o = tl.sum(S * q[:, None], axis=0) * SCALE
                tl.store(o_row + t * V, round_to(o, O.dtype.element_ty), mask=mv)
    if HAS_FINAL:
        tl.store(FINAL + (seq * Hv + hv) * K * V + kv, S, mask=mkv)


@triton.jit
def _backward_kernel(
    Q, K_, V_, G, BETA, DO, DFINAL, STATES, SCRATCH, CU, OFFSETS,
    DQ, DK, DV, DG, DB, DINIT,
    N, L, Hv, GROUP, K, V, SCALE,
    sq_n, sq_h, sq_l, sk_n, sk_h, sk_l, sv_n, sv_h, sv_l, sg_n, sg_h, sg_l, sb_n, sb_h, sb_l,
    sd_n, sd_h, sd_l, sd_v, sf_s, sf_h, sf_k, sf_v,
    KDA: tl.constexpr, HAS_DFINAL: tl.constexpr, HAS_DINIT: tl.constexpr,
    PACKED: tl.constexpr, L2NORM: tl.constexpr, CHUNK_: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """The gradients, walking back. ``DQ``, ``DK`` ``(blocks, N, Hv, L, K)``, ``DG``
    ``(blocks, N, Hv, L[, K])`` and ``DB`` ``(blocks, N, Hv, L)`` are float32 partial sums
    per block of value columns; ``DV`` ``(N, Hv, L, V)`` and ``DINIT`` ``(S, Hv, K, V)`` whole."""
    pid = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    hv = pid % Hv
    seq = pid // Hv
    h = hv // GROUP
    n, first, end = _bounds(CU, seq, L, PACKED)
    kk = tl.arange(0, BK)
    vv = block * BV + tl.arange(0, BV)
    mk, mv = kk < K, vv < V
    mkv = mk[:, None] & mv[None, :]
    q_row = Q + n * sq_n + h * sq_h
    k_row = K_ + n * sk_n + h * sk_h
    v_row = V_ + n * sv_n + hv * sv_h + vv
    g_row = G + n * sg_n + hv * sg_h
    b_row = BETA + n * sb_n + hv * sb_h
    do_row = DO + n * sd_n + hv * sd_h + vv * sd_v
    rows = (block * N + n) * Hv + hv  # the partial sums' row: (block, n, hv)
    dq_row = DQ + rows * L * K + kk
    dk_row = DK + rows * L * K + kk
    dv_row = DV + (n * Hv + hv) * L * V + vv
    db_row = DB + rows * L
    if KDA:
        dg_row = DG + rows * L * K + kk
    else:
        dg_row = DG + rows * L
    scratch = SCRATCH + (pid * tl.num_programs(1) + block) * CHUNK_ * BK * BV
    tile = kk[:, None] * BV + tl.arange(0, BV)[None, :]
    if HAS_DFINAL:
        dfin = DFINAL + seq * sf_s + hv * sf_h + kk[:, None] * sf_k + vv[None, :] * sf_v
        dS = tl.load(dfin, mask=mkv, other=0.0).to(tl.float32)
    else:
        dS = tl.zeros((BK, BV), dtype=tl.float32)
    chunks = tl.cdiv(end - first, CHUNK_)
    for i in range(0, chunks):
        c = chunks - 1 - i
        start = first + c * CHUNK_
        stop = tl.minimum(start + CHUNK_, end)
        slot = _slot(OFFSETS, seq, c, L, CHUNK_, PACKED)
        states = STATES + (slot * Hv + hv) * K * V
        S = tl.load(states + kk[:, None] * V + vv[None, :], mask=mkv, other=0.0)
        # the chunk's states S_{t-1}, recomputed into the scratch
        for t in range(start, stop):
            tl.store(scratch + (t - start) * BK * BV + tile, S)
            k = tl.load(k_row + t * sk_l + kk, mask=mk, other=0.0).to(tl.float32)
            if L2NORM:
                k = k / tl.sqrt(tl.sum(k * k, axis=0) + L2NORM_EPS)
            v = tl.load(v_row + t * sv_l, mask=mv, other=0.0).to(tl.float32)
            beta = tl.load(b_row + t * sb_l).to(tl.float32)
            if KDA:
                S = S * tl.exp(tl.load(g_row + t * sg_l + kk, mask=mk, other=0.0).to(tl.float32))[:, None]
            else:
                S = S * tl.exp(tl.load(g_row + t * sg_l).to(tl.float32))
            S += k[:, None] * (beta * (v - tl.sum(S * k[:, None], axis=0)))[None, :]
        tl.debug_barrier()  # the scratch, written by every thread, read back by every thread
        for j in range(0, stop - start):
            t = stop - 1 - j
            prev = tl.load(scratch + (t - start) * BK * BV + tile)
            k = tl.load(k_row + t * sk_l + kk, mask=mk, other=0.0).to(tl.float32)
            q = tl.load(q_row + t * sq_l + kk, mask=mk, other=0.0).to(tl.float32)
            if L2NORM:
                rk = 1.0 / tl.sqrt(tl.sum(k * k, axis=0) + L2NORM_EPS)
                rq = 1.0 / tl.sqrt(tl.sum(q * q, axis=0) + L2NORM_EPS)
                k, q = k * rk, q * rq
            v = tl.load(v_row + t * sv_l, mask=mv, other=0.0).to(tl.float32)
            do = tl.load(do_row + t * sd_l, mask=mv, other=0.0).to(tl.float32)
            beta = tl.load(b_row + t * sb_l).to(tl.float32)
            if KDA:
                a = tl.exp(tl.load(g_row + t * sg_l + kk, mask=mk, other=0.0).to(tl.float32))[:, None]
            else:
                a = tl.exp(tl.load(g_row + t * sg_l).to(tl.float32))
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
            tl.store(db_row + t, tl.sum(tl.where(mv, du * r, 0.0), axis=0))
            dp = -beta * du
            dk = tl.sum(dS * u[None, :], axis=1) + tl.sum(decayed * dp[None, :], axis=1)
            d_decayed = dS + k[:, None] * dp[None, :]
            # decayed = exp(g_t) S_{t-1}
            if KDA:
                tl.store(dg_row + t * K, tl.sum(d_decayed * decayed, axis=1), mask=mk)
            else:
                tl.store(dg_row + t, tl.sum(tl.sum(d_decayed * decayed, axis=1), axis=0))
            dS = d_decayed * a
            if L2NORM:  # through x / |x|: (dx - x^ (x^ . dx)) / |x|
                dq = rq * (dq - q * tl.sum(q * dq, axis=0))
                dk = rk * (dk - k * tl.sum(k * dk, axis=0))
            tl.store(dq_row + t * K, dq, mask=mk)
            tl.store(dk_row + t * K, dk, mask=mk)
        tl.debug_barrier()  # read back before the next chunk overwrites it
    if HAS_DINIT:
        tl.store(DINIT + (seq * Hv + hv) * K * V + kk[:, None] * V + vv[None, :], dS, mask=mkv)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous last dim (a copy only when it has none)."""
    return t if t.dim() < 4 or t.stride(-1) == 1 else t.contiguous()


def _block_v(K: int, V: int, tile: int) -> tuple[int, int]:
    """``(BK, BV)``: the key rows whole, value columns so that a tile holds ``tile``."""
    bk = max(16, triton.next_power_of_2(K))
    return bk, max(1, min(triton.next_power_of_2(V), tile // bk))


def _sequences(q, cu_seqlens) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1


def _offsets(cu_seqlens, L: int) -> tuple[torch.Tensor | None, int]:
    """Where each packed sequence's stored states start, and how many slots there are (at
    most ``L / CHUNK`` plus one per sequence: no host synchronisation)."""
    if cu_seqlens is None:
        return None, 0
    counts = torch.div(cu_seqlens[1:] - cu_seqlens[:-1] + CHUNK - 1, CHUNK, rounding_mode="floor")
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return offsets, L // CHUNK + cu_seqlens.numel()


def _common(q, k, v, g, beta, cu_seqlens):
    """The arguments both kernels take first, and their strides."""
    q, k, v, g = _rows(q), _rows(k), _rows(v), _rows(g)
    N, H, L, K = q.shape
    Hv, V = v.shape[1], v.shape[3]
    cu = None if cu_seqlens is None else cu_seqlens.contiguous()
    offsets, _ = _offsets(cu, L)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride()[:3],
               *beta.stride())  # fmt: skip
    return (q, k, v, g, beta), cu, offsets, strides, (N, H, L, K, Hv, V)


def _forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, save: bool,
             want_final: bool):  # fmt: skip
    """``(out or None, final or None, stored states or None)``."""
    tensors, cu, offsets, strides, (N, H, L, K, Hv, V) = _common(q, k, v, g, beta, cu_seqlens)
    sequences = _sequences(q, cu_seqlens)
    f32 = {"dtype": torch.float32, "device": q.device}
    out = None if save else torch.empty((N, Hv, L, V), dtype=q.dtype, device=q.device)
    final = torch.empty((sequences, Hv, K, V), **f32) if want_final else None
    states = None
    if save:
        slots = N * triton.cdiv(L, CHUNK) if cu is None else _offsets(cu, L)[1]
        states = torch.empty((max(slots, 1), Hv, K, V), **f32)
    bk, bv = _block_v(K, V, FORWARD_TILE)
    any_ = tensors[0]
    init_strides = initial_state.stride() if initial_state is not None else (0, 0, 0, 0)
    _forward_kernel[(sequences * Hv, triton.cdiv(V, bv))](
        *tensors, any_ if out is None else out,
        any_ if initial_state is None else initial_state, any_ if final is None else final,
        any_ if states is None else states, any_ if cu is None else cu,
        any_ if offsets is None else offsets,
        L, Hv, Hv // H, K, V, float(scale), *strides, *init_strides,
        KDA=g.dim() == 4, HAS_INIT=initial_state is not None, HAS_FINAL=want_final,
        PACKED=cu is not None, L2NORM=use_qk_l2norm, SAVE=save, CHUNK_=CHUNK, BK=bk, BV=bv,
        num_warps=WARPS,
    )  # fmt: skip
    return out, final, states


@serialised
def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    out, final, _ = _forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm,
                             save=False, want_final=output_final_state)  # fmt: skip
    if final is None:
        return out, q.new_empty(0)
    return out, final.to(initial_state.dtype if initial_state is not None else torch.float32)


@serialised
def backward(g_out, g_final, q, k, v, g, beta, scale=None, initial_state=None,
             output_final_state=False, cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    _, _, states = _forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm,
                            save=True, want_final=False)  # fmt: skip
    tensors, cu, offsets, strides, (N, H, L, K, Hv, V) = _common(q, k, v, g, beta, cu_seqlens)
    sequences = _sequences(q, cu_seqlens)
    bk, bv = _block_v(K, V, BACKWARD_TILE)
    blocks = triton.cdiv(V, bv)
    f32 = {"dtype": torch.float32, "device": q.device}
    kda = g.dim() == 4
    dq = torch.empty((blocks, N, Hv, L, K), **f32)
    dk = torch.empty((blocks, N, Hv, L, K), **f32)
    dv = torch.empty((N, Hv, L, V), dtype=v.dtype, device=q.device)
    dg = torch.empty((blocks, N, Hv, L, *((K,) if kda else ())), **f32)
    db = torch.empty((blocks, N, Hv, L), **f32)
    d_init = None if initial_state is None else torch.empty((sequences, Hv, K, V), **f32)
    has_dfinal = output_final_state and g_final.numel() > 0
    scratch = torch.empty((sequences * Hv * blocks, CHUNK, bk, bv), **f32)
    fin_strides = g_final.stride() if has_dfinal else (0, 0, 0, 0)
    _backward_kernel[(sequences * Hv, blocks)](
        *tensors, g_out, g_final if has_dfinal else g_out, states, scratch,
        g_out if cu is None else cu, g_out if offsets is None else offsets,
        dq, dk, dv, dg, db, g_out if d_init is None else d_init,
        N, L, Hv, Hv // H, K, V, float(scale), *strides, *g_out.stride(), *fin_strides,
        KDA=kda, HAS_DFINAL=has_dfinal, HAS_DINIT=d_init is not None, PACKED=cu is not None,
        L2NORM=use_qk_l2norm, CHUNK_=CHUNK, BK=bk, BV=bv, num_warps=WARPS,
    )  # fmt: skip
    # value heads sharing a key head, and blocks of value columns, added up
    dq = dq.view(blocks, N, H, Hv // H, L, K).sum((0, 3))
    dk = dk.view(blocks, N, H, Hv // H, L, K).sum((0, 3))
    dg, db = dg.sum(0), db.sum(0)
    return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype), db.to(beta.dtype),
            None if d_init is None else d_init.to(initial_state.dtype))  # fmt: skip
