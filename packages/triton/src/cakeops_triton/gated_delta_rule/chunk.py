"""The gated delta rule over chunks, forward and backward, on tensor cores (scalar gates;
KDA's per-channel gates take the step kernels, :mod:`.fused_recurrent`).

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

The backward (five launches) walks the same algebra back from the chunks' starting states,
which it recomputes in float32 (the forward keeps none: it saves only its inputs):
:func:`_chunk_wy` again, also storing ``T`` and ``P = Q K^T o exp(E)``; :func:`_chunk_states`;
:func:`_chunk_states_bwd` walks each sequence's chunks from the last, the state's gradient
``dS`` at each chunk's end and ``dU``; then every chunk at once: :func:`_chunk_grads_v` sums
over the value columns (``dV`` and the products the rest needs), :func:`_chunk_grads_k` the
``C x C`` algebra for ``dq``, ``dk``, ``dbeta`` and the log gates'. All its products take
float32 operands (three TF32 products for 16-bit inputs, or FMA): the gradients of float32
gates and states meet float32's tolerance. KDA's ``C x C`` algebra and per-channel gate
gradients take :func:`_chunk_grads_kda`.

Registers decide the tiles: the walks and the gradients take a head's key rows a block at a
time (:data:`KEY_BLOCK`, :data:`WALK_KEY_BLOCK`), the walks keeping the state between chunks
in float32 memory (a register tile of a whole 128-row state, three TF32 parts each, spills),
with a barrier between a block's last reads and its writes.
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

from .fused_recurrent import EPS, gate_strides

#: Positions per chunk: 16 on a GPU (the tensor-core products' M; at 32 the chunk's ``T`` and
#: ``W`` kernel and the backward's gradients spill at head size 64, ``nox -s gpu_compile``); 4
#: under the interpreter, so that the suite's short sequences (12 positions) cross chunks.
CHUNK = 4 if INTERPRET else 16
#: Key rows per block of the chunks' ``T``, ``W`` and gradient kernels (they take a head's rows
#: a block at a time): 4 under the interpreter, so that the suite's heads of 8 take two.
KEY_BLOCK = 4 if INTERPRET else 64
#: ... and of the two walks, whose state blocks (``WALK_KEY_BLOCK x STATE_BLOCK_V``, three
#: TF32 parts each for 16-bit inputs) take half the rows for twice the columns: 168 registers
#: a thread on sm_90 and 240 on sm_80 where 64 x 16 took 255, and half the programs, so half
#: the waves of a chain (``nox -s gpu_compile`` sweeps the head sizes).
WALK_KEY_BLOCK = 4 if INTERPRET else 32
#: ... and of the backward's ``C x C`` algebra, which holds five ``C x C`` float32 tiles beside
#: the key blocks' products: its products on CUDA cores (``GRAD_PRECISION``, FMA: ``C x C``
#: by ``C x KB``, a few thousand per thread), where tensor-core ones (three TF32 parts per
#: operand) spill at any key block; at 64 they reach 255 registers on sm_80.
GRAD_KEY_BLOCK = 4 if INTERPRET else 32
#: ... and of KDA's ``C x C x KB`` tiles (its ``C x C`` products over the key columns, each
#: term with its own gate factor: :func:`_gated_scores`), and the ``T``/``W`` kernel's key
#: blocks for KDA: 8 (2,048 float32 a tile, 8 registers a thread on 8 warps; at 16 the
#: ``T``/``W`` kernel spills on sm_80), under the interpreter too (the GPU-path test in
#: ``tests/backends/test_triton_backend.py`` crosses them at head size 64).
KDA_KEY_BLOCK = 8
#: KDA's ``T``/``W`` kernel: 4 warps (on 8, ptxas spills 8 bytes of its backward's form on
#: sm_90 with 128 registers a thread)
KDA_WY_WARPS = 4
GRAD_PRECISION = "ieee"
#: Value columns per program of the outputs and of the walks: the widest that compile without
#: spilling at head size 128 on sm_90 and sm_80 (``nox -s gpu_compile``).
BLOCK_V = 32
STATE_BLOCK_V = 32
WARPS = 8
#: The outputs' tiles are small: 4 warps give each thread the registers 8 would cap (8 bytes
#: spilled on sm_80 at head size 64).
OUTPUT_WARPS = 4
#: The walks (forward and backward): they are chains of chunks, so their time is the chain's
#: length times the waves of programs; on 4 warps (about 200 registers a thread) two programs
#: share a multiprocessor, half the waves of 8 warps, and the backward's 16-row key blocks
#: (heads up to 16) no longer spill (40 bytes on sm_90 at 8: warps holding copies of tiles too
#: small to split).
WALK_WARPS = 4
#: The backward walk's register ceiling for its smallest state blocks (heads up to 16): left to
#: itself, ptxas's occupancy heuristic kept 128 registers a thread there and spilled 16-24 bytes
#: (sm_80 and sm_90); told it may use 255, it takes 167-204 and spills none. The wider blocks
#: keep ptxas's choice (168 on sm_90: three programs a multiprocessor, where 255 allows two).
MAX_REGISTERS = 255
GRAD_WARPS = 8


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
def _sequence(CU, OFFSETS, seq, L, nC, PACKED):
    """Sequence ``seq``'s ``(batch row, first position, end, first chunk slot)``: batch row
    ``seq``, or (``PACKED``) row 0's packed sequence ``seq``."""
    if PACKED:
        return seq * 0, tl.load(CU + seq), tl.load(CU + seq + 1), tl.load(OFFSETS + seq)
    return seq, seq * 0, seq * 0 + L, seq * nC


@triton.jit
def _start_carry(carry, X, GIVEN, seq, hv, sx_s, sx_h, sx_k, sx_v, K, V, vd,
                 KB: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    """A walk's start: ``X``'s ``(seq, hv)`` state (its columns ``vd``) into the float32
    ``carry``, ``KB`` key rows at a time, or zeros when not ``GIVEN``."""
    for k0 in range(0, K, KB):
        kd = k0 + tl.arange(0, KB)
        mkv = (kd < K)[:, None] & (vd < V)[None, :]
        if GIVEN:
            at = X + seq * sx_s + hv * sx_h + kd[:, None] * sx_k + vd[None, :] * sx_v
            S = tl.load(at, mask=mkv, other=0.0).to(tl.float32)
        else:
            S = tl.zeros((KB, BV), dtype=tl.float32)
        tl.store(carry + kd[:, None] * V + vd[None, :], S, mask=mkv)


@triton.jit
def _gate_block(G, n, hv, t, ok, k0, sg_n, sg_h, sg_l, sg_k, K, KDA: tl.constexpr,
                KB: tl.constexpr):  # fmt: skip
    """The log gates at positions ``t`` (zeros where not ``ok``) as float32: KDA's of key
    columns ``k0 .. k0 + KB`` (``len(t) x KB``), or the scalar gates (``len(t)``), which
    :func:`_gated` and :func:`_decayed` apply per row."""
    if KDA:
        kd = k0 + tl.arange(0, KB)
        at = G + n * sg_n + hv * sg_h + t[:, None] * sg_l + kd[None, :] * sg_k
        g = tl.load(at, mask=ok[:, None] & (kd < K)[None, :], other=0.0)
    else:
        g = tl.load(G + n * sg_n + hv * sg_h + t * sg_l, mask=ok, other=0.0)
    return g.to(tl.float32)


@triton.jit
def _gated(x, f, KDA: tl.constexpr):
    """A chunk's ``C x KB`` rows ``x`` times gate factors ``f``: KDA's one per element, a
    scalar gate's one per row."""
    if KDA:
        return x * f
    else:
        return x * f[:, None]


@triton.jit
def _gated_block(X, n, h, first, end, sn, sh, sl, D, d0, r, f, KDA: tl.constexpr,
                 C: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """:func:`_block` times the gate factors ``f`` (:func:`_gated`): a scalar gate's folded
    into the rows' factors ``r``."""
    if KDA:
        x = _block(X, n, h, first, end, sn, sh, sl, D, d0, r, C, BD) * f
    else:
        x = _block(X, n, h, first, end, sn, sh, sl, D, d0, r * f, C, BD)
    return x


@triton.jit
def _decayed(S, total, KDA: tl.constexpr):
    """A state block ``S`` (``KB`` key rows) times the chunk's decay ``total``: KDA's one per
    key row, a scalar gate's one number."""
    if KDA:
        return S * total[:, None]
    else:
        return S * total


@triton.jit
def _closing_gates(G, n, hv, start, end, k0, sg_n, sg_h, sg_l, sg_k, K, KDA: tl.constexpr,
                   C: tl.constexpr, KB: tl.constexpr):  # fmt: skip
    """The chunk from ``start``'s factors to its last step, for key columns ``k0 .. k0 + KB``:
    ``exp(Gc)`` (``C x KB``, ``Gc_j`` the log gates over ``(j, last]``: a reverse cumulative
    sum of the next steps' gates) and ``exp(Gamma_C)`` (``KB``, over the whole chunk); for
    scalar gates ``C`` and one number (:func:`_gate_block`)."""
    tt = tl.arange(0, C)
    t = start + tt
    g = _gate_block(G, n, hv, t, t < end, k0, sg_n, sg_h, sg_l, sg_k, K, KDA, KB)
    g_next = _gate_block(G, n, hv, t + 1, (t + 1 < end) & (tt + 1 < C), k0, sg_n, sg_h, sg_l,
                         sg_k, K, KDA, KB)  # fmt: skip
    return tl.exp(tl.cumsum(g_next, axis=0, reverse=True)), tl.exp(tl.sum(g, axis=0))


@triton.jit
def _gated_scores(X, Y, G, n, h, hv, first, end, sx_n, sx_h, sx_l, sy_n, sy_h, sy_l,
                  sg_n, sg_h, sg_l, sg_k, K, rx, ry, DIAG: tl.constexpr,
                  C: tl.constexpr, KB: tl.constexpr):  # fmt: skip
    """KDA's ``sum_c x_tc y_jc exp(E_tjc)`` for ``j < t`` (``j <= t`` with ``DIAG``), zero
    elsewhere (``C x C`` float32; ``rx``, ``ry`` the rows' inverse norms or ones), ``E_tjc``
    the sum of channel ``c``'s log gates over the steps ``(j, t]``: a cumulative sum down
    ``t`` of a ``C x C x KB`` tile, ``KB`` key columns at a time, never a difference. Each
    product is masked after it is formed: a non-finite row never reaches the rows before."""
    tt = tl.arange(0, C)
    t = first + tt
    after = (tt[:, None] > tt[None, :])[:, :, None]
    if DIAG:
        mask = (tt[:, None] >= tt[None, :])[:, :, None]
    else:
        mask = after
    scores = tl.zeros((C, C), dtype=tl.float32)
    for k0 in range(0, K, KB):
        x = _block(X, n, h, first, end, sx_n, sx_h, sx_l, K, k0, rx, C, KB)
        y = _block(Y, n, h, first, end, sy_n, sy_h, sy_l, K, k0, ry, C, KB)
        g = _gate_block(G, n, hv, t, t < end, k0, sg_n, sg_h, sg_l, sg_k, K, True, KB)
        e = tl.cumsum(tl.where(after, g[:, None, :], 0.0), axis=0)
        terms = x[:, None, :] * y[None, :, :] * tl.exp(e)
        scores += tl.sum(tl.where(mask, terms, 0.0), axis=2)
    return scores


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
def _anticausal_dot(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b`` for float32 ``a`` upper-triangular (row ``i`` reads the rows ``j >= i``
    of ``b``): a non-finite entry of ``b`` makes its column non-finite up to its row, as the
    backward walk carries it, and never reaches the rows after."""
    bad = (b - b) != 0
    reached = tl.cumsum(bad.to(tl.int32), axis=0, reverse=True) > 0
    out = tl.dot(a, tl.where(bad, 0.0, b), acc, input_precision=PRECISION)
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
    Q, K_, V_, G, BETA, W, U, TINV, P, SEQ, CU, OFFSETS,
    S, L, nC, GROUP, K, V,
    sq_n, sq_h, sq_l, sk_n, sk_h, sk_l, sv_n, sv_h, sv_l, sg_n, sg_h, sg_l, sg_k,
    sb_n, sb_h, sb_l, PACKED, L2NORM, DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BACKWARD: tl.constexpr, STATE_PRECISION: tl.constexpr, KDA: tl.constexpr,
    C: tl.constexpr, KB: tl.constexpr, GB: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Per (chunk slot, value head): ``W = T diag(beta Gamma) K`` and ``U~ = T diag(beta) V``
    into ``W`` ``(slots, Hv, C, K)`` and ``U`` ``(slots, Hv, C, V)`` (float32); for the
    ``BACKWARD``, also ``T`` and ``P = Q K^T o exp(E)`` (``j <= t``) into ``TINV`` and ``P``
    ``(slots, Hv, C, C)`` (float32). ``KB`` key columns at a time (``GB`` for KDA's
    ``C x C x GB`` tiles of :func:`_gated_scores`)."""
    s = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    Hv = tl.num_programs(1)
    n, first, end = _slot(SEQ, CU, OFFSETS, s, S, nC, L, C, PACKED)
    tt = tl.arange(0, C)
    h = hv // GROUP
    rk = _norms(K_, n, h, first, end, sk_n, sk_h, sk_l, K, L2NORM, C, KB)
    # (KDA: the gates' first channel, unused)
    _, beta, e = _gates(G, BETA, n, hv, first, end, sg_n, sg_h, sg_l, sb_n, sb_h, sb_l, C)
    lower = tt[:, None] > tt[None, :]
    if KDA:
        a = beta[:, None] * _gated_scores(K_, K_, G, n, h, hv, first, end, sk_n, sk_h, sk_l,
                                          sk_n, sk_h, sk_l, sg_n, sg_h, sg_l, sg_k, K, rk, rk,
                                          False, C, GB)  # fmt: skip
    else:
        kk = tl.zeros((C, C), dtype=tl.float32)
        for k0 in range(0, K, KB):
            k = round_to(_block(K_, n, h, first, end, sk_n, sk_h, sk_l, K, k0, rk, C, KB), DTYPE)
            kk = dot(k, tl.trans(k), kk, PRECISION)
        a = tl.where(lower, beta[:, None] * kk * tl.exp(e), 0.0)
    # T = (I + A)^{-1}, row by row: T_i = e_i - sum_{j < i} A_ij T_j (rows j >= i still zero;
    # T_jc = 0 for c > j left out of the sum, not multiplied: a NaN in A stays where it is)
    t_inv = tl.zeros((C, C), dtype=tl.float32)
    for i in range(0, C):
        a_i = tl.sum(tl.where(tt[:, None] == i, a, 0.0), axis=0)
        terms = tl.where(tt[:, None] >= tt[None, :], a_i[:, None] * t_inv, 0.0)
        row = tl.where(tt == i, 1.0, 0.0) - tl.sum(terms, axis=0)
        t_inv = tl.where(tt[:, None] == i, row[None, :], t_inv)
    out = (s * Hv + hv) * C
    if BACKWARD:
        tl.store(TINV + (out + tt[:, None]) * C + tt[None, :], t_inv)
        rq = _norms(Q, n, h, first, end, sq_n, sq_h, sq_l, K, L2NORM, C, KB)
        if KDA:
            p = _gated_scores(Q, K_, G, n, h, hv, first, end, sq_n, sq_h, sq_l, sk_n, sk_h,
                              sk_l, sg_n, sg_h, sg_l, sg_k, K, rq, rk, True, C, GB)  # fmt: skip
        else:
            qk = tl.zeros((C, C), dtype=tl.float32)
            for k0 in range(0, K, KB):
                q = _block(Q, n, h, first, end, sq_n, sq_h, sq_l, K, k0, rq, C, KB)
                k = _block(K_, n, h, first, end, sk_n, sk_h, sk_l, K, k0, rk, C, KB)
                qk = tl.dot(q, tl.trans(k), qk, input_precision=STATE_PRECISION)
            p = tl.where(tt[:, None] >= tt[None, :], qk * tl.exp(e), 0.0)
        tl.store(P + (out + tt[:, None]) * C + tt[None, :], p)
    for k0 in range(0, K, KB):
        kd = k0 + tl.arange(0, KB)
        # X = diag(beta) (Gamma o K): Gamma_tc the gates over [first, t], per channel
        gam = tl.exp(tl.cumsum(_gate_block(G, n, hv, first + tt, first + tt < end, k0, sg_n,
                                           sg_h, sg_l, sg_k, K, KDA, KB), axis=0))  # fmt: skip
        x = _gated_block(K_, n, h, first, end, sk_n, sk_h, sk_l, K, k0, beta * rk, gam, KDA, C,
                         KB)  # fmt: skip
        w = _causal_dot(t_inv, x, tl.zeros((C, KB), dtype=tl.float32), tl.float32, "ieee")
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
    K_, G, W, U, STATES, INIT, CARRY, CU, OFFSETS,
    L, nC, GROUP, K, V,
    sk_n, sk_h, sk_l, sg_n, sg_h, sg_l, sg_k, si_s, si_h, si_k, si_v,
    HAS_INIT, PACKED, L2NORM, STATE_PRECISION: tl.constexpr, KDA: tl.constexpr,
    C: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Per (sequence, value head, block of value columns), its chunks in order: each chunk's
    starting state stored in ``STATES`` ``(slots, Hv, K, V)`` (its dtype),
    ``U = U~ - W S0`` written over ``U~``, then ``S <- Gamma_C S + (Gc K)^T U``. The state
    lives in ``CARRY`` ``(sequences, Hv, K, V)`` float32 (the last state when done), ``KB``
    key rows at a time: a register tile of the whole state spills at head size 128. The
    states' products take float32 operands (``STATE_PRECISION``: three TF32 products for
    16-bit inputs, on tensor cores with float32's accuracy), so that the final state meets
    float32's tolerance whatever the inputs' dtype, as the recurrence's does."""
    seq = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    Hv = tl.num_programs(1)
    tt = tl.arange(0, C)
    vd = tl.program_id(2) * BV + tl.arange(0, BV)
    n, first, end, slot0 = _sequence(CU, OFFSETS, seq, L, nC, PACKED)
    carry = CARRY + (seq * Hv + hv) * K * V
    _start_carry(carry, INIT, HAS_INIT, seq, hv, si_s, si_h, si_k, si_v, K, V, vd, KB, BV)
    for c in range(0, tl.cdiv(end - first, C)):
        slot = slot0 + c
        start = first + c * C
        rows = (slot * Hv + hv) * C + tt
        u_at = U + rows[:, None] * V + vd[None, :]
        u = tl.load(u_at, mask=(vd < V)[None, :], other=0.0)
        tl.debug_barrier()  # the state's last writes, by every thread
        for k0 in range(0, K, KB):
            kd = k0 + tl.arange(0, KB)
            mkv = (kd < K)[:, None] & (vd < V)[None, :]
            S = tl.load(carry + kd[:, None] * V + vd[None, :], mask=mkv, other=0.0)
            tl.store(STATES + ((slot * Hv + hv) * K + kd[:, None]) * V + vd[None, :],
                     round_to(S, STATES.dtype.element_ty), mask=mkv)  # fmt: skip
            w = tl.load(W + rows[:, None] * K + kd[None, :], mask=(kd < K)[None, :], other=0.0)
            u = u - tl.dot(w, S, input_precision=STATE_PRECISION)
        tl.store(u_at, u, mask=(vd < V)[None, :])
        rk = _norms(K_, n, hv // GROUP, start, end, sk_n, sk_h, sk_l, K, L2NORM, C, KB)
        if not KDA:  # scalar gates: the same factors for every block of key rows
            gc, total = _closing_gates(G, n, hv, start, end, 0, sg_n, sg_h, sg_l, sg_k, K, KDA,
                                       C, KB)  # fmt: skip
        for k0 in range(0, K, KB):
            kd = k0 + tl.arange(0, KB)
            mkv = (kd < K)[:, None] & (vd < V)[None, :]
            S = tl.load(carry + kd[:, None] * V + vd[None, :], mask=mkv, other=0.0)
            if KDA:
                gc, total = _closing_gates(G, n, hv, start, end, k0, sg_n, sg_h, sg_l, sg_k, K,
                                           KDA, C, KB)  # fmt: skip
            k = _gated_block(K_, n, hv // GROUP, start, end, sk_n, sk_h, sk_l, K, k0, rk, gc, KDA,
                             C, KB)  # fmt: skip
            S = tl.dot(tl.trans(k), u, _decayed(S, total, KDA), input_precision=STATE_PRECISION)
            tl.debug_barrier()  # every thread has read this block
            tl.store(carry + kd[:, None] * V + vd[None, :], S, mask=mkv)


def _chunk_output(
    Q, K_, G, BETA, STATES, U, O, SEQ, CU, OFFSETS,
    S_, L, nC, GROUP, K, V, SCALE,
    sq_n, sq_h, sq_l, sk_n, sk_h, sk_l, sg_n, sg_h, sg_l, sg_k, sb_n, sb_h, sb_l,
    PACKED, L2NORM, DTYPE: tl.constexpr, PRECISION: tl.constexpr, KDA: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, GB: tl.constexpr, BV: tl.constexpr,
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
    if KDA:
        h = hv // GROUP
        rq = _norms(Q, n, h, first, end, sq_n, sq_h, sq_l, K, L2NORM, C, BK)
        rk = _norms(K_, n, h, first, end, sk_n, sk_h, sk_l, K, L2NORM, C, BK)
        p = _gated_scores(Q, K_, G, n, h, hv, first, end, sq_n, sq_h, sq_l, sk_n, sk_h, sk_l,
                          sg_n, sg_h, sg_l, sg_k, K, rq, rk, True, C, GB)  # fmt: skip
    else:
        _, _, e = _gates(G, BETA, n, hv, first, end, sg_n, sg_h, sg_l, sb_n, sb_h, sb_l, C)
        p = dot(round_to(q, DTYPE), tl.trans(round_to(k, DTYPE)),
                tl.zeros((C, C), dtype=tl.float32), PRECISION)  # fmt: skip
        p = tl.where(tt[:, None] >= tt[None, :], p * tl.exp(e), 0.0)
    s0 = tl.load(STATES + ((s * Hv + hv) * K + kd[:, None]) * V + vd[None, :],
                 mask=(kd < K)[:, None] & (vd < V)[None, :], other=0.0)  # fmt: skip
    u = tl.load(U + ((s * Hv + hv) * C + tt[:, None]) * V + vd[None, :], mask=(vd < V)[None, :],
                other=0.0)  # fmt: skip
    g = _gate_block(G, n, hv, first + tt, first + tt < end, 0, sg_n, sg_h, sg_l, sg_k, K, KDA,
                    BK)  # fmt: skip
    gq = round_to(_gated(q, tl.exp(tl.cumsum(g, axis=0)), KDA), DTYPE)
    o = dot(gq, s0, tl.zeros((C, BV), dtype=tl.float32), PRECISION)
    o = _causal_dot(p, u, o, DTYPE, PRECISION) * SCALE
    t = first + tt
    tl.store(O + ((n * Hv + hv) * L + t[:, None]) * V + vd[None, :],
             round_to(o, O.dtype.element_ty),
             mask=(t < end)[:, None] & (vd < V)[None, :])  # fmt: skip


@triton.jit
def _inverse_norms(X, n, h, first, end, sn, sh, sl, D, C: tl.constexpr, BD: tl.constexpr):
    """``1 / |x_t|`` of the chunk's rows (as :func:`_rows` normalises them), ``BD`` columns
    at a time."""
    t = first + tl.arange(0, C)
    squares = tl.zeros((C,), dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        m = (t < end)[:, None] & (d < D)[None, :]
        x = tl.load(X + n * sn + h * sh + t[:, None] * sl + d[None, :], mask=m, other=0.0)
        x = x.to(tl.float32)
        squares += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(squares + EPS)


@triton.jit
def _block(X, n, h, first, end, sn, sh, sl, D, d0, r, C: tl.constexpr, BD: tl.constexpr):
    """A chunk's ``C x BD`` rows of ``X`` from column ``d0``, as float32 (zeros past ``end``
    and ``D``), times ``r`` per row (the inverse norms, or ones)."""
    t = first + tl.arange(0, C)
    d = d0 + tl.arange(0, BD)
    x = tl.load(X + n * sn + h * sh + t[:, None] * sl + d[None, :],
                mask=(t < end)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)  # fmt: skip
    return x * r[:, None]


@triton.jit
def _norms(X, n, h, first, end, sn, sh, sl, D, L2NORM, C: tl.constexpr, BD: tl.constexpr):
    """What :func:`_block` multiplies the rows by: their inverse norms with ``L2NORM``, else
    ones."""
    if L2NORM:
        r = _inverse_norms(X, n, h, first, end, sn, sh, sl, D, C, BD)
    else:
        r = tl.full((C,), 1.0, dtype=tl.float32)
    return r


def _chunk_states_bwd(
    Q, K_, G, W, P, DO, DFINAL, DSC, DU, CARRY, CU, OFFSETS,
    L, nC, GROUP, K, V, SCALE,
    sq_n, sq_h, sq_l, sk_n, sk_h, sk_l, sg_n, sg_h, sg_l, sg_k, sd_n, sd_h, sd_l,
    sf_s, sf_h, sf_k, sf_v,
    HAS_DFINAL, PACKED, L2NORM, STATE_PRECISION: tl.constexpr, KDA: tl.constexpr,
    C: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Per (sequence, value head, block of value columns), its chunks from the last: the
    state's gradient at each chunk's end into ``DSC`` ``(slots, Hv, K, V)``,
    ``dU = scale P^T dO + (Gc K) dS`` into ``DU`` ``(slots, Hv, C, V)`` (``P`` from
    :func:`_chunk_wy`), then ``dS <- scale (Gamma Q)^T dO + Gamma_C dS - W^T dU``. ``dS``
    lives in ``CARRY`` ``(sequences, Hv, K, V)`` float32 (the first state's gradient when
    done), ``KB`` key rows at a time, as :func:`_chunk_states` keeps the state. float32
    products, as the forward's states."""
    seq = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    Hv = tl.num_programs(1)
    h = hv // GROUP
    tt = tl.arange(0, C)
    vd = tl.program_id(2) * BV + tl.arange(0, BV)
    n, first, end, slot0 = _sequence(CU, OFFSETS, seq, L, nC, PACKED)
    carry = CARRY + (seq * Hv + hv) * K * V
    _start_carry(carry, DFINAL, HAS_DFINAL, seq, hv, sf_s, sf_h, sf_k, sf_v, K, V, vd, KB, BV)
    chunks = tl.cdiv(end - first, C)
    for i in range(0, chunks):
        c = chunks - 1 - i
        slot = slot0 + c
        start = first + c * C
        t = start + tt
        rows = (slot * Hv + hv) * C + tt
        if not KDA:  # one factor a row, the same for every block of key rows
            g = _gate_block(G, n, hv, t, t < end, 0, sg_n, sg_h, sg_l, sg_k, K, KDA, KB)
            g_next = _gate_block(G, n, hv, t + 1, (t + 1 < end) & (tt + 1 < C), 0, sg_n, sg_h,
                                 sg_l, sg_k, K, KDA, KB)  # fmt: skip
        tv = (t < end)[:, None] & (vd < V)[None, :]
        do = tl.load(DO + n * sd_n + hv * sd_h + t[:, None] * sd_l + vd[None, :], mask=tv,
                     other=0.0).to(tl.float32)  # fmt: skip
        p = tl.load(P + rows[:, None] * C + tt[None, :])
        du = _anticausal_dot(tl.trans(p), do, tl.zeros((C, BV), dtype=tl.float32),
                             STATE_PRECISION) * SCALE  # fmt: skip
        # a scalar gate's factors folded into the rows' once (computed a block at a time, and
        # loaded later, they spilled on sm_80 at head size 8)
        rk = _norms(K_, n, h, start, end, sk_n, sk_h, sk_l, K, L2NORM, C, KB)
        if not KDA:
            rk = rk * tl.exp(tl.cumsum(g_next, axis=0, reverse=True))
        tl.debug_barrier()  # dS's last writes, by every thread
        for k0 in range(0, K, KB):
            kd = k0 + tl.arange(0, KB)
            mkv = (kd < K)[:, None] & (vd < V)[None, :]
            dS = tl.load(carry + kd[:, None] * V + vd[None, :], mask=mkv, other=0.0)
            tl.store(DSC + ((slot * Hv + hv) * K + kd[:, None]) * V + vd[None, :], dS, mask=mkv)
            kc = _block(K_, n, h, start, end, sk_n, sk_h, sk_l, K, k0, rk, C, KB)
            if KDA:
                kc = kc * _closing_gates(G, n, hv, start, end, k0, sg_n, sg_h, sg_l, sg_k, K, KDA,
                                         C, KB)[0]  # fmt: skip
            du = tl.dot(kc, dS, du, input_precision=STATE_PRECISION)
        tl.store(DU + rows[:, None] * V + vd[None, :], du, mask=(vd < V)[None, :])
        rq = _norms(Q, n, h, start, end, sq_n, sq_h, sq_l, K, L2NORM, C, KB) * SCALE
        if not KDA:
            rq = rq * tl.exp(tl.cumsum(g, axis=0))
            total = tl.exp(tl.sum(g, axis=0))
        for k0 in range(0, K, KB):
            kd = k0 + tl.arange(0, KB)
            mkv = (kd < K)[:, None] & (vd < V)[None, :]
            dS = tl.load(carry + kd[:, None] * V + vd[None, :], mask=mkv, other=0.0)
            q = _block(Q, n, h, start, end, sq_n, sq_h, sq_l, K, k0, rq, C, KB)
            if KDA:
                g = _gate_block(G, n, hv, t, t < end, k0, sg_n, sg_h, sg_l, sg_k, K, KDA, KB)
                q = q * tl.exp(tl.cumsum(g, axis=0))
                total = tl.exp(tl.sum(g, axis=0))
            dS = tl.dot(tl.trans(q), do, _decayed(dS, total, KDA), input_precision=STATE_PRECISION)
            w = tl.load(W + rows[:, None] * K + kd[None, :], mask=(kd < K)[None, :], other=0.0)
            dS = dS - tl.dot(tl.trans(w), du, input_precision=STATE_PRECISION)
            tl.debug_barrier()  # every thread has read this block
            tl.store(carry + kd[:, None] * V + vd[None, :], dS, mask=mkv)


def _chunk_grads_v(
    V_, BETA, TINV, STATES, U, DU, DSC, DO, DQ, DK, DW, DPT, DV, DB, DG, SEQ, CU, OFFSETS,
    S_, L, nC, K, V, sv_n, sv_h, sv_l, sb_n, sb_h, sb_l, sd_n, sd_h, sd_l,
    PACKED, STATE_PRECISION: tl.constexpr, KDA: tl.constexpr,
    C: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Per (chunk slot, value head), the backward's sums over the value columns: ``dV`` (in its
    dtype), and into the float32 outputs that :func:`_chunk_grads_k` finishes, at the chunk's
    positions: ``dO S0^T`` into ``DQ``, ``U dS_C^T`` into ``DK``, ``dU S0^T`` into ``DW`` (the
    forward's ``W``, no longer needed), ``dO U^T`` and ``dU (diag(beta) V)^T`` into ``DPT``
    ``(slots, Hv, 2, C, C)``, ``V . dY`` into ``DB`` and ``sum(S0 o dS_C)`` into every ``DG``
    of the chunk (KDA: per key row, ``DG`` ``(N, Hv, L, K)``). ``KB`` key rows at a time."""
    s = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    Hv = tl.num_programs(1)
    n, first, end = _slot(SEQ, CU, OFFSETS, s, S_, nC, L, C, PACKED)
    tt = tl.arange(0, C)
    t = first + tt
    ok = t < end
    beta = tl.load(BETA + n * sb_n + hv * sb_h + t * sb_l, mask=ok, other=0.0).to(tl.float32)
    base = (s * Hv + hv) * C
    t_inv = tl.load(TINV + (base + tt[:, None]) * C + tt[None, :])
    out = (n * Hv + hv) * L + t
    # two passes over the value columns, each with its own accumulators (one pass holds too
    # many float32 tiles at once): the state's products, a block of key rows at a time, then
    # the chunk's
    state_sum = tl.zeros((C,), dtype=tl.float32)
    for k0 in range(0, K, KB):
        kd = k0 + tl.arange(0, KB)
        acc_dq = tl.zeros((C, KB), dtype=tl.float32)
        acc_dkc = tl.zeros((C, KB), dtype=tl.float32)
        acc_dw = tl.zeros((C, KB), dtype=tl.float32)
        acc_dgc = tl.zeros((KB,), dtype=tl.float32)
        for v0 in range(0, V, BV):
            vd = v0 + tl.arange(0, BV)
            mv = vd < V
            mkv = (kd < K)[:, None] & mv[None, :]
            state = ((s * Hv + hv) * K + kd[:, None]) * V + vd[None, :]
            s0 = tl.load(STATES + state, mask=mkv, other=0.0)
            dsc = tl.load(DSC + state, mask=mkv, other=0.0)
            rows = (base + tt[:, None]) * V + vd[None, :]
            u = tl.load(U + rows, mask=mv[None, :], other=0.0)
            du = tl.load(DU + rows, mask=mv[None, :], other=0.0)
            do = tl.load(DO + n * sd_n + hv * sd_h + t[:, None] * sd_l + vd[None, :],
                         mask=ok[:, None] & mv[None, :], other=0.0).to(tl.float32)  # fmt: skip
            acc_dq = tl.dot(do, tl.trans(s0), acc_dq, input_precision=STATE_PRECISION)
            acc_dkc = tl.dot(u, tl.trans(dsc), acc_dkc, input_precision=STATE_PRECISION)
            acc_dw = tl.dot(du, tl.trans(s0), acc_dw, input_precision=STATE_PRECISION)
            acc_dgc += tl.sum(s0 * dsc, axis=1)
        mk = ok[:, None] & (kd < K)[None, :]
        tl.store(DQ + out[:, None] * K + kd[None, :], acc_dq, mask=mk)
        tl.store(DK + out[:, None] * K + kd[None, :], acc_dkc, mask=mk)
        tl.store(DW + (base + tt[:, None]) * K + kd[None, :], acc_dw, mask=(kd < K)[None, :])
        if KDA:
            tl.store(DG + out[:, None] * K + kd[None, :],
                     acc_dgc[None, :] + tl.zeros((C, KB), dtype=tl.float32), mask=mk)  # fmt: skip
        else:
            state_sum += tl.sum(acc_dgc, axis=0)
    if not KDA:
        tl.store(DG + out, state_sum, mask=ok)
    acc_dp = tl.zeros((C, C), dtype=tl.float32)
    acc_dt = tl.zeros((C, C), dtype=tl.float32)
    acc_db = tl.zeros((C,), dtype=tl.float32)
    for v0 in range(0, V, BV):
        vd = v0 + tl.arange(0, BV)
        mv = vd < V
        rows = (base + tt[:, None]) * V + vd[None, :]
        u = tl.load(U + rows, mask=mv[None, :], other=0.0)
        du = tl.load(DU + rows, mask=mv[None, :], other=0.0)
        okv = ok[:, None] & mv[None, :]
        do = tl.load(DO + n * sd_n + hv * sd_h + t[:, None] * sd_l + vd[None, :], mask=okv,
                     other=0.0).to(tl.float32)  # fmt: skip
        vv = tl.load(V_ + n * sv_n + hv * sv_h + t[:, None] * sv_l + vd[None, :], mask=okv,
                     other=0.0).to(tl.float32)  # fmt: skip
        acc_dp = tl.dot(do, tl.trans(u), acc_dp, input_precision=STATE_PRECISION)
        acc_dt = tl.dot(du, tl.trans(beta[:, None] * vv), acc_dt, input_precision=STATE_PRECISION)
        dy = _anticausal_dot(tl.trans(t_inv), du, tl.zeros((C, BV), dtype=tl.float32),
                             STATE_PRECISION)  # fmt: skip
        tl.store(DV + ((n * Hv + hv) * L + t[:, None]) * V + vd[None, :],
                 round_to(beta[:, None] * dy, DV.dtype.element_ty), mask=okv)  # fmt: skip
        acc_db += tl.sum(vv * dy, axis=1)
    square = (base * 2 + tt[:, None]) * C + tt[None, :]
    tl.store(DPT + square, acc_dp)
    tl.store(DPT + square + C * C, acc_dt)
    tl.store(DB + out, acc_db, mask=ok)


def _chunk_grads_k(
    Q, K_, G, BETA, TINV, P, DW, DPT, DQ, DK, DB, DG, SEQ, CU, OFFSETS,
    S_, L, nC, GROUP, K, SCALE,
    sq_n, sq_h, sq_l, sk_n, sk_h, sk_l, sg_n, sg_h, sg_l, sb_n, sb_h, sb_l,
    PACKED, L2NORM, STATE_PRECISION: tl.constexpr, C: tl.constexpr, KB: tl.constexpr,
):  # fmt: skip
    """Per (chunk slot, value head): the gradients of ``q``, ``k``, ``beta`` and the log gates
    at the chunk's positions, from :func:`_chunk_grads_v`'s sums (read from and written over
    ``DQ``, ``DK``, ``DB``, ``DG``, float32 ``(N, Hv, L, K)`` / ``(N, Hv, L)``: value heads that
    share a key head are added up after): the forward's algebra walked back, ``T``'s through
    ``dA = -T^T dT T^T``, the gates' through the sums of log gates each factor spans. ``KB``
    key columns at a time: a pass for the sums over them, the ``C x C`` algebra, a pass for
    ``dq`` and ``dk`` (and one through the l2 norm)."""
    s = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    Hv = tl.num_programs(1)
    n, first, end = _slot(SEQ, CU, OFFSETS, s, S_, nC, L, C, PACKED)
    h = hv // GROUP
    tt = tl.arange(0, C)
    t = first + tt
    ok = t < end
    lower = tt[:, None] > tt[None, :]
    lower_eq = tt[:, None] >= tt[None, :]
    g, beta, e = _gates(G, BETA, n, hv, first, end, sg_n, sg_h, sg_l, sb_n, sb_h, sb_l, C)
    gam = tl.exp(tl.cumsum(g, axis=0))
    bg = beta * gam
    expe = tl.exp(e)
    after = t + 1
    g_next = tl.load(G + n * sg_n + hv * sg_h + after * sg_l, mask=(after < end) & (tt + 1 < C),
                     other=0.0).to(tl.float32)  # fmt: skip
    gc = tl.exp(tl.cumsum(g_next, axis=0, reverse=True))
    rq = _norms(Q, n, h, first, end, sq_n, sq_h, sq_l, K, L2NORM, C, KB)
    rk = _norms(K_, n, h, first, end, sk_n, sk_h, sk_l, K, L2NORM, C, KB)
    base = (s * Hv + hv) * C
    out = (n * Hv + hv) * L + t
    square = (base * 2 + tt[:, None]) * C + tt[None, :]
    t_inv = tl.load(TINV + (base + tt[:, None]) * C + tt[None, :])
    zeros = tl.zeros((C, C), dtype=tl.float32)
    # U = T diag(beta) V - T diag(beta Gamma) K S0: dX = T^T dW, dT = dW X^T; the outputs
    # O = scale (Gamma Q S0 + P U); the last state S_C = Gamma_C S0 + (Gc K)^T U. First the
    # sums over the key columns.
    dt = tl.load(DPT + square + C * C)
    kk = tl.zeros((C, C), dtype=tl.float32)
    kdx = tl.zeros((C,), dtype=tl.float32)
    qdq = tl.zeros((C,), dtype=tl.float32)
    df = tl.zeros((C,), dtype=tl.float32)
    for k0 in range(0, K, KB):
        kd = k0 + tl.arange(0, KB)
        mk = ok[:, None] & (kd < K)[None, :]
        k = _block(K_, n, h, first, end, sk_n, sk_h, sk_l, K, k0, rk, C, KB)
        dw = -tl.load(DW + (base + tt[:, None]) * K + kd[None, :], mask=(kd < K)[None, :],
                      other=0.0)  # fmt: skip
        dx = _anticausal_dot(tl.trans(t_inv), dw, tl.zeros((C, KB), dtype=tl.float32),
                             STATE_PRECISION)  # fmt: skip
        dt = tl.dot(dw, tl.trans(bg[:, None] * k), dt, input_precision=STATE_PRECISION)
        kdx += tl.sum(k * dx, axis=1)
        kk = tl.dot(k, tl.trans(k), kk, input_precision=STATE_PRECISION)
        q = _block(Q, n, h, first, end, sq_n, sq_h, sq_l, K, k0, rq, C, KB)
        dq = tl.load(DQ + out[:, None] * K + kd[None, :], mask=mk, other=0.0)
        qdq += tl.sum(q * dq, axis=1)
        dkc = tl.load(DK + out[:, None] * K + kd[None, :], mask=mk, other=0.0)
        df += tl.sum(k * dkc, axis=1)
    db = tl.load(DB + out, mask=ok, other=0.0) + gam * kdx
    dgam = bg * kdx + SCALE * gam * qdq
    df = gc * df
    # T = (I + A)^{-1}, A_tj = beta_t (k_t . k_j) exp(E_tj): dA = -T^T dT T^T below the diagonal
    da = _anticausal_dot(tl.trans(t_inv), dt, zeros, STATE_PRECISION)
    # (T^T dT) T^T: column j reads the columns l <= j, the transpose of a causal product
    da = -tl.trans(_causal_dot(t_inv, tl.trans(da), zeros, tl.float32, STATE_PRECISION))
    da = tl.where(lower, da, 0.0)
    db += tl.sum(da * kk * expe, axis=1)
    de = da * tl.where(lower, beta[:, None] * kk * expe, 0.0)
    d_kk = da * beta[:, None] * expe
    dp = tl.where(lower_eq, SCALE * tl.load(DPT + square), 0.0)
    de += dp * tl.load(P + (base + tt[:, None]) * C + tt[None, :])
    dpe = dp * expe
    # the log gates: Gamma_t spans [first, t], E_tj (j, t], Gc_j (j, last], Gamma_C all
    # E_tj: g_s gets the de_tj with j < s <= t: sum_{j < s} of the column sums over t >= s
    # (running sums, no products with zeros)
    dg = tl.cumsum(dgam, axis=0, reverse=True)
    dg += tl.sum(tl.where(lower, tl.cumsum(de, axis=0, reverse=True), 0.0), axis=1)
    dg += tl.sum(tl.where(tt[:, None] < tt[None, :], df[:, None], 0.0), axis=0)
    dg += tl.exp(tl.sum(g, axis=0)) * tl.load(DG + out, mask=ok, other=0.0)
    tl.store(DB + out, db, mask=ok)
    tl.store(DG + out, dg, mask=ok)
    # then dq and dk, a block of key columns at a time, one after the other (together they
    # hold too many tiles at once)
    q_dq = tl.zeros((C,), dtype=tl.float32)
    for k0 in range(0, K, KB):
        kd = k0 + tl.arange(0, KB)
        mk = ok[:, None] & (kd < K)[None, :]
        k = _block(K_, n, h, first, end, sk_n, sk_h, sk_l, K, k0, rk, C, KB)
        dq = (SCALE * gam)[:, None] * tl.load(DQ + out[:, None] * K + kd[None, :], mask=mk,
                                              other=0.0)  # fmt: skip
        dq = _causal_dot(dpe, k, dq, tl.float32, STATE_PRECISION)
        q = _block(Q, n, h, first, end, sq_n, sq_h, sq_l, K, k0, rq, C, KB)
        q_dq += tl.sum(q * dq, axis=1)
        tl.debug_barrier()  # every thread has read this block of DQ
        tl.store(DQ + out[:, None] * K + kd[None, :], dq, mask=mk)
    k_dk = tl.zeros((C,), dtype=tl.float32)
    for k0 in range(0, K, KB):
        kd = k0 + tl.arange(0, KB)
        mk = ok[:, None] & (kd < K)[None, :]
        dw = -tl.load(DW + (base + tt[:, None]) * K + kd[None, :], mask=(kd < K)[None, :],
                      other=0.0)  # fmt: skip
        dk = bg[:, None] * _anticausal_dot(tl.trans(t_inv), dw,
                                           tl.zeros((C, KB), dtype=tl.float32),
                                           STATE_PRECISION)  # fmt: skip
        dk += gc[:, None] * tl.load(DK + out[:, None] * K + kd[None, :], mask=mk, other=0.0)
        q = _block(Q, n, h, first, end, sq_n, sq_h, sq_l, K, k0, rq, C, KB)
        dk = _anticausal_dot(tl.trans(dpe), q, dk, STATE_PRECISION)
        k = _block(K_, n, h, first, end, sk_n, sk_h, sk_l, K, k0, rk, C, KB)
        dk = _causal_dot(d_kk, k, dk, tl.float32, STATE_PRECISION)
        dk = _anticausal_dot(tl.trans(d_kk), k, dk, STATE_PRECISION)
        k_dk += tl.sum(k * dk, axis=1)
        tl.debug_barrier()  # every thread has read this block of DK
        tl.store(DK + out[:, None] * K + kd[None, :], dk, mask=mk)
    if L2NORM:
        _through_l2norm(Q, K_, DQ, DK, n, h, first, end, sq_n, sq_h, sq_l, sk_n, sk_h, sk_l, K,
                        rq, rk, q_dq, k_dk, out, C, KB)  # fmt: skip


@triton.jit
def _through_l2norm(Q, K_, DQ, DK, n, h, first, end, sq_n, sq_h, sq_l, sk_n, sk_h, sk_l, K,
                    rq, rk, q_dq, k_dk, out, C: tl.constexpr, KB: tl.constexpr):  # fmt: skip
    """``DQ`` and ``DK`` (the gradients of the normalised rows) through ``x / |x|``:
    ``(dx - x^ (x^ . dx)) / |x|``, ``q_dq`` and ``k_dk`` the rows' ``x^ . dx``."""
    ok = first + tl.arange(0, C) < end
    tl.debug_barrier()
    for k0 in range(0, K, KB):
        kd = k0 + tl.arange(0, KB)
        mk = ok[:, None] & (kd < K)[None, :]
        q = _block(Q, n, h, first, end, sq_n, sq_h, sq_l, K, k0, rq, C, KB)
        dq = tl.load(DQ + out[:, None] * K + kd[None, :], mask=mk, other=0.0)
        k = _block(K_, n, h, first, end, sk_n, sk_h, sk_l, K, k0, rk, C, KB)
        dk = tl.load(DK + out[:, None] * K + kd[None, :], mask=mk, other=0.0)
        tl.debug_barrier()
        tl.store(DQ + out[:, None] * K + kd[None, :],
                 rq[:, None] * (dq - q * q_dq[:, None]), mask=mk)  # fmt: skip
        tl.store(DK + out[:, None] * K + kd[None, :],
                 rk[:, None] * (dk - k * k_dk[:, None]), mask=mk)  # fmt: skip


def _chunk_grads_kda(
    Q, K_, G, BETA, TINV, DW, DPT, DQ, DK, DB, DG, SEQ, CU, OFFSETS,
    S_, L, nC, GROUP, K, SCALE,
    sq_n, sq_h, sq_l, sk_n, sk_h, sk_l, sg_n, sg_h, sg_l, sg_k, sb_n, sb_h, sb_l,
    PACKED, L2NORM, STATE_PRECISION: tl.constexpr,
    C: tl.constexpr, KB: tl.constexpr, GB: tl.constexpr,
):  # fmt: skip
    """:func:`_chunk_grads_k` for KDA's per-channel gates: every factor ``exp(E_tj)`` is one per
    key column, so ``A``'s and ``P``'s terms are ``C x C x GB`` tiles (as
    :func:`_gated_scores` forms them) and the gates' gradients are per column (``DG``
    ``(N, Hv, L, K)``). A pass over the key columns for ``dT`` and ``beta``'s sums, the
    ``C x C`` algebra (``KB`` columns at a time), then a pass for ``dq``, ``dk`` and the
    gates' (``GB`` at a time)."""
    s = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1).to(tl.int64)
    Hv = tl.num_programs(1)
    n, first, end = _slot(SEQ, CU, OFFSETS, s, S_, nC, L, C, PACKED)
    h = hv // GROUP
    tt = tl.arange(0, C)
    t = first + tt
    ok = t < end
    lower = tt[:, None] > tt[None, :]
    lower3 = lower[:, :, None]
    lower_eq3 = (tt[:, None] >= tt[None, :])[:, :, None]
    beta = tl.load(BETA + n * sb_n + hv * sb_h + t * sb_l, mask=ok, other=0.0).to(tl.float32)
    rq = _norms(Q, n, h, first, end, sq_n, sq_h, sq_l, K, L2NORM, C, GB)
    rk = _norms(K_, n, h, first, end, sk_n, sk_h, sk_l, K, L2NORM, C, GB)
    base = (s * Hv + hv) * C
    out = (n * Hv + hv) * L + t
    square = (base * 2 + tt[:, None]) * C + tt[None, :]
    t_inv = tl.load(TINV + (base + tt[:, None]) * C + tt[None, :])
    zeros = tl.zeros((C, C), dtype=tl.float32)
    # X = diag(beta) (Gamma o K), W = T X: dX = T^T dW, dT += dW X^T
    dt = tl.load(DPT + square + C * C)
    db = tl.load(DB + out, mask=ok, other=0.0)
    for k0 in range(0, K, KB):
        kd = k0 + tl.arange(0, KB)
        gam = tl.exp(tl.cumsum(_gate_block(G, n, hv, t, ok, k0, sg_n, sg_h, sg_l, sg_k, K, True,
                                           KB), axis=0))  # fmt: skip
        k = _block(K_, n, h, first, end, sk_n, sk_h, sk_l, K, k0, rk, C, KB)
        dw = -tl.load(DW + (base + tt[:, None]) * K + kd[None, :], mask=(kd < K)[None, :],
                      other=0.0)  # fmt: skip
        dx = _anticausal_dot(tl.trans(t_inv), dw, tl.zeros((C, KB), dtype=tl.float32),
                             STATE_PRECISION)  # fmt: skip
        dt = tl.dot(dw, tl.trans(beta[:, None] * gam * k), dt, input_precision=STATE_PRECISION)
        db += tl.sum(gam * k * dx, axis=1)
    kk = _gated_scores(K_, K_, G, n, h, hv, first, end, sk_n, sk_h, sk_l, sk_n, sk_h, sk_l,
                       sg_n, sg_h, sg_l, sg_k, K, rk, rk, False, C, GB)  # fmt: skip
    # T = (I + A)^{-1}, A_tj = beta_t sum_c k_tc k_jc exp(E_tjc): dA = -T^T dT T^T (j < t)
    da = _anticausal_dot(tl.trans(t_inv), dt, zeros, STATE_PRECISION)
    da = -tl.trans(_causal_dot(t_inv, tl.trans(da), zeros, tl.float32, STATE_PRECISION))
    da = tl.where(lower, da, 0.0)
    db += tl.sum(da * kk, axis=1)
    tl.store(DB + out, db, mask=ok)
    dab = (da * beta[:, None])[:, :, None]
    dp = tl.where(tt[:, None] >= tt[None, :], SCALE * tl.load(DPT + square), 0.0)[:, :, None]
    q_dq = tl.zeros((C,), dtype=tl.float32)
    k_dk = tl.zeros((C,), dtype=tl.float32)
    for k0 in range(0, K, GB):
        kd = k0 + tl.arange(0, GB)
        mk = ok[:, None] & (kd < K)[None, :]
        at = out[:, None] * K + kd[None, :]
        g = _gate_block(G, n, hv, t, ok, k0, sg_n, sg_h, sg_l, sg_k, K, True, GB)
        gam = tl.exp(tl.cumsum(g, axis=0))
        gc, total = _closing_gates(G, n, hv, first, end, k0, sg_n, sg_h, sg_l, sg_k, K, True, C,
                                   GB)  # fmt: skip
        e = tl.exp(tl.cumsum(tl.where(lower3, g[:, None, :], 0.0), axis=0))
        k = _block(K_, n, h, first, end, sk_n, sk_h, sk_l, K, k0, rk, C, GB)
        q = _block(Q, n, h, first, end, sq_n, sq_h, sq_l, K, k0, rq, C, GB)
        dw = -tl.load(DW + (base + tt[:, None]) * K + kd[None, :], mask=(kd < K)[None, :],
                      other=0.0)  # fmt: skip
        dx = _anticausal_dot(tl.trans(t_inv), dw, tl.zeros((C, GB), dtype=tl.float32),
                             STATE_PRECISION)  # fmt: skip
        dq_s = tl.load(DQ + at, mask=mk, other=0.0)  # dO S0^T
        dk_s = tl.load(DK + at, mask=mk, other=0.0)  # U dS_C^T
        d_total = tl.load(DG + at, mask=mk, other=0.0)  # sum(S0 o dS_C) per key row
        # each product masked after it is formed: a non-finite row reaches no row before
        a3 = dab * e
        p3 = dp * e
        dq = (SCALE * gam) * dq_s + tl.sum(tl.where(lower_eq3, p3 * k[None, :, :], 0.0), axis=1)
        dk = beta[:, None] * gam * dx + gc * dk_s
        dk += tl.sum(tl.where(lower_eq3, p3 * q[:, None, :], 0.0), axis=0)
        dk += tl.sum(tl.where(lower3, a3 * k[:, None, :], 0.0), axis=0)
        dk += tl.sum(tl.where(lower3, a3 * k[None, :, :], 0.0), axis=1)
        de = tl.where(lower3, a3 * k[:, None, :] * k[None, :, :], 0.0)
        de += tl.where(lower_eq3, p3 * q[:, None, :] * k[None, :, :], 0.0)
        # the log gates: Gamma_t spans [first, t], E_tj (j, t], Gc_j (j, last], Gamma_C all;
        # g_s gets E_tj's for j < s <= t: the sums over j < s of the reverse running sums
        dg = tl.cumsum(gam * (beta[:, None] * k * dx + SCALE * q * dq_s), axis=0, reverse=True)
        dg += tl.sum(tl.where(lower3, (gc * k * dk_s)[None, :, :], 0.0), axis=1)
        dg += tl.sum(tl.where(lower3, tl.cumsum(de, axis=0, reverse=True), 0.0), axis=1)
        dg += total[None, :] * d_total
        q_dq += tl.sum(q * dq, axis=1)
        k_dk += tl.sum(k * dk, axis=1)
        tl.debug_barrier()  # every thread has read these blocks
        tl.store(DQ + at, dq, mask=mk)
        tl.store(DK + at, dk, mask=mk)
        tl.store(DG + at, dg, mask=mk)
    if L2NORM:
        _through_l2norm(Q, K_, DQ, DK, n, h, first, end, sq_n, sq_h, sq_l, sk_n, sk_h, sk_l, K,
                        rq, rk, q_dq, k_dk, out, C, GB)  # fmt: skip


# One binary per dtype and tile: no specialisation on sizes, strides or flags.
_chunk_wy = untuned(_chunk_wy)
_chunk_states = untuned(_chunk_states)
_chunk_output = untuned(_chunk_output)
_chunk_states_bwd = untuned(_chunk_states_bwd)
_chunk_grads_v = untuned(_chunk_grads_v)
_chunk_grads_k = untuned(_chunk_grads_k)
_chunk_grads_kda = untuned(_chunk_grads_kda)

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


#: Widest key head: the walks and the backward's gradients take key rows a block at a time,
#: but the chunk's ``K K^T``, ``T`` and outputs take whole rows (128: Qwen3-Next's, Qwen3.5's,
#: Kimi Linear's); wider heads take the step kernels.
MAX_K = 128


def supported(k: torch.Tensor, g: torch.Tensor) -> bool:
    """Key heads up to :data:`MAX_K`, scalar gates or KDA's per-channel ones."""
    return k.shape[-1] <= MAX_K


def _plan(q, cu_seqlens, C):
    """``(sequences, chunks per row, slots, cu, offsets, seq_of)``: the chunk slots (``nC`` per
    batch row, or packed sequences' chunks one after another), their sequence (int64) and the
    first slot of each sequence, without a host synchronisation."""
    N, _, L, _ = q.shape
    i64 = {"dtype": torch.int64, "device": q.device}
    if cu_seqlens is None:
        nC = triton.cdiv(L, C)
        placeholder = torch.zeros(1, **i64)
        return N, nC, max(N * nC, 1), placeholder, placeholder, placeholder
    cu = cu_seqlens.to(torch.int64).contiguous()
    sequences = cu.numel() - 1
    counts = torch.div(cu[1:] - cu[:-1] + C - 1, C, rounding_mode="floor")
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    # at most L / C chunks plus one per sequence: no host synchronisation
    slots = max(L // C + sequences, 1)
    seq_of = torch.searchsorted(offsets[1:], torch.arange(slots, **i64), right=True)
    return sequences, 0, slots, cu, offsets, seq_of


def _meta(q, C):
    return {"DTYPE": _TL_DTYPES[q.dtype], "PRECISION": dot_precision(q.dtype), "C": C,
            "num_warps": WARPS, "num_stages": 1}  # fmt: skip


def _block_v(V: int) -> int:
    return min(BLOCK_V, max(16, triton.next_power_of_2(V)))


def _key_block(K: int, block: int = KEY_BLOCK) -> int:
    return min(block, max(16, triton.next_power_of_2(K)))


def _gate_key_block(K: int) -> int:
    """KDA's key columns a ``C x C x GB`` tile takes (no ``tl.dot``: any power of two)."""
    return min(KDA_KEY_BLOCK, triton.next_power_of_2(K))


def _register_ceiling(K: int, bv: int) -> int | None:
    """``maxnreg`` for the backward walk: :data:`MAX_REGISTERS` for the smallest state
    blocks, else None (ptxas's choice)."""
    return MAX_REGISTERS if _key_block(K, WALK_KEY_BLOCK) * bv <= 256 else None


def _state_precision(q) -> str:
    """float32 inputs: the user's float32 products (TF32 where enabled); 16-bit ones: float32's
    accuracy on tensor cores (three TF32 products)."""
    return dot_precision(q.dtype) if q.dtype == torch.float32 else "tf32x3"


def _walk(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm, C, plan, states_dtype,
          want_final, backward):  # fmt: skip
    """The first two launches: ``(W, U, T, P, states, final)``, ``U`` the chunks'
    ``U~ - W S0`` and ``states`` each chunk's starting state in ``states_dtype``; ``T`` and
    ``P`` only for the ``backward``, ``final`` only if wanted (else None)."""
    _, H, L, K = q.shape
    Hv, V = v.shape[1], v.shape[3]
    sequences, nC, slots, cu, offsets, seq_of = plan
    dev = q.device
    f32 = {"dtype": torch.float32, "device": dev}
    w = torch.empty((slots, Hv, C, K), **f32)
    u = torch.empty((slots, Hv, C, V), **f32)
    t_inv = torch.empty((slots, Hv, C, C), **f32) if backward else None
    scores = torch.empty((slots, Hv, C, C), **f32) if backward else None
    states = torch.empty((slots, Hv, K, V), dtype=states_dtype, device=dev)
    final = torch.empty((sequences, Hv, K, V), **f32)  # the walk's state, the last at the end
    unused = torch.empty(0, **f32)
    meta = _meta(q, C)
    bv = _block_v(V)
    group, packed, l2 = Hv // H, int(cu_seqlens is not None), int(use_qk_l2norm)
    gates = (*gate_strides(g), *beta.stride())
    kda = g.dim() == 4
    _chunk_wy[(slots, Hv)](
        q, k, v, g, beta, w, u, unused if t_inv is None else t_inv,
        unused if scores is None else scores, seq_of, cu, offsets, sequences,
        L, nC, group, K, V, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *gates, packed,
        l2, BACKWARD=backward, STATE_PRECISION=_state_precision(q), KDA=kda, BV=bv,
        KB=_gate_key_block(K) if kda else _key_block(K), GB=_gate_key_block(K),
        **{**meta, "num_warps": KDA_WY_WARPS if kda else WARPS},
    )  # fmt: skip
    init = initial_state
    sbv = min(STATE_BLOCK_V, bv)
    _chunk_states[(sequences, Hv, triton.cdiv(V, sbv))](
        k, g, w, u, states, init if init is not None else unused, final,
        cu, offsets, L, nC, group, K, V, *k.stride()[:3], *gate_strides(g),
        *(init.stride() if init is not None else (0, 0, 0, 0)),
        int(init is not None), packed, l2, STATE_PRECISION=_state_precision(q), KDA=kda, C=C,
        KB=_key_block(K, WALK_KEY_BLOCK), BV=sbv, num_warps=WALK_WARPS, num_stages=1,
    )  # fmt: skip
    return w, u, t_inv, scores, states, final if want_final else None


@serialised
def forward(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
            cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    """The op's forward (see :func:`supported`) in three launches."""
    q, k, v = unit_stride_rows(q), unit_stride_rows(k), unit_stride_rows(v)
    N, H, L, K = q.shape
    Hv, V = v.shape[1], v.shape[3]
    plan = _plan(q, cu_seqlens, CHUNK)
    sequences, nC, slots, cu, offsets, seq_of = plan
    _, u, _, _, states, final = _walk(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm,
                                   CHUNK, plan, q.dtype, output_final_state, False)  # fmt: skip
    out = torch.empty((N, Hv, L, V), dtype=q.dtype, device=q.device)
    bv = _block_v(V)
    _chunk_output[(slots, Hv, triton.cdiv(V, bv))](
        q, k, g, beta, states, u, out, seq_of, cu, offsets, sequences, L, nC, Hv // H, K, V,
        float(scale), *q.stride()[:3], *k.stride()[:3], *gate_strides(g), *beta.stride(),
        int(cu_seqlens is not None), int(use_qk_l2norm),
        **{**_meta(q, CHUNK), "BK": max(16, triton.next_power_of_2(K)), "BV": bv,
           "KDA": g.dim() == 4, "GB": _gate_key_block(K), "num_warps": OUTPUT_WARPS},
    )  # fmt: skip
    if final is None:
        return out, q.new_empty(0)
    return out, final.to(initial_state.dtype if initial_state is not None else torch.float32)


@serialised
def backward(g_out, g_final, q, k, v, g, beta, scale, initial_state=None,
             output_final_state=False, cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    """The op's backward (see :func:`supported`): the forward's states again (float32), the
    states' gradients walked back over the chunks, then every chunk's gradients at once."""
    q, k, v = unit_stride_rows(q), unit_stride_rows(k), unit_stride_rows(v)
    g_out = unit_stride_rows(g_out)
    N, H, L, K = q.shape
    Hv, V = v.shape[1], v.shape[3]
    C = CHUNK
    plan = _plan(q, cu_seqlens, C)
    sequences, nC, slots, cu, offsets, seq_of = plan
    w, u, t_inv, scores, states, _ = _walk(q, k, v, g, beta, initial_state, cu_seqlens,
                                           use_qk_l2norm, C, plan, torch.float32, False,
                                           True)  # fmt: skip
    f32 = {"dtype": torch.float32, "device": q.device}
    dsc = torch.empty((slots, Hv, K, V), **f32)
    du = torch.empty((slots, Hv, C, V), **f32)
    d_init = torch.empty((sequences, Hv, K, V), **f32)
    has_dfinal = output_final_state and g_final.numel() > 0
    kda = g.dim() == 4
    precision = _state_precision(q)
    bv = _block_v(V)
    sbv = min(STATE_BLOCK_V, bv)
    group, packed, l2 = Hv // H, int(cu_seqlens is not None), int(use_qk_l2norm)
    _chunk_states_bwd[(sequences, Hv, triton.cdiv(V, sbv))](
        q, k, g, w, scores, g_out, g_final if has_dfinal else d_init, dsc, du, d_init, cu, offsets,
        L, nC, group, K, V, float(scale), *q.stride()[:3], *k.stride()[:3], *gate_strides(g),
        *g_out.stride()[:3], *(g_final.stride() if has_dfinal else (0, 0, 0, 0)),
        int(has_dfinal), packed, l2, STATE_PRECISION=precision, KDA=kda, C=C,
        KB=_key_block(K, WALK_KEY_BLOCK), BV=sbv, num_warps=WALK_WARPS, num_stages=1,
        maxnreg=_register_ceiling(K, sbv),
    )  # fmt: skip
    dq = torch.empty((N, Hv, L, K), **f32)
    dk = torch.empty((N, Hv, L, K), **f32)
    db = torch.empty((N, Hv, L), **f32)
    dg = torch.empty((N, Hv, L, *((K,) if kda else ())), **f32)
    dv = torch.empty((N, Hv, L, V), dtype=v.dtype, device=q.device)
    dpt = torch.empty((slots, Hv, 2, C, C), **f32)
    if cu_seqlens is not None:  # positions in no sequence (past the last offset) stay zero
        for t in (dq, dk, db, dg, dv):
            t.zero_()
    _chunk_grads_v[(slots, Hv)](
        v, beta, t_inv, states, u, du, dsc, g_out, dq, dk, w, dpt, dv, db, dg, seq_of, cu,
        offsets, sequences, L, nC, K, V, *v.stride()[:3], *beta.stride(), *g_out.stride()[:3],
        packed, STATE_PRECISION=precision, KDA=kda, C=C, KB=_key_block(K), BV=bv,
        num_warps=GRAD_WARPS, num_stages=1,
    )  # fmt: skip
    if kda:
        _chunk_grads_kda[(slots, Hv)](
            q, k, g, beta, t_inv, w, dpt, dq, dk, db, dg, seq_of, cu, offsets, sequences, L, nC,
            group, K, float(scale), *q.stride()[:3], *k.stride()[:3], *gate_strides(g),
            *beta.stride(), packed, l2, STATE_PRECISION=GRAD_PRECISION, C=C,
            KB=_key_block(K, GRAD_KEY_BLOCK), GB=_gate_key_block(K), num_warps=GRAD_WARPS,
            num_stages=1,
        )  # fmt: skip
    else:
        _chunk_grads_k[(slots, Hv)](
            q, k, g, beta, t_inv, scores, w, dpt, dq, dk, db, dg, seq_of, cu, offsets, sequences,
            L, nC, group, K, float(scale), *q.stride()[:3], *k.stride()[:3], *g.stride(),
            *beta.stride(), packed, l2, STATE_PRECISION=GRAD_PRECISION, C=C,
            KB=_key_block(K, GRAD_KEY_BLOCK), num_warps=GRAD_WARPS, num_stages=1,
        )  # fmt: skip
    dq = dq.view(N, H, group, L, K).sum(2)
    dk = dk.view(N, H, group, L, K).sum(2)
    return (dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype), db.to(beta.dtype),
            None if initial_state is None else d_init.to(initial_state.dtype))  # fmt: skip
