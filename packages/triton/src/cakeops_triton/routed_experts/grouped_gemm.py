"""The grouped GEMM kernels of the routed experts (:mod:`cakeops_triton.routed_experts` runs
the experts' math on them) and their launchers, one launch for all experts each:

- ``_grouped_mm``: ``out[rows of e] = A[rows of e] @ W[e]^T`` (or ``@ W[e]``, by strides), its
  row tiles mapped to experts by the table, the rows of ``A`` optionally gathered through an
  index (the dispatch is a load, never a gathered copy of ``x``). ``MODE`` picks the fusion:
  ``SWIGLU`` (the forward) multiplies the rows by ``W_gate[e]`` and ``W_up[e]`` in one pass and
  stores ``silu(gate) * up`` in the activations' dtype; ``SWIGLU_BWD`` (the backward) adds
  ``u = g W_down[e]`` as a third product over the same ``K = D`` loop (or, on 128-row tiles,
  reads it from a ``PLAIN`` launch of its own) and runs the SwiGLU
  backward in the epilogue (``h``, the gate and up gradients, and each row's ``<h, u>`` partial
  for the routing weights); ``SUM2`` accumulates ``A W[e]^T + A2 W2[e]^T`` (the input gradient
  through gate and up). The ``PLAIN`` epilogue can scale each row by a per-row factor and store
  it at another row (``DST``): the combine -- the down projection writes ``w_ts y_ts`` straight
  into its ``(token, slot)`` place -- and the dispatch backward;
- ``_grouped_weight_grad``: ``dW[e] = A[rows of e]^T @ B[rows of e]``, each program walking one
  expert's rows in order (deterministic; an expert with no rows stores exact zeros), ``A``'s rows
  optionally gathered and scaled by a per-row factor as they load.

``_slot_sum_kernel`` then sums each token's ``top_k`` slots in slot order (deterministic, no
atomics: one read of the float32 slots, one write in ``x``'s dtype; dropped slots, ids ``>= E``,
left out), and ``_grouped_row_sum`` each expert's rows for the biases' gradients.

Forms of expert other than the default SwiGLU (``FORM``): the activation (``ACT``), its clamp
(``CLAMP``), GPT-OSS's offset, and the biases (``HAS_B1``, ``HAS_B2``) are applied in the same
epilogues; they are runtime values (one binary serves every form: the suite's dozen forms would
otherwise compile a dozen), only ``FORM`` and ``GATED`` (without a gate the first product is
the up projection's) are compile-time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cakeops.helpers import Activation, Routing
from cakeops_triton._common import (
    INTERPRET,
    dot,
    dot_precision,
    launch,
    mma_operands_in_registers,
    round_to,
    untuned,
)

# Row tiles are laid out by the tile table, so BLOCK_M is chosen per call (WIDE_BLOCK_M for the
# tuned 16-bit products on wgmma, where 128-row tiles halve the weight traffic from L2); the
# autotuner picks the rest per (N, K buckets, layout, mode) -- never per token count or exact
# size. The interpreter gets one small config.
BLOCK_M = 32 if INTERPRET else 64
WIDE_BLOCK_M = 128
if INTERPRET:
    _CONFIGS = [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32})]
    _GRAD_CONFIGS = [triton.Config({"BLOCK_P": 32, "BLOCK_Q": 32, "BLOCK_R": 32})]
else:
    _CONFIGS = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bn, bk, w, st in (
            # wide tiles, for rows and weights whose strides are multiples of 16 elements
            (128, 32, 8, 3), (128, 64, 8, 3), (256, 32, 8, 3), (64, 32, 8, 3),
            # narrow ones for the rest (loads one element at a time; the first serves the
            # untuned kernel of small problems)
            (32, 32, 8, 2), (32, 32, 4, 1), (32, 32, 4, 2),
            # float32 products (FMA: every operand in registers; tl.dot takes K >= 16)
            (32, 16, 4, 1), (32, 16, 8, 1),
        )
    ]  # fmt: skip
    _GRAD_CONFIGS = [
        triton.Config({"BLOCK_P": bp, "BLOCK_Q": bq, "BLOCK_R": br}, num_warps=w, num_stages=st)
        for bp, bq, br, w, st in ((64, 64, 64, 4, 3), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3),
                                  (256, 128, 64, 8, 3),
                                  (32, 32, 16, 4, 1))  # the last for float32 (FMA)
    ]  # fmt: skip
#: Problems of fewer rows (tokens x top_k) than this run one fixed config, untuned.
TUNE_FROM_ROWS = 4096
#: Outputs whose size bucket holds at least this many 128 x 128 tiles (per row block, or per
#: expert for the weights' gradients) are not tuned over narrower tiles: the wide ones leave
#: enough programs to fill the GPU and move less data per product.
WIDE_ENOUGH_TILES = 16
#: Registers a thread may give to the float32 accumulators (wgmma's on sm_90 are cheaper to hold
#: than mma.sync's, whose operands share the registers) and to operand tiles held in registers
#: (mma.sync on sm_80, and FMA products): over either budget a config spills at some shape.
ACC_REGISTERS = {"wgmma": 128, "registers": 64}
OPERAND_REGISTERS = {"mma": 24, "fma": 16}
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
MIN_BLOCK_N = min(c.kwargs["BLOCK_N"] for c in _CONFIGS)

# What _grouped_mm computes and stores (constexpr: kernels read only constexpr globals).
PLAIN: tl.constexpr = tl.constexpr(0)
SWIGLU: tl.constexpr = tl.constexpr(1)
SWIGLU_BWD: tl.constexpr = tl.constexpr(2)
SUM2: tl.constexpr = tl.constexpr(3)
#: The activations by number (``ACT``), in the spec's order.
ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "relu2": 4}


def _aligned(tensors, sizes=()) -> bool:
    """Every stride and size a multiple of 16 elements (or 1) and every tensor on 16 bytes:
    Triton then proves 16-byte vector loads. (A packed gate/up tensor's ``w_up`` view starts
    ``F * D`` elements in.)"""
    return all(n % 16 == 0 or n == 1 for n in sizes) and all(
        all(s % 16 == 0 or s == 1 for s in t.stride()) and t.data_ptr() % 16 == 0 for t in tensors
    )


def fits_mm(
    block_m: int,
    block_n: int,
    block_k: int,
    warps: int,
    mode: int,
    fma: bool,
    wgmma: bool,
    u_given: bool = False,
) -> bool:
    """The resource rule of a ``_grouped_mm`` config: its float32 accumulators (one per
    product kept apart) and, where they live in registers, its operand tiles fit per thread."""
    threads = 32 * warps
    accs = {PLAIN.value: 1, SUM2.value: 1, SWIGLU.value: 2, SWIGLU_BWD.value: 3}[mode]
    a_tiles = 2 if mode == SUM2.value or (mode == SWIGLU_BWD.value and not u_given) else 1
    w_tiles = accs + (mode == SUM2.value) - u_given
    acc = accs * block_m * block_n / threads
    operands = (a_tiles * block_m * block_k + w_tiles * block_k * block_n) / threads
    if fma:  # float32 operands: one register an element
        return acc <= ACC_REGISTERS["registers"] and operands <= OPERAND_REGISTERS["fma"]
    if wgmma:  # operands in shared memory
        return acc <= ACC_REGISTERS["wgmma"]
    return acc <= ACC_REGISTERS["registers"] and operands / 2 <= OPERAND_REGISTERS["mma"]


def _prune(configs, args, **kwargs):
    """Configs that fit by :func:`fits_mm` for every shape: wide tiles only where the layout
    is aligned (``LAYOUT``, :func:`_aligned`) and the kernel specialised to see it (from
    ``WIDE_ENOUGH_TILES`` column tiles, 128 wide or more), the BLOCK_K 16 tiles for float32
    products (FMA)."""
    fma = kwargs["DTYPE"] == tl.float32
    narrow = fma or args.get("UNTUNED", False) or not args["LAYOUT"]
    wgmma = not mma_operands_in_registers()
    wide_enough = args["N_BUCKET"] >= WIDE_ENOUGH_TILES * 128
    kept = [
        c
        for c in configs
        if (c.kwargs["BLOCK_N"] <= 32) == narrow
        and (c.kwargs["BLOCK_K"] <= 16) == fma
        and fits_mm(
            kwargs["BLOCK_M"],
            c.kwargs["BLOCK_N"],
            c.kwargs["BLOCK_K"],
            c.num_warps,
            kwargs["MODE"],
            fma,
            wgmma,
            kwargs.get("U_GIVEN", False),
        )
    ]
    if wide_enough and not narrow:  # of those that fit, the wide tiles only
        kept = [c for c in kept if c.kwargs["BLOCK_N"] >= 128] or kept
    return kept or configs[-1:]


def _prune_grad(configs, args, **kwargs):
    """float32 (FMA: operands in registers) takes the small tile, 16-bit the others, their
    accumulator within the register budget (wgmma's on sm_90, mma.sync's before), from
    ``WIDE_ENOUGH_TILES`` tiles 128 rows of P or more; a layout not aligned to 16 elements
    (``LAYOUT`` 0: masked loads one element at a time) the smallest 16-bit tile (a 128 x 64
    one spilled 36 bytes on sm_90 at D 1000). A scaled ``A`` tile is staged in float32
    registers before its product: the accumulator then gets half the budget."""
    small = kwargs["DTYPE"] == tl.float32
    budget = ACC_REGISTERS["registers" if mma_operands_in_registers() else "wgmma"]
    if kwargs["SCALED_A"]:
        budget //= 2
    wide_enough = args["P_BUCKET"] * args["Q_BUCKET"] >= WIDE_ENOUGH_TILES * 128 * 128
    smallest = min((c.kwargs["BLOCK_P"] for c in configs if c.kwargs["BLOCK_P"] > 32), default=32)
    if not args["LAYOUT"]:  # rows loaded element by element: the smallest tile fits
        wide_enough, configs = False, [c for c in configs if c.kwargs["BLOCK_P"] <= smallest]
    kept = [
        c
        for c in configs
        if (c.kwargs["BLOCK_P"] == 32) == small
        and c.kwargs["BLOCK_P"] * c.kwargs["BLOCK_Q"] / (32 * c.num_warps) <= budget
    ]
    if wide_enough and not small:  # of those that fit, the wide tiles only
        kept = [c for c in kept if c.kwargs["BLOCK_P"] >= 128] or kept
    return kept or configs[-1:]


@triton.jit
def _act(g, ACT, ALPHA):
    """``(act(g), act'(g))`` in float32 (``ACT`` numbers :data:`ACTIVATIONS`, a runtime value:
    one branch runs)."""
    if ACT == 0:  # silu with its slope: g * sigmoid(alpha g)
        sig = 1.0 / (1.0 + tl.exp(-ALPHA * g))
        a = g * sig
        da = sig * (1.0 + ALPHA * g * (1.0 - sig))
    elif ACT == 1:  # gelu (erf)
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    elif ACT == 2:  # gelu, tanh approximation (tanh from exp: saturates, never NaN)
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        th = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
        d_inner = 0.7978845608028654 * (1.0 + 0.134145 * g * g)
        a = 0.5 * g * (1.0 + th)
        da = 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * d_inner
    elif ACT == 3:  # relu: a NaN stays NaN (a GPU's tl.maximum would return the 0)
        a = tl.where(g < 0.0, 0.0, g)
        da = tl.where(g > 0.0, 1.0, 0.0)
    else:  # relu2, NaN kept as in relu
        p = tl.where(g < 0.0, 0.0, g)
        a = p * p
        da = 2.0 * p
    return a, da


@triton.jit
def _expert_form(acc, acc2, ALPHA, LIMIT, OFFSET, ACT, CLAMP, GATED: tl.constexpr):
    """Any form of expert but the default: ``(h, dh/dgate, dh/dup)`` from the gate and up
    pre-activations (biases added; without a gate ``acc2`` is the up projection and
    ``acc`` unused). With ``CLAMP`` the limit applies (a NaN stays NaN, and its gradient is
    zero, as ``torch.clamp``'s: the gradient passes with the bounds included)."""
    if GATED:
        gate, up = acc, acc2
        gate_ok = (gate <= LIMIT) | (CLAMP == 0)
        up_ok = ((up >= -LIMIT) & (up <= LIMIT)) | (CLAMP == 0)
        if CLAMP:
            gate = tl.where(gate > LIMIT, LIMIT, gate)
            up = tl.where(up > LIMIT, LIMIT, tl.where(up < -LIMIT, -LIMIT, up))
        a, da = _act(gate, ACT, ALPHA)
        up = up + OFFSET
        return a * up, tl.where(gate_ok, up * da, 0.0), tl.where(up_ok, a, 0.0)
    else:
        a, da = _act(acc2, ACT, ALPHA)
        return a, da, da


def _grouped_mm(
    A, A2, IDX, W, W2, W3, B1, B2, OUT, OUT2, OUT3, DWP, DST, SCALE, TILE_EXPERT, TILE_ROW, ENDS,
    ROWS, N, K, N_BUCKET, K_BUCKET, LAYOUT, stride_a, stride_a2,
    stride_we, stride_wn, stride_wk, stride_we2, stride_wn2, stride_wk2,
    stride_we3, stride_wn3, stride_wk3, stride_b1e, stride_b1n, stride_b2e, stride_b2n,
    ALPHA, LIMIT, OFFSET, ACT, CLAMP, HAS_B1, HAS_B2,
    GATHER: tl.constexpr, MODE: tl.constexpr, SCATTER: tl.constexpr, SCALED: tl.constexpr,
    DTYPE: tl.constexpr, PRECISION: tl.constexpr, U_GIVEN: tl.constexpr,
    FORM: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    row0 = tl.load(TILE_ROW + pid_m)
    if row0 >= ROWS:  # a tile past the last real one (the table is sized by an upper bound)
        return
    e = tl.load(TILE_EXPERT + pid_m).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(ENDS + e)
    if GATHER:
        src = tl.load(IDX + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a_mask = row_ok[:, None] & k_ok[None, :]
        w_mask = k_ok[:, None] & col_ok[None, :]
        a = tl.load(A + src[:, None] * stride_a + kk[None, :], mask=a_mask, other=0.0).to(DTYPE)
        w = tl.load(
            W + e * stride_we + kk[:, None] * stride_wk + cols[None, :] * stride_wn,
            mask=w_mask,
            other=0.0,
        )
        acc = dot(a, round_to(w, DTYPE), acc, PRECISION)
        if MODE == SUM2 or (MODE != PLAIN and GATED):  # the second weight (the up projection)
            w2 = tl.load(
                W2 + e * stride_we2 + kk[:, None] * stride_wk2 + cols[None, :] * stride_wn2,
                mask=w_mask,
                other=0.0,
            )
            if MODE == SUM2:  # ... against a second operand, into the same sum
                a2 = tl.load(A2 + src[:, None] * stride_a2 + kk[None, :], mask=a_mask, other=0.0)
                acc = dot(a2.to(DTYPE), round_to(w2, DTYPE), acc, PRECISION)
            else:  # ... against the same rows, kept apart
                acc2 = dot(a, round_to(w2, DTYPE), acc2, PRECISION)
        if MODE == SWIGLU_BWD and not U_GIVEN:  # u = g W_down[e]: the gradient's rows, W_down
            a3 = tl.load(A2 + src[:, None] * stride_a2 + kk[None, :], mask=a_mask, other=0.0)
            w3 = tl.load(
                W3 + e * stride_we3 + kk[:, None] * stride_wk3 + cols[None, :] * stride_wn3,
                mask=w_mask,
                other=0.0,
            )
            acc3 = dot(a3.to(DTYPE), round_to(w3, DTYPE), acc3, PRECISION)
    rows64 = rows.to(tl.int64)
    ok = row_ok[:, None] & col_ok[None, :]
    out = rows64[:, None] * N + cols[None, :]
    if U_GIVEN:  # u computed by a launch of its own: A2 holds its float32 rows, in row order
        acc3 = tl.load(A2 + rows64[:, None] * stride_a2 + cols[None, :], mask=ok, other=0.0)
    if FORM:  # noqa: SIM102 (a compile-time test around runtime ones)
        if MODE == SWIGLU or MODE == SWIGLU_BWD:  # noqa: SIM109 (the biases; up in acc2)
            if not GATED:
                acc2 = acc
            b_off = cols[None, :]
            if HAS_B1:  # the gate's
                acc += tl.load(B1 + e * stride_b1e + b_off * stride_b1n, mask=col_ok[None, :])
            if HAS_B2:  # the up projection's
                acc2 += tl.load(B2 + e * stride_b2e + b_off * stride_b2n, mask=col_ok[None, :])
    if MODE == SWIGLU:
        if FORM:
            h, _, _ = _expert_form(acc, acc2, ALPHA, LIMIT, OFFSET, ACT, CLAMP, GATED)
        else:
            h = acc / (1.0 + tl.exp(-acc)) * acc2
        tl.store(OUT + out, round_to(h, OUT.dtype.element_ty), mask=ok)
    elif MODE == SWIGLU_BWD:
        if FORM:
            h, dh_gate, dh_up = _expert_form(acc, acc2, ALPHA, LIMIT, OFFSET, ACT, CLAMP, GATED)
        else:
            sig = 1.0 / (1.0 + tl.exp(-acc))
            dh_up = acc * sig
            h = dh_up * acc2
            dh_gate = acc2 * sig * (1.0 + acc * (1.0 - sig))
        # <y, g> = <h W_down^T, g> = <h, u>: this column tile's part, summed over tiles on the host
        part = tl.sum(tl.where(ok, h * acc3, 0.0), axis=1)
        tl.store(DWP + pid_n.to(tl.int64) * ROWS + rows64, part, mask=row_ok)
        dh = acc3 * tl.load(SCALE + rows, mask=row_ok, other=0.0)[:, None]
        tl.store(OUT + out, round_to(h, OUT.dtype.element_ty), mask=ok)
        if GATED:
            tl.store(OUT2 + out, round_to(dh * dh_gate, OUT2.dtype.element_ty), mask=ok)
        tl.store(OUT3 + out, round_to(dh * dh_up, OUT3.dtype.element_ty), mask=ok)
    else:
        if FORM:  # noqa: SIM102 (a compile-time test around a runtime one)
            if HAS_B1:  # the down projection's bias, before the combine weight
                b_off = cols[None, :]
                acc += tl.load(B1 + e * stride_b1e + b_off * stride_b1n, mask=col_ok[None, :])
        if SCALED:
            acc *= tl.load(SCALE + rows, mask=row_ok, other=0.0)[:, None]
        if SCATTER:
            dst = tl.load(DST + rows, mask=row_ok, other=0).to(tl.int64)
            out = dst[:, None] * N + cols[None, :]
        tl.store(OUT + out, acc, mask=ok)


@triton.jit
def _source_rows(IDX, rows, ok, GATHER: tl.constexpr):
    """The rows to read for sorted ``rows``: gathered through ``IDX``, or the rows themselves."""
    if GATHER:
        return tl.load(IDX + rows, mask=ok, other=0).to(tl.int64)
    return rows.to(tl.int64)


def _grouped_weight_grad(
    A, IDX_A, SCALE_A, B, IDX_B, DW, STARTS, ENDS,
    stride_a, stride_b, P, Q, P_BUCKET, Q_BUCKET, LAYOUT,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, SCALED_A: tl.constexpr,
    DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    q = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    start = tl.load(STARTS + e)
    end = tl.load(ENDS + e)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = rows < end
        ra = _source_rows(IDX_A, rows, ok, GATHER_A)
        rb = _source_rows(IDX_B, rows, ok, GATHER_B)
        a = tl.load(
            A + ra[:, None] * stride_a + p[None, :], mask=ok[:, None] & (p < P)[None, :], other=0.0
        ).to(DTYPE)
        if SCALED_A:  # the combine weight of each row, applied as it loads
            s = tl.load(SCALE_A + rows, mask=ok, other=0.0)
            a = round_to(a.to(tl.float32) * s[:, None], DTYPE)
        b = tl.load(
            B + rb[:, None] * stride_b + q[None, :], mask=ok[:, None] & (q < Q)[None, :], other=0.0
        )
        acc = dot(tl.trans(a), b.to(DTYPE), acc, PRECISION)
    out = e * P * Q + p.to(tl.int64)[:, None] * Q + q[None, :]
    tl.store(DW + out, round_to(acc, DW.dtype.element_ty), mask=(p < P)[:, None] & (q < Q)[None, :])


def _grouped_row_sum(
    A, IDX, SCALE, OUT, STARTS, ENDS, stride_a, N, GATHER, SCALED,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``out[e] = sum over the rows r of e, in order, of A[r]`` (``A``'s rows optionally
    gathered and scaled as they load): the biases' gradients, float32 sums stored in ``OUT``'s
    dtype; an expert with no rows stores exact zeros."""
    e = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    start = tl.load(STARTS + e)
    end = tl.load(ENDS + e)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        ok = rows < end
        src = rows.to(tl.int64)
        if GATHER:  # a run-time flag, as SCALED: the three biases' sums share a binary
            src = tl.load(IDX + rows, mask=ok, other=0).to(tl.int64)
        a = tl.load(A + src[:, None] * stride_a + cols[None, :], mask=ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        if SCALED:
            a = a * tl.load(SCALE + rows, mask=ok, other=0.0)[:, None]
        acc += tl.sum(a, axis=0)
    tl.store(OUT + e * N + cols, round_to(acc, OUT.dtype.element_ty), mask=col_ok)


def _slot_sum_kernel(SLOTS, IDS, OUT, D, E, TOP_K, BLOCK_D: tl.constexpr):
    """``out[t] = sum_s slots[t, s]`` in slot order (deterministic), stored in ``OUT``'s dtype;
    a dropped slot (id ``>= E``: no expert wrote its row) adds nothing. ``TOP_K`` is a run-time
    value (one binary for every top-k)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for s in range(TOP_K):
        kept = tl.load(IDS + t * TOP_K + s) < E
        acc += tl.load(SLOTS + (t * TOP_K + s) * D + cols, mask=ok & kept, other=0.0)
    tl.store(OUT + t * D + cols, round_to(acc, OUT.dtype.element_ty), mask=ok)


# Each kernel autotuned (specialised on sizes and strides) and untuned, for small problems.
# The tuned _grouped_mm does not specialise on row counts or buckets, nor on the form's
# runtime values (an int 1 would be a compile-time constant: one binary per form).
_RUNTIME_MM = ["ROWS", "N_BUCKET", "K_BUCKET", "LAYOUT", "ACT", "CLAMP", "HAS_B1", "HAS_B2"]
_grouped_mm_tuned = triton.autotune(
    configs=_CONFIGS,
    # the <h, u> partials: a config writes the rows of its own column tiles only, so a wider
    # one timed after a narrower one would leave the narrower one's rows behind
    reset_to_zero=["DWP"],
    key=[
        "N_BUCKET",
        "K_BUCKET",
        "LAYOUT",
        "MODE",
        "GATHER",
        "DTYPE",
        "PRECISION",
        "BLOCK_M",
        "U_GIVEN",
    ],
    prune_configs_by={"early_config_prune": _prune},
)(triton.jit(do_not_specialize=_RUNTIME_MM)(_grouped_mm))
_grouped_mm_untuned = untuned(_grouped_mm)
_grouped_weight_grad_tuned = triton.autotune(
    configs=_GRAD_CONFIGS,
    key=[
        "P_BUCKET",
        "Q_BUCKET",
        "LAYOUT",
        "GATHER_A",
        "GATHER_B",
        "SCALED_A",
        "DTYPE",
        "PRECISION",
    ],
    prune_configs_by={"early_config_prune": _prune_grad},
)(triton.jit(do_not_specialize=["P_BUCKET", "Q_BUCKET", "LAYOUT"])(_grouped_weight_grad))
_grouped_weight_grad_untuned = untuned(_grouped_weight_grad)
# no configs to tune: "tuned" is specialised (but not on top-k)
_slot_sum_tuned = triton.jit(do_not_specialize=["TOP_K"])(_slot_sum_kernel)
_slot_sum_untuned = untuned(_slot_sum_kernel)
_row_sum_tuned = triton.jit(do_not_specialize=["GATHER", "SCALED"])(_grouped_row_sum)
_row_sum_untuned = untuned(_grouped_row_sum)


def slot_sum(slots: torch.Tensor, routing: Routing, dtype: torch.dtype) -> torch.Tensor:
    """The ``(T * top_k, D)`` float32 rows in ``(token, slot)`` order summed per token (dropped
    slots left out): one read of the slots, one write of the result in ``dtype``."""
    D, top_k = slots.shape[1], routing.experts.shape[1]
    E = routing.offsets.numel() - 1
    out = torch.empty((slots.shape[0] // top_k, D), dtype=dtype, device=slots.device)
    block_d = min(1024, triton.next_power_of_2(max(D, 16)))
    kernel = _slot_sum_tuned if slots.shape[0] >= TUNE_FROM_ROWS else _slot_sum_untuned
    grid = (out.shape[0], triton.cdiv(D, block_d))
    kernel[grid](slots, routing.experts.contiguous(), out, D, E, top_k, BLOCK_D=block_d)
    return out


def _bucket(n: int) -> int:
    """The autotune key of a size: its power of two (never the exact size)."""
    return triton.next_power_of_2(max(n, 1))


def _strides(w: torch.Tensor, transpose: bool = False) -> tuple[int, int, int]:
    """``(expert, n, k)`` strides reading ``w[e]`` as ``W[e]`` (``a @ W[e]^T``) or, transposed,
    as ``W[e]^T`` (``a @ W[e]``)."""
    return (w.stride(0), w.stride(2), w.stride(1)) if transpose else w.stride()


def matmul(
    a, idx, w, tables, n_out: int, k_in: int, *, transpose=False, w2=None, w3=None, a2=None,
    mode=PLAIN, dst=None, scale=None, block_m=BLOCK_M, u=None, b1=None, b2=None, form=None,
):  # fmt: skip
    """Grouped ``a @ W[e]^T`` (``a @ W[e]`` with ``transpose``) with the ``mode``'s fusion.

    ``PLAIN``: float32 rows, row ``i`` times ``scale[i]`` stored at row ``dst[i]`` when given;
    ``SWIGLU``: ``silu(a W[e]^T) * (a w2[e]^T)`` in the product dtype (``a``'s, or float32
    with float32 weights); ``SUM2``:
    ``a W[e]^T + a2 w2[e]^T`` (float32); ``SWIGLU_BWD`` (``a2`` the gradient rows, ``w3`` the
    down weight): ``(h, d_gate, d_up)`` in the product dtype and the ``<h, u>`` partials, float32
    ``(column tiles, rows)``; given ``u`` (float32 rows of ``g W_down[e]`` in row order,
    computed by a launch of their own), it is read instead of computed.

    ``form`` (an :class:`Activation`, None for the default SwiGLU) sets the activation of the
    ``SWIGLU`` modes; without a gate ``w`` is the up projection's weight and ``w2`` is unused.
    ``b1`` is the gate's bias (the down projection's in ``PLAIN``), ``b2`` the up projection's.
    """
    tile_expert, tile_row, _, ends = tables
    rows = idx.numel() if idx is not None else a.shape[0]
    mode = getattr(mode, "value", mode)
    compute = torch.promote_types(a.dtype, w.dtype)
    stores_products = mode in (SWIGLU.value, SWIGLU_BWD.value)
    out = torch.empty((rows, n_out), dtype=compute if stores_products else torch.float32,
                      device=a.device)  # fmt: skip
    out2, out3 = out, out
    gated = form is None or form.gated
    if mode != SWIGLU_BWD.value:
        # the partials exist in SWIGLU_BWD alone; elsewhere one element the kernel never reads
        # (the autotuner zeroes it between configs: see _grouped_mm_tuned)
        dwp = torch.zeros(1, dtype=torch.float32, device=a.device)
    else:
        out2, out3 = (torch.empty_like(out) if gated else out), torch.empty_like(out)
        # zeros: the autotuner's tile width decides how many of these rows are written
        dwp = torch.zeros((triton.cdiv(n_out, MIN_BLOCK_N), rows), dtype=torch.float32,
                          device=a.device)  # fmt: skip
    a2 = (a if a2 is None else a2) if u is None else u
    w2, w3 = (w if w2 is None else w2), (w if w3 is None else w3)
    ws, ws2, ws3 = _strides(w, transpose), _strides(w2, transpose), _strides(w3, True)
    # the layout is part of the autotune key: wide tiles only where vector loads are proved
    layout = int(_aligned((a, a2, w, w2, w3), (n_out, k_in)))

    def grid(meta):
        return (tile_expert.numel(), triton.cdiv(n_out, meta["BLOCK_N"]))

    b1_, b2_ = (out if b is None else b for b in (b1, b2))
    act = form or Activation()
    args = (
        a, a2, a if idx is None else idx, w, w2, w3, b1_, b2_,
        out, out2, out3, dwp, out if dst is None else dst, out if scale is None else scale,
        tile_expert, tile_row, ends, rows, n_out, k_in, _bucket(n_out), _bucket(k_in), layout,
        a.stride(0), a2.stride(0), *ws, *ws2, *ws3, *b1_.stride()[:2], *b2_.stride()[:2],
        act.alpha, act.limit or 0.0, act.up_offset, ACTIVATIONS[act.name],
        int(act.limit is not None), int(b1 is not None), int(b2 is not None),
    )  # fmt: skip
    meta = {"GATHER": idx is not None, "MODE": mode, "SCATTER": dst is not None,
            "SCALED": scale is not None, "DTYPE": _TL_DTYPES[compute],
            "PRECISION": dot_precision(compute), "BLOCK_M": block_m,
            "U_GIVEN": u is not None, "FORM": form is not None, "GATED": gated}  # fmt: skip
    kernels = (_grouped_mm_tuned, _grouped_mm_untuned)
    launch(kernels, grid, args, meta, tuned=rows >= TUNE_FROM_ROWS)
    if mode == SWIGLU_BWD.value:
        return out, out2, out3, dwp
    return out


def weight_grad(
    a, idx_a, b, idx_b, tables, num_experts: int, dtype: torch.dtype, scale_a=None
) -> torch.Tensor:
    """``dW[e] = A_e^T B_e`` for every expert (``A``'s rows times ``scale_a``), ``(E, P, Q)``
    accumulated in float32 and stored once in ``dtype`` (the weight's)."""
    _, _, starts, ends = tables
    P, Q = a.shape[1], b.shape[1]
    compute = torch.promote_types(a.dtype, b.dtype)
    dw = torch.empty((num_experts, P, Q), dtype=dtype, device=a.device)

    def grid(meta):
        return (num_experts, triton.cdiv(P, meta["BLOCK_P"]), triton.cdiv(Q, meta["BLOCK_Q"]))

    args = (
        a, a if idx_a is None else idx_a, a if scale_a is None else scale_a,
        b, b if idx_b is None else idx_b, dw, starts, ends, a.stride(0), b.stride(0), P, Q,
        _bucket(P), _bucket(Q), int(_aligned((a, b), (P, Q))),
    )  # fmt: skip
    meta = {"GATHER_A": idx_a is not None, "GATHER_B": idx_b is not None,
            "SCALED_A": scale_a is not None, "DTYPE": _TL_DTYPES[compute],
            "PRECISION": dot_precision(compute)}  # fmt: skip
    kernels = (_grouped_weight_grad_tuned, _grouped_weight_grad_untuned)
    launch(kernels, grid, args, meta, tuned=a.shape[0] >= TUNE_FROM_ROWS)
    return dw


def row_sum(a, idx, tables, num_experts: int, dtype: torch.dtype, scale=None) -> torch.Tensor:
    """Each expert's rows of ``a`` summed (``a``'s rows gathered through ``idx`` and times
    ``scale`` when given), ``(E, N)`` in ``dtype``: a bias's gradient. One fixed 32 x 128 tile
    of float32 a program (32 registers a thread at 4 warps: no spill at any width)."""
    _, _, starts, ends = tables
    N = a.shape[1]
    out = torch.empty((num_experts, N), dtype=dtype, device=a.device)
    kernel = _row_sum_tuned if a.shape[0] >= TUNE_FROM_ROWS else _row_sum_untuned
    # absent tensors as empty ones of a present one's dtype: one signature with the flags off
    unused = torch.empty(0, dtype=torch.float32, device=a.device)
    kernel[(num_experts, triton.cdiv(N, 128))](
        a, unused.to(torch.int64) if idx is None else idx, unused if scale is None else scale,
        out, starts, ends, a.stride(0), N, int(idx is not None), int(scale is not None),
        BLOCK_R=32, BLOCK_N=128, num_warps=4,
    )  # fmt: skip
    return out


def rows_per_tile(routing: Routing, x: torch.Tensor, *weights: torch.Tensor) -> int:
    """Rows per tile: ``WIDE_BLOCK_M`` for tuned problems whose products are 16-bit on wgmma
    with a layout of 16-element strides (operands in shared memory, loaded as vectors, leave
    registers for 128-row accumulators), else ``BLOCK_M``."""
    compute = x.dtype
    for w in weights:
        compute = torch.promote_types(compute, w.dtype)
    aligned = _aligned((x, *weights), (*x.shape[1:], *weights[0].shape[1:]))
    wide = routing.order.numel() >= TUNE_FROM_ROWS and compute != torch.float32 and aligned
    return WIDE_BLOCK_M if wide and not mma_operands_in_registers() else BLOCK_M
