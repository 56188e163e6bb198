"""Causal linear attention in Triton, chunked.

One kernel computes ``out_i = sum_{j in causal(i)} (a_i . b_j) c_j`` over chunks of
``BLOCK_L`` positions: within a chunk a masked ``tl.dot`` of scores and values, across chunks one
float32 ``E x BLOCK_M`` state in registers. ``causal(i)`` is ``j <= i`` (forward in time) or
``j >= i`` (``REVERSE``: chunks walked from the end). The forward is ``(q, k, v)``; the backward is
three more runs of the same kernel: ``dq = (g, v, k)`` forward, ``dk = (v, g, q)`` and
``dv = (k, q, g)`` in reverse. NaN and Inf in ``c`` bypass the masked product (see the
kernel), so they reach only their causal range. Inputs are read through their strides (no copies
of transposed views) and partial tiles are masked, not padded.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cakeops.helpers import (
    backward_by_scans,
    key_head_sums,
    log_multipliers,
    value_heads,
)
from cakeops_triton._common import (
    INTERPRET,
    dot,
    dot_precision,
    launch,
    mma_operands_in_registers,
    round_to,
    serialised,
    unit_stride_rows,
    untuned,
)
from cakeops_triton.causal_dot_product import log_grads
from cakeops_triton.causal_dot_product.gaps import chunk_sums

# Chunk length and warps, tuned per (head-size bucket, direction, precision) -- never per exact
# head size or sequence length. The interpreter gets one config.
if INTERPRET:
    _CONFIGS = [triton.Config({"BLOCK_L": 16})]
else:
    _CONFIGS = [
        triton.Config({"BLOCK_L": bl}, num_warps=w, num_stages=st)
        for bl, w, st in (
            # 16-bit inputs (tensor cores, operands staged through shared memory)
            (16, 4, 2),
            (32, 4, 2),
            (64, 4, 2),
            (16, 8, 2),
            (32, 8, 2),
            (64, 8, 2),
            # float32 inputs (FMA dots with every operand in registers: 8 warps, no pipelining)
            (16, 8, 1),
            (32, 8, 1),
            (16, 4, 1),
        )
    ]
#: Problems of fewer positions (N * H * L) than this run one fixed config, untuned: tuning them
#: would cost more compilations than their run time.
TUNE_FROM_POSITIONS = 16384
#: Registers a thread may give to the float32 tiles (state, scores, output) and, where the MMA
#: operands live in registers (sm_80's mma.sync), to the 16-bit tiles: a config over either
#: budget spills at some head size (nox -s gpu_compile sweeps them).
F32_REGISTERS = 64
OPERAND_REGISTERS = 18
#: Elements of one tensor-core MMA tile (m16n8): a 16-bit config gives each warp at least one
#: of the chunk's ``BLOCK_L x BLOCK_M`` products (a 16-position chunk of 32 columns, 4 warps).
MMA_TILE = 16 * 8
#: Widest head block whose every chunk fits: at BLOCK_E 256 only 16-position chunks on 8 warps
#: compile without spilling on sm_90 and sm_80 (the sweep shows 8-560 bytes for every other).
WIDE_BLOCK_E = 256
#: Widest feature block of the float32 runs with log multipliers: wider heads run as sums of
#: runs over 64-wide slices of E (the scan is linear in ``a . b``), so their FMA tiles fit
#: (wider ones spill on sm_80 and sm_90: nox -s gpu_compile sweeps them).
WIDE_F32_E = 64


def _block_m(args) -> int:
    """Columns of ``v`` per program: the float32 ``E x BLOCK_M`` state stays within 4096
    elements for 16-bit inputs (32 registers a thread at 4 warps) and 2048 for float32 ones
    (512 with log multipliers, whose decay tiles take the rest)."""
    f32 = 512 if args.get("HAS_LM") else 2048
    cap = max(16, (4096 if args["A"].element_size() < 4 else f32) // args["BLOCK_E"])
    return max(16, min(cap, 64, triton.next_power_of_2(args["M"])))


def fits(block_l: int, block_e: int, block_m: int, warps: int, operands_in_registers: bool,
         decays: bool = False):  # fmt: skip
    """The resource rule of a 16-bit config: its tiles fit the register budgets per thread
    (with log multipliers, ``decays``, the ``BLOCK_L x BLOCK_L`` float32 square counts five
    times: the scores, the gaps' two parts (high and low sums), their exps and the masked
    product)."""
    if block_e >= WIDE_BLOCK_E:
        return block_l == 16 and warps == 8
    threads = 32 * warps
    squares = 5 if decays else 1
    f32 = (block_e * block_m + squares * block_l * block_l + block_l * block_m) / threads
    operands = (2 * block_l * block_e + block_l * block_m) / (2 * threads)
    return f32 <= F32_REGISTERS and (not operands_in_registers or operands <= OPERAND_REGISTERS)


def _prune(configs, args, **kwargs):
    """The configs that fit by the resource rules, whatever the head sizes. float32: the
    unpipelined 8-warp configs, 16-position chunks from E = 128; with log multipliers (E at
    most ``WIDE_F32_E``), 16 positions on 4 warps. 16-bit: :func:`fits`, the operands counted
    in registers before sm_90 (no wgmma), and no more warps than ``MMA_TILE`` tiles."""
    block_e = kwargs["BLOCK_E"]
    if args["A"].element_size() == 4:
        if kwargs.get("HAS_LM", False):
            return [c for c in configs if c.num_stages == 1 and c.num_warps == 4]
        fp32 = [c for c in configs if c.num_stages == 1 and c.num_warps == 8]
        return [c for c in fp32 if block_e < 128 or c.kwargs["BLOCK_L"] == 16]
    block_m = _block_m({**args, "BLOCK_E": block_e})
    in_registers = mma_operands_in_registers()
    kept = [
        c
        for c in configs
        if c.num_stages > 1
        and fits(
            c.kwargs["BLOCK_L"],
            block_e,
            block_m,
            c.num_warps,
            in_registers,
            kwargs.get("HAS_LM", False),
        )
    ]
    # every warp holds at least one m16n8 tensor-core tile of the chunk's BLOCK_L x BLOCK_M
    # products (more warps would repeat each other's work on them); not for the untuned kernel
    # with log multipliers, which takes the shortest chunk: its run-time flags and the decays'
    # squares spilled at 32 positions on sm_80 (Triton 3.7) where no count above sees it
    if not (args.get("UNTUNED") and kwargs.get("HAS_LM", False)):
        kept = [c for c in kept if c.num_warps * MMA_TILE <= c.kwargs["BLOCK_L"] * block_m] or kept
    return kept or [c for c in configs if c.kwargs["BLOCK_L"] == 16 and c.num_warps == 8][:1]


@triton.jit
def _causal_scan(
    A, B, C, OUT, LM, INIT, FINAL, CU,
    L, H, E, M, SCALE,
    sa_n, sa_h, sa_l, sb_n, sb_h, sb_l, sc_n, sc_h, sc_l,
    si_s, si_h, si_e, si_m, sf_s, sf_h, sf_e, sf_m,
    REVERSE: tl.constexpr, PRECISION: tl.constexpr, HAS_LM: tl.constexpr,
    HAS_INIT, HAS_FINAL, PACKED,
    BLOCK_L: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """The scan of one program (see the module's docstring). ``HAS_INIT``, ``HAS_FINAL`` and
    ``PACKED`` are compile-time in the tuned kernel and run-time flags in the untuned one."""
    pid_nh = tl.program_id(0)
    pid_m = tl.program_id(1)
    h = (pid_nh % H).to(tl.int64)
    # the program's sequence: a batch row, or (PACKED) one of the packed sequences of row 0
    seq = (pid_nh // H).to(tl.int64)
    n = seq
    first = (L * 0).to(tl.int32)
    end = L.to(tl.int32)
    if PACKED:
        n = seq * 0
        first = tl.load(CU + seq).to(tl.int32)
        end = tl.load(CU + seq + 1).to(tl.int32)
    e = tl.arange(0, BLOCK_E)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = tl.arange(0, BLOCK_L)
    a_base = A + n * sa_n + h * sa_h
    b_base = B + n * sb_n + h * sb_h
    c_base = C + n * sc_n + h * sc_h
    out_base = OUT + (n * H + h) * L * M
    dtype = C.dtype.element_ty
    # The running state sum_j b_j c_j^T, kept in float32 and fed to the dot in the inputs' dtype.
    em = (e < E)[:, None] & (m < M)[None, :]
    state = tl.zeros((BLOCK_E, BLOCK_M), dtype=tl.float32)
    if HAS_INIT:
        init = INIT + seq * si_s + h * si_h + e.to(tl.int64)[:, None] * si_e + m[None, :] * si_m
        state = tl.load(init, mask=em, other=0.0).to(tl.float32)
    if REVERSE:
        keep = t[:, None] <= t[None, :]
    else:
        keep = t[:, None] >= t[None, :]
    chunks = tl.cdiv(end - first, BLOCK_L)
    for i in range(0, chunks):
        if REVERSE:
            start = first + (chunks - 1 - i) * BLOCK_L
        else:
            start = first + i * BLOCK_L
        pos = start + t
        pos64 = pos.to(tl.int64)
        ok = pos < end
        ae = ok[:, None] & (e < E)[None, :]
        cm = ok[:, None] & (m < M)[None, :]
        a = tl.load(a_base + pos64[:, None] * sa_l + e[None, :], mask=ae, other=0.0)
        b = tl.load(b_base + pos64[:, None] * sb_l + e[None, :], mask=ae, other=0.0)
        v = tl.load(c_base + pos64[:, None] * sc_l + m[None, :], mask=cm, other=0.0)
        zero = tl.zeros((BLOCK_L, BLOCK_M), dtype=tl.float32)
        # earlier chunks through the state, then this chunk's masked scores (in v's dtype)
        out = dot(a, round_to(state, dtype), zero, PRECISION)
        scores = dot(a, tl.trans(b), tl.zeros((BLOCK_L, BLOCK_L), dtype=tl.float32), PRECISION)
        if HAS_LM:
            # the chunk's sums of log multipliers (see .gaps): cum from its start, tail from a
            # position to its end
            hi, lo, tail, last = chunk_sums(LM + (n * H + h) * L, pos, end, BLOCK_L)
            cum = hi + lo
            if REVERSE:  # [i, j] = exp(lm_{i+1} + .. + lm_j) for j >= i; the state by the tail
                gap = (hi[None, :] - hi[:, None]) + (lo[None, :] - lo[:, None])
                out = out * tl.exp(tail)[:, None]
            else:  # [i, j] = exp(lm_{j+1} + .. + lm_i) for j <= i; the state by exp(cum_i)
                gap = (hi[:, None] - hi[None, :]) + (lo[:, None] - lo[None, :])
                out = out * tl.exp(cum)[:, None]
            scores = scores * tl.exp(tl.where(keep, gap, -float("inf")))
        scores = round_to(tl.where(keep, scores, 0.0), dtype)
        # No masked zero times a NaN or Inf of v: those enter through a running sum instead,
        # reaching only the positions in their causal range (the non-finite contract).
        finite = tl.abs(v) < float("inf")
        out = dot(scores, tl.where(finite, v, 0.0), out, PRECISION)
        bad = tl.where(finite, 0.0, v.to(tl.float32))
        out += tl.cumsum(bad, axis=0, reverse=REVERSE)
        # scaled before it is rounded: a 16-bit output holds the scaled value, whatever the
        # unscaled one's range
        tl.store(out_base + pos64[:, None] * M + m[None, :],
                 round_to(out * SCALE, OUT.dtype.element_ty), mask=cm)  # fmt: skip
        if HAS_LM:
            if REVERSE:  # carried to the chunk before: exp(b_last) S + sum_j exp(b_j) b_j c_j^T
                weight = tl.exp(cum)
            else:  # carried on: exp(b_last) S + sum_j exp(tail_j) b_j c_j^T
                weight = tl.exp(tail)
            bw = round_to(b.to(tl.float32) * weight[:, None], dtype)
            state = dot(tl.trans(bw), v, state * tl.exp(last), PRECISION)
        else:
            state = dot(tl.trans(b), v, state, PRECISION)
    if HAS_FINAL:
        final = FINAL + seq * sf_s + h * sf_h + e.to(tl.int64)[:, None] * sf_e + m[None, :] * sf_m
        tl.store(final, state, mask=em)


def _causal_kernel(
    A, B, C, OUT, LM, INIT, FINAL, CU,
    L, H, E, M, M_BUCKET, SCALE,
    sa_n, sa_h, sa_l, sb_n, sb_h, sb_l, sc_n, sc_h, sc_l,
    si_s, si_h, si_e, si_m, sf_s, sf_h, sf_e, sf_m,
    REVERSE: tl.constexpr, PRECISION: tl.constexpr, HAS_LM: tl.constexpr,
    HAS_INIT: tl.constexpr, HAS_FINAL: tl.constexpr, PACKED: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    _causal_scan(
        A, B, C, OUT, LM, INIT, FINAL, CU, L, H, E, M, SCALE,
        sa_n, sa_h, sa_l, sb_n, sb_h, sb_l, sc_n, sc_h, sc_l,
        si_s, si_h, si_e, si_m, sf_s, sf_h, sf_e, sf_m,
        REVERSE, PRECISION, HAS_LM, HAS_INIT, HAS_FINAL, PACKED, BLOCK_L, BLOCK_E, BLOCK_M,
    )  # fmt: skip


def _causal_kernel_untuned(
    A, B, C, OUT, LM, INIT, FINAL, CU,
    L, H, E, M, M_BUCKET, SCALE,
    sa_n, sa_h, sa_l, sb_n, sb_h, sb_l, sc_n, sc_h, sc_l,
    si_s, si_h, si_e, si_m, sf_s, sf_h, sf_e, sf_m,
    REVERSE: tl.constexpr, PRECISION: tl.constexpr, HAS_LM: tl.constexpr,
    HAS_INIT, HAS_FINAL, PACKED,
    BLOCK_L: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    _causal_scan(
        A, B, C, OUT, LM, INIT, FINAL, CU, L, H, E, M, SCALE,
        sa_n, sa_h, sa_l, sb_n, sb_h, sb_l, sc_n, sc_h, sc_l,
        si_s, si_h, si_e, si_m, sf_s, sf_h, sf_e, sf_m,
        REVERSE, PRECISION, HAS_LM, HAS_INIT, HAS_FINAL, PACKED, BLOCK_L, BLOCK_E, BLOCK_M,
    )  # fmt: skip


# the kernel autotuned (specialised on sizes, strides and options), and untuned for small
# problems, where the options read or written once per program (initial and final states,
# packed sequences) are run-time flags: one binary for all of them
_causal_tuned = triton.autotune(
    configs=_CONFIGS,
    key=["BLOCK_E", "M_BUCKET", "REVERSE", "PRECISION", "HAS_LM"],
    prune_configs_by={"early_config_prune": _prune},
)(
    triton.heuristics({"BLOCK_M": _block_m})(
        triton.jit(do_not_specialize=["L", "E", "M", "M_BUCKET"])(_causal_kernel)
    )
)
_causal_untuned = untuned(_causal_kernel_untuned, {"BLOCK_M": _block_m})


def _block_e(a: torch.Tensor, E: int, decays: bool) -> int:
    """The feature block: E's power of two; float32 with log multipliers always
    ``WIDE_F32_E`` (their one tile shape that compiles without spills on sm_80 and sm_90;
    wider heads come in slices, see :func:`_run_sliced`)."""
    block = max(16, triton.next_power_of_2(E))
    return max(block, WIDE_F32_E) if decays and a.element_size() == 4 else block


def _run(a, b, c, reverse: bool, lm=None, init=None, final=None, cu=None,
         out_dtype=None, scale=None) -> torch.Tensor:  # fmt: skip
    """One scan (see the kernel): ``lm`` float32 ``(N, H, L)`` log multipliers, ``init`` the
    starting states ``(S, H, E, M)`` read through their strides, ``final`` a float32 tensor
    the last states are written to (through its strides), ``cu`` packed sequences' offsets,
    ``scale`` what the output is multiplied by before it is rounded."""
    a, b, c = unit_stride_rows(a), unit_stride_rows(b), unit_stride_rows(c)
    # the kernel reads offsets one after another, as int64 (one dtype: one binary)
    cu = None if cu is None else cu.to(torch.int64).contiguous()
    N, H, L, E = a.shape
    M = c.shape[-1]
    out = torch.empty((N, H, L, M), dtype=out_dtype or c.dtype, device=c.device)
    sequences = N if cu is None else cu.numel() - 1

    def grid(meta):
        return (sequences * H, triton.cdiv(M, meta["BLOCK_M"]))

    init_strides = init.stride() if init is not None else (0, 0, 0, 0)
    final_strides = final.stride() if final is not None else (0, 0, 0, 0)
    # an absent tensor is an empty one of the dtype a present one has (float32 states and
    # multipliers, int64 offsets), so that the options share binaries (the flags are run-time)
    unused = torch.empty(0, dtype=torch.float32, device=c.device)
    args = (
        a, b, c, out, unused if lm is None else lm, unused if init is None else init,
        unused if final is None else final,
        unused.to(torch.int64) if cu is None else cu,
        L, H, E, M, triton.next_power_of_2(M), 1.0 if scale is None else float(scale),
        a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), c.stride(2), *init_strides, *final_strides,
    )  # fmt: skip
    meta = {"REVERSE": reverse, "PRECISION": dot_precision(a.dtype),
            "BLOCK_E": _block_e(a, E, lm is not None), "HAS_LM": lm is not None,
            "HAS_INIT": int(init is not None), "HAS_FINAL": int(final is not None),
            "PACKED": int(cu is not None)}  # fmt: skip
    # too small to tune: the first config the rules keep (the smallest chunk), untuned
    kernels = (_causal_tuned, _causal_untuned)
    launch(kernels, grid, args, meta, tuned=N * H * L >= TUNE_FROM_POSITIONS)
    return out


@serialised
def forward(q, k, v, scale=None, log_decay=None, log_gates=None, initial_state=None,
            output_final_state=False, cu_seqlens=None):  # fmt: skip
    # key heads shared by value heads: read through a stride-0 view (one key head) or repeated
    q, k = value_heads(q, v.shape[1]), value_heads(k, v.shape[1])
    lm = log_multipliers(q, log_decay, log_gates)
    sequences = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    final = None
    if output_final_state:
        final = torch.empty((sequences, q.shape[1], q.shape[3], v.shape[3]), dtype=torch.float32,
                            device=q.device)  # fmt: skip
    if _sliced(q, lm):
        out = _run_sliced(q, k, v, False, lm, initial_state, final, cu_seqlens)
        out = out if scale is None else out.mul_(scale)  # float32 sums: the scale after them
    else:
        out = _run(q, k, v, False, lm, initial_state, final, cu_seqlens, scale=scale)
    if final is None:
        return out, q.new_empty(0)
    dtype = initial_state.dtype if initial_state is not None else torch.float32
    return out, final.to(dtype)


def _sliced(q: torch.Tensor, lm) -> bool:
    """Whether float32 runs with log multipliers: they go in slices of ``WIDE_F32_E``."""
    return lm is not None and q.dtype == torch.float32


def _run_sliced(a, b, c, reverse, lm, init, final, cu):
    """:func:`_run` in float32 as a sum of runs over slices of the ``a``/``b`` features (the
    states' rows): ``init`` and ``final`` ``(S, H, E, M)``."""
    E = a.shape[-1]
    a, b, c = a.float(), b.float(), c.float()
    out = None
    for e in range(0, max(E, 1), WIDE_F32_E):
        rows = slice(e, e + WIDE_F32_E)
        part = _run(a[..., rows], b[..., rows], c, reverse, lm,
                    None if init is None else init[..., rows, :],
                    None if final is None else final[..., rows, :], cu)  # fmt: skip
        out = part if out is None else out.add_(part)
    return out


@serialised
def backward(g, g_final, q, k, v, scale=None, log_decay=None, log_gates=None,
             initial_state=None, output_final_state=False, cu_seqlens=None):  # fmt: skip
    key_heads, dtype = q.shape[1], q.dtype
    grouped = key_heads != v.shape[1]
    q, k = value_heads(q, v.shape[1]), value_heads(k, v.shape[1])
    lm = log_multipliers(q, log_decay, log_gates)
    gs = g if scale is None else g * scale  # the output's gradient carries the scale
    plain = lm is None and initial_state is None and not output_final_state and cu_seqlens is None
    if plain and not grouped:
        return (*backward_by_scans(_run, gs, q, k, v), None, None, None)
    t = lambda x: None if x is None else x.transpose(-1, -2)  # noqa: E731
    g_final = g_final if output_final_state and g_final.numel() else None
    # per value head dq, dk in float32 when a group's are summed after
    run = (
        _run_sliced
        if _sliced(q, lm)
        else functools.partial(_run, out_dtype=torch.float32 if grouped else None)
    )
    dq = run(gs, v, k, False, lm, t(initial_state), None, cu_seqlens)
    dk = run(v, gs, q, True, lm, t(g_final), None, cu_seqlens)
    d_init = None
    if initial_state is not None:  # the gradient that reaches S_0: the dv run's last state
        d_init = torch.empty(initial_state.shape, dtype=torch.float32, device=q.device)
    dv = run(k, q, gs, True, lm, g_final, d_init, cu_seqlens)
    d_decay = d_gates = None
    if lm is not None:
        d_decay, d_gates = log_grads.gradients(gs, g_final, q, k, v, lm, initial_state,
                                               cu_seqlens, log_decay, log_gates)  # fmt: skip
    d_init = None if d_init is None else d_init.to(initial_state.dtype)
    dq, dk = (key_head_sums(d, key_heads).to(dtype) for d in (dq, dk))
    return dq, dk, dv.to(v.dtype), d_decay, d_gates, d_init
