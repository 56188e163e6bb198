"""The gated delta rule's forward over chunks, on tensor cores (scalar gates; KDA's per-channel
gates take the step kernels, :mod:`.fused_recurrent`).

Within a chunk of ``C`` positions that starts from the state ``S0``, with ``E_tj`` the sum of
the log gates over the steps ``(j, t]``, ``Gamma_t`` over ``[first, t]`` and ``Gc_t`` over
``(t, last]`` (the torch backend's UT/WY form)::

    A_tj = beta_t (k_t . k_j) exp(E_tj)  (j < t)     T = (I + A)^{-1}
    W = T diag(beta Gamma) K      U~ = T diag(beta) V       (independent of S0)
    U = U~ - W S0                 S_C = Gamma_C S0 + (Gc K)^T U
    O = scale ((Gamma Q) S0 + (Q K^T o exp(E), j <= t) U)

Three launches: :func:`_chunk_wy` forms ``W`` and ``U~`` for every chunk at once, in parallel;
:func:`_chunk_states` walks each sequence's chunks in order, one ``S0 -> S_C`` per chunk
(``U`` written over ``U~``, each chunk's ``S0`` stored); :func:`_chunk_output` forms every
chunk's outputs at once. ``K K^T`` and the outputs' products are ``tl.dot`` s in the inputs'
dtype with float32 accumulation (tensor cores for 16-bit inputs); ``T`` is solved in float32,
row by row; ``W``, ``U`` and the states' products stay float32 (the final state meets float32's
tolerance, as the recurrence's does: on tensor cores as three TF32 products for 16-bit
inputs), and each chunk's starting state is stored in the inputs' dtype, which is what the
outputs' products read. Every gate factor is the ``exp`` of a sum of log gates over the steps it
spans, a cumulative sum within the chunk: never the ``exp`` of a positive number or of a
difference of running sums, so a gate of ``-inf`` is an exact reset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cakeops_triton._common import (
    INTERPRET,
    dot,
    dot_precision,
    round_to,
    serialised,
    unit_stride_rows,
    untuned,
)

from .fused_recurrent import EPS

#: Positions per chunk: 64 on a GPU (the tensor-core products' M and K); 4 under the
#: interpreter, so that the suite's short sequences (12 positions) cross chunks.
CHUNK = 4 if INTERPRET else 32
#: Value columns per program of the outputs, and of the states' walk (whose float32 products,
#: three TF32 products each for 16-bit inputs, hold three times the registers): the widest that
#: compile without spilling at head size 128 on sm_90 and sm_80 (``nox -s gpu_compile``).
BLOCK_V = 32
STATE_BLOCK_V = 16
WARPS = 8
#: The outputs' tiles are small: 4 warps give each thread the registers 8 would cap (8 bytes
#: spilled on sm_80 at head size 64).
OUTPUT_WARPS = 4


@triton.jit
def _slot(SEQ, CU, OFFSETS, s, S, nC, L, C: tl.constexpr, PACKED):
    """Chunk slot ``s``'s ``(batch row, first position, end of its sequence)``: chunk
    ``s % nC`` of row ``s // nC``, or (``PACKED``) a chunk of row 0's packed sequence
    ``SEQ[s]``; a slot past the last sequence's chunks has ``first == end`` (nothing to do)."""
    if PACKED:
        seq = tl.minimum(tl.load(SEQ + s), S - 1)
        first = tl.load(CU + seq) + (s - tl.load(OFFSETS + seq)) * C
        end = tl.load(CU + seq + 1)
        end = tl.where(tl.load(SEQ + s) < S, end, first)
        return seq * 0, first, end
    return s // nC, (s % nC) * C, s * 0 + L


@triton.jit
def _causal_dot(a, b, acc, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """``acc + a @ b`` for float32 ``a`` and ``b``, rounded to ``DTYPE`` for the product, ``a``
    lower-triangular (row ``i`` reads the rows ``j <= i`` of ``b``): a non-finite entry of ``b``
    makes its column non-finite from its row on, as the recurrence carries it, and never
    reaches the rows before (which ``0 * NaN`` would)."""
    bad = (b - b) != 0
    reached = tl.cumsum(bad.to(tl.int32), axis=0) > 0
    out = dot(round_to(a, DTYPE), round_to(tl.where(bad, 0.0, b), DTYPE), acc, PRECISION)
    return tl.where(reached, float("nan"), out)


@triton.jit
def _rows(X, n, h, first, end, sn, sh, sl, D, L2NORM,
          C: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """A chunk's ``C x BD`` rows of ``X`` as float32 (zeros past ``end`` and ``D``),
    L2-normalised per row with ``L2NORM``."""
    t = first + tl.arange(0, C)
    d = tl.arange(0, BD)
    x = tl.load(X + n * sn + h * sh + t[:, None] * sl + d[None, :],
                mask=(t < end)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)  # fmt: skip
    if L2NORM:
        x = x / tl.sqrt(tl.sum(x * x, axis=1) + EPS)[:, None]
    return x


@triton.jit
def _gates(G, BETA, n, hv, first, end, sg_n, sg_h, sg_l, sb_n, sb_h, sb_l, C: tl.constexpr):
    """The chunk's log gates and betas (zeros past ``end``), and ``E_tj``, the sum of the log
    gates over ``(j, t]`` (``C x C``, zero on and above the diagonal)."""
    tt = tl.arange(0, C)
    ok = first + tt < end
    g = tl.load(G + n * sg_n + hv * sg_h + (first + tt) * sg_l, mask=ok, other=0.0)
    beta = tl.load(BETA + n * sb_n + hv * sb_h + (first + tt) * sb_l, mask=ok, other=0.0)
    g = g.to(tl.float32)
    e = tl.cumsum(tl.where(tt[:, None] > tt[None, :], g[:, None], 0.0), axis=0)
    return g, beta.to(tl.float32), e


def _chunk_wy(
    K_, V_, G, BETA, W, U, SEQ, CU, OFFSETS,
    S, L, nC, GROUP, K, V,
    sk_n, sk_h, sk_l, sv_n, sv_h, sv_l, sg_n, sg_h, sg_l, sb_n, sb_h, sb_l,
    PACKED, L2NORM, DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Per (chunk slot, value head): ``W = T diag(beta Gamma) K`` and ``U~ = T diag(beta) V``
    into ``W`` ``(slots, Hv, C, K)`` and ``U`` ``(slots, Hv, C, V)`` (float32)."""
    s = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    Hv = tl.num_programs(1)
    n, first, end = _slot(SEQ, CU, OFFSETS, s, S, nC, L, C, PACKED)
    tt = tl.arange(0, C)
    k = _rows(K_, n, hv // GROUP, first, end, sk_n, sk_h, sk_l, K, L2NORM, C, BK)
    g, beta, e = _gates(G, BETA, n, hv, first, end, sg_n, sg_h, sg_l, sb_n, sb_h, sb_l, C)
    kk = dot(round_to(k, DTYPE), tl.trans(round_to(k, DTYPE)),
             tl.zeros((C, C), dtype=tl.float32), PRECISION)  # fmt: skip
    lower = tt[:, None] > tt[None, :]
    a = tl.where(lower, beta[:, None] * kk * tl.exp(e), 0.0)
    # T = (I + A)^{-1}, row by row: T_i = e_i - sum_{j < i} A_ij T_j (rows j >= i still zero)
    t_inv = tl.zeros((C, C), dtype=tl.float32)
    for i in range(0, C):
        a_i = tl.sum(tl.where(tt[:, None] == i, a, 0.0), axis=0)
        row = tl.where(tt == i, 1.0, 0.0) - tl.sum(a_i[:, None] * t_inv, axis=0)
        t_inv = tl.where(tt[:, None] == i, row[None, :], t_inv)
    out = (s * Hv + hv) * C
    kd = tl.arange(0, BK)
    zeros = tl.zeros((C, BK), dtype=tl.float32)
    w = _causal_dot(t_inv, (beta * tl.exp(tl.cumsum(g, axis=0)))[:, None] * k, zeros,
                    tl.float32, "ieee")  # fmt: skip
    tl.store(W + (out + tt[:, None]) * K + kd[None, :], w, mask=(kd < K)[None, :])
    for v0 in range(0, V, BV):
        vd = v0 + tl.arange(0, BV)
        v = tl.load(V_ + n * sv_n + hv * sv_h + (first + tt)[:, None] * sv_l + vd[None, :],
                    mask=(first + tt < end)[:, None] & (vd < V)[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        u = _causal_dot(t_inv, beta[:, None] * v, tl.zeros((C, BV), dtype=tl.float32),
                        tl.float32, "ieee")  # fmt: skip
        tl.store(U + (out + tt[:, None]) * V + vd[None, :], u, mask=(vd < V)[None, :])


def _chunk_states(
    K_, G, W, U, STATES, INIT, FINAL, CU, OFFSETS,
    L, nC, GROUP, K, V,
    sk_n, sk_h, sk_l, sg_n, sg_h, sg_l, si_s, si_h, si_k, si_v,
    HAS_INIT, HAS_FINAL, PACKED, L2NORM, DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    STATE_PRECISION: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Per (sequence, value head, block of value columns), its chunks in order: each chunk's
    starting state stored in ``STATES`` ``(slots, Hv, K, V)`` (the dot dtype),
    ``U = U~ - W S0`` written over ``U~``, then ``S <- Gamma_C S + (Gc K)^T U``; the last state
    into ``FINAL``. The states' products take float32 operands (``STATE_PRECISION``: three
    TF32 products for 16-bit inputs, on tensor cores with float32's accuracy), so that the
    final state meets float32's tolerance whatever the inputs' dtype, as the recurrence's
    does."""
    seq = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    Hv = tl.num_programs(1)
    tt = tl.arange(0, C)
    kd = tl.arange(0, BK)
    vd = tl.program_id(2) * BV + tl.arange(0, BV)
    mkv = (kd < K)[:, None] & (vd < V)[None, :]
    n, first, end, slot0 = seq, seq * 0, seq * 0 + L, seq * nC
    if PACKED:
        n, first, end, slot0 = (
            seq * 0,
            tl.load(CU + seq),
            tl.load(CU + seq + 1),
            tl.load(OFFSETS + seq),
        )
    if HAS_INIT:
        init = INIT + seq * si_s + hv * si_h + kd[:, None] * si_k + vd[None, :] * si_v
        S = tl.load(init, mask=mkv, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BK, BV), dtype=tl.float32)
    for c in range(0, tl.cdiv(end - first, C)):
        slot = slot0 + c
        start = first + c * C
        tl.store(STATES + ((slot * Hv + hv) * K + kd[:, None]) * V + vd[None, :],
                 round_to(S, DTYPE), mask=mkv)  # fmt: skip
        rows = (slot * Hv + hv) * C + tt
        w = tl.load(W + rows[:, None] * K + kd[None, :], mask=(kd < K)[None, :], other=0.0)
        u_at = U + rows[:, None] * V + vd[None, :]
        u = tl.load(u_at, mask=(vd < V)[None, :], other=0.0)
        u = u - tl.dot(w, S, input_precision=STATE_PRECISION)
        tl.store(u_at, u, mask=(vd < V)[None, :])
        # Gc_j: the log gates over (j, last], a reverse cumulative sum of the next steps' gates
        after = start + tt + 1
        g_next = tl.load(G + n * sg_n + hv * sg_h + after * sg_l,
                         mask=(after < end) & (tt + 1 < C), other=0.0).to(tl.float32)  # fmt: skip
        g = tl.load(G + n * sg_n + hv * sg_h + (start + tt) * sg_l, mask=start + tt < end,
                    other=0.0).to(tl.float32)  # fmt: skip
        k = _rows(K_, n, hv // GROUP, start, end, sk_n, sk_h, sk_l, K, L2NORM, C, BK)
        k = tl.exp(tl.cumsum(g_next, axis=0, reverse=True))[:, None] * k
        S = tl.dot(tl.trans(k), u, S * tl.exp(tl.sum(g, axis=0)), input_precision=STATE_PRECISION)
    if HAS_FINAL:
        tl.store(FINAL + ((seq * Hv + hv) * K + kd[:, None]) * V + vd[None, :], S, mask=mkv)


def _chunk_output(
    Q, K_, G, BETA, STATES, U, O, SEQ, CU, OFFSETS,
    S_, L, nC, GROUP, K, V, SCALE,
    sq_n, sq_h, sq_l, sk_n, sk_h, sk_l, sg_n, sg_h, sg_l, sb_n, sb_h, sb_l,
    PACKED, L2NORM, DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Per (chunk slot, value head, block of value columns):
    ``O = scale ((Gamma Q) S0 + (Q K^T o exp(E), j <= t) U)`` into ``O`` ``(N, Hv, L, V)``."""
    s = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    Hv = tl.num_programs(1)
    n, first, end = _slot(SEQ, CU, OFFSETS, s, S_, nC, L, C, PACKED)
    tt = tl.arange(0, C)
    kd = tl.arange(0, BK)
    vd = tl.program_id(2) * BV + tl.arange(0, BV)
    q = _rows(Q, n, hv // GROUP, first, end, sq_n, sq_h, sq_l, K, L2NORM, C, BK)
    k = _rows(K_, n, hv // GROUP, first, end, sk_n, sk_h, sk_l, K, L2NORM, C, BK)
    g, _, e = _gates(G, BETA, n, hv, first, end, sg_n, sg_h, sg_l, sb_n, sb_h, sb_l, C)
    p = dot(round_to(q, DTYPE), tl.trans(round_to(k, DTYPE)),
            tl.zeros((C, C), dtype=tl.float32), PRECISION)  # fmt: skip
    p = tl.where(tt[:, None] >= tt[None, :], p * tl.exp(e), 0.0)
    s0 = tl.load(STATES + ((s * Hv + hv) * K + kd[:, None]) * V + vd[None, :],
                 mask=(kd < K)[:, None] & (vd < V)[None, :], other=0.0)  # fmt: skip
    u = tl.load(U + ((s * Hv + hv) * C + tt[:, None]) * V + vd[None, :], mask=(vd < V)[None, :],
                other=0.0)  # fmt: skip
    gq = round_to(tl.exp(tl.cumsum(g, axis=0))[:, None] * q, DTYPE)
    o = dot(gq, s0, tl.zeros((C, BV), dtype=tl.float32), PRECISION)
    o = _causal_dot(p, u, o, DTYPE, PRECISION) * SCALE
    t = first + tt
    tl.store(O + ((n * Hv + hv) * L + t[:, None]) * V + vd[None, :],
             round_to(o, O.dtype.element_ty),
             mask=(t < end)[:, None] & (vd < V)[None, :])  # fmt: skip


# One binary per dtype and tile: no specialisation on sizes, strides or flags.
_chunk_wy = untuned(_chunk_wy)
_chunk_states = untuned(_chunk_states)
_chunk_output = untuned(_chunk_output)

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


#: Widest key head: at 128 the states' walk spills its float32 tiles (``W`` and ``K`` rows
#: whole, three TF32 parts each) on sm_80 and sm_90; wider heads take the step kernels until
#: the walk splits its key rows.
MAX_K = 64


def supported(k: torch.Tensor, g: torch.Tensor) -> bool:
    """Scalar gates and key heads up to :data:`MAX_K`. KDA's per-channel gates need a reference
    point inside the chunk (a factor ``exp`` of a positive sum otherwise), which these kernels
    do not take yet."""
    return g.dim() == 3 and k.shape[-1] <= MAX_K


@serialised
def forward(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
            cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    """The op's forward (scalar gates, see :func:`supported`) in three launches."""
    q, k, v = unit_stride_rows(q), unit_stride_rows(k), unit_stride_rows(v)
    N, H, L, K = q.shape
    Hv, V = v.shape[1], v.shape[3]
    C, dev = CHUNK, q.device
    i64 = {"dtype": torch.int64, "device": dev}
    if cu_seqlens is None:
        sequences, nC = N, triton.cdiv(L, C)
        slots = N * nC
        cu = offsets = seq_of = torch.zeros(1, **i64)
    else:
        cu = cu_seqlens.to(torch.int64).contiguous()
        sequences, nC = cu.numel() - 1, 0
        counts = torch.div(cu[1:] - cu[:-1] + C - 1, C, rounding_mode="floor")
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        # at most L / C chunks plus one per sequence: no host synchronisation
        slots = L // C + sequences
        seq_of = torch.searchsorted(offsets[1:], torch.arange(slots, **i64), right=True)
    slots = max(slots, 1)
    w = torch.empty((slots, Hv, C, K), dtype=torch.float32, device=dev)
    u = torch.empty((slots, Hv, C, V), dtype=torch.float32, device=dev)
    states = torch.empty((slots, Hv, K, V), dtype=q.dtype, device=dev)
    out = torch.empty((N, Hv, L, V), dtype=q.dtype, device=dev)
    f32 = {"dtype": torch.float32, "device": dev}
    final = torch.empty((sequences, Hv, K, V), **f32) if output_final_state else None
    bk = max(16, triton.next_power_of_2(K))
    bv = min(BLOCK_V, max(16, triton.next_power_of_2(V)))
    meta = {"DTYPE": _TL_DTYPES[q.dtype], "PRECISION": dot_precision(q.dtype), "C": C,
            "BK": bk, "BV": bv, "num_warps": WARPS, "num_stages": 1}  # fmt: skip
    group, packed, l2 = Hv // H, int(cu_seqlens is not None), int(use_qk_l2norm)
    gates = (*g.stride(), *beta.stride())
    _chunk_wy[(slots, Hv)](
        k, v, g, beta, w, u, seq_of, cu, offsets, sequences, L, nC, group, K, V,
        *k.stride()[:3], *v.stride()[:3], *gates, packed, l2, **meta,
    )  # fmt: skip
    init = initial_state
    unused = torch.empty(0, **f32)
    # float32 inputs: the user's float32 products (TF32 where enabled); 16-bit ones: float32's
    # accuracy on tensor cores
    state_precision = meta["PRECISION"] if q.dtype == torch.float32 else "tf32x3"
    sbv = min(STATE_BLOCK_V, bv)
    _chunk_states[(sequences, Hv, triton.cdiv(V, sbv))](
        k, g, w, u, states, init if init is not None else unused,
        final if final is not None else unused,
        cu, offsets, L, nC, group, K, V, *k.stride()[:3], *g.stride(),
        *(init.stride() if init is not None else (0, 0, 0, 0)),
        int(init is not None), int(final is not None), packed, l2,
        STATE_PRECISION=state_precision, **{**meta, "BV": sbv},
    )  # fmt: skip
    _chunk_output[(slots, Hv, triton.cdiv(V, bv))](
        q, k, g, beta, states, u, out, seq_of, cu, offsets, sequences, L, nC, group, K, V,
        float(scale), *q.stride()[:3], *k.stride()[:3], *gates, packed, l2,
        **{**meta, "num_warps": OUTPUT_WARPS},
    )  # fmt: skip
    if final is None:
        return out, q.new_empty(0)
    return out, final.to(initial_state.dtype if initial_state is not None else torch.float32)
