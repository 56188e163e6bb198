"""The routed SwiGLU experts in Triton: grouped GEMMs over rows sorted by expert.

Routing and the sort by expert use the spec's helpers (PyTorch ops, cheap next to the matmuls).
Two kernels do the rest, each one launch for all experts:

- ``_grouped_mm``: ``out[rows of e] = A[rows of e] @ W[e]^T`` (or ``@ W[e]``, by strides), its
  row tiles mapped to experts by a host-built table, the rows of ``A`` optionally gathered through
  an index (the dispatch is a load, never a gathered or padded copy of ``x``). With a second
  weight one pass over the rows multiplies them by ``W_gate[e]`` and ``W_up[e]`` together and
  stores ``silu(gate) * up`` (``SWIGLU``, the forward: no gate/up buffers) or both products
  (``BOTH``, the backward, which needs them apart); with a second operand too (``SUM2``) it
  accumulates ``A W[e]^T + A2 W2[e]^T`` (the input gradient through gate and up, one pass). Its
  epilogue can scale each row by a per-row factor and store it at another row (``DST``): that is
  the combine -- the down projection writes ``w_ts y_ts`` straight into its ``(token, slot)``
  place -- and the dispatch backward;
- ``_grouped_weight_grad``: ``dW[e] = A[rows of e]^T @ B[rows of e]``, each program walking one
  expert's rows in order (deterministic; an expert with no rows stores exact zeros), ``A``'s rows
  optionally gathered and scaled by a per-row factor as they load.

What is left to PyTorch is summing each token's ``top_k`` slots in slot order (deterministic, no
atomics) and the routing itself.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cakeops.ops.moe_experts import (
    route,
    routing_backward,
    row_tiles,
    row_weights,
    slot_sum,
    swiglu_backward,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"
# Row tiles are laid out on the host (the tile table), so BLOCK_M is fixed; the autotuner picks
# the rest per (N, K, mode) -- never per token count. The interpreter gets one small config.
BLOCK_M = 32 if INTERPRET else 64
BLOCK_N, BLOCK_K = 32, 32
if INTERPRET:
    _CONFIGS = [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32})]
else:
    _CONFIGS = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
        for bn, bk, w, st in (
            (64, 32, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 4), (256, 32, 8, 3),
        )
    ]  # fmt: skip
PLAIN, SWIGLU, BOTH, SUM2 = 0, 1, 2, 3  # what _grouped_mm computes and stores


@triton.autotune(configs=_CONFIGS, key=["N", "K", "MODE", "GATHER"])
@triton.jit(do_not_specialize=["ROWS"])
def _grouped_mm(
    A, A2, IDX, W, W2, OUT, OUT2, DST, SCALE, TILE_EXPERT, TILE_ROW, ENDS,
    ROWS, stride_a, stride_we, stride_wn, stride_wk, stride_we2, stride_wn2, stride_wk2,
    K: tl.constexpr, N: tl.constexpr, GATHER: tl.constexpr, MODE: tl.constexpr,
    SCATTER: tl.constexpr, SCALED: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(TILE_EXPERT + pid_m).to(tl.int64)
    rows = tl.load(TILE_ROW + pid_m) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(ENDS + e)
    if GATHER:
        src = tl.load(IDX + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(
            A + src[:, None] * stride_a + kk[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_mask = k_ok[:, None] & col_ok[None, :]
        w = tl.load(
            W + e * stride_we + kk[:, None] * stride_wk + cols[None, :] * stride_wn,
            mask=w_mask,
            other=0.0,
        )
        # float32 master weights with 16-bit activations run at the activations' precision
        acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
        if MODE != PLAIN:  # the second weight (the up projection)
            w2 = tl.load(
                W2 + e * stride_we2 + kk[:, None] * stride_wk2 + cols[None, :] * stride_wn2,
                mask=w_mask,
                other=0.0,
            )
            if MODE == SUM2:  # ... against a second operand, into the same sum
                a2 = tl.load(
                    A2 + src[:, None] * stride_a + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                acc += tl.dot(a2, w2.to(a2.dtype), input_precision=PRECISION)
            else:  # ... against the same rows, kept apart
                acc2 += tl.dot(a, w2.to(a.dtype), input_precision=PRECISION)
    if SCALED:
        acc *= tl.load(SCALE + rows, mask=row_ok, other=0.0)[:, None]
    if SCATTER:
        dst = tl.load(DST + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        dst = rows.to(tl.int64)
    out = dst[:, None] * N + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if MODE == SWIGLU:
        tl.store(OUT + out, acc / (1.0 + tl.exp(-acc)) * acc2, mask=ok)
    else:
        tl.store(OUT + out, acc, mask=ok)
        if MODE == BOTH:
            tl.store(OUT2 + out, acc2, mask=ok)


@triton.jit
def _grouped_weight_grad(
    A, IDX_A, SCALE_A, B, IDX_B, DW, STARTS, ENDS,
    stride_a, stride_b,
    P: tl.constexpr, Q: tl.constexpr, GATHER_A: tl.constexpr, GATHER_B: tl.constexpr,
    SCALED_A: tl.constexpr, PRECISION: tl.constexpr,
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
        if GATHER_A:
            ra = tl.load(IDX_A + rows, mask=ok, other=0).to(tl.int64)
        else:
            ra = rows.to(tl.int64)
        if GATHER_B:
            rb = tl.load(IDX_B + rows, mask=ok, other=0).to(tl.int64)
        else:
            rb = rows.to(tl.int64)
        a = tl.load(
            A + ra[:, None] * stride_a + p[None, :], mask=ok[:, None] & (p < P)[None, :], other=0.0
        ).to(tl.float32)
        if SCALED_A:
            a *= tl.load(SCALE_A + rows, mask=ok, other=0.0)[:, None]
        b = tl.load(
            B + rb[:, None] * stride_b + q[None, :], mask=ok[:, None] & (q < Q)[None, :], other=0.0
        )
        acc += tl.dot(tl.trans(a), b.to(tl.float32), input_precision=PRECISION)
    out = e * P * Q + p.to(tl.int64)[:, None] * Q + q[None, :]
    tl.store(DW + out, acc, mask=(p < P)[:, None] & (q < Q)[None, :])


def _precision(t: torch.Tensor) -> str:
    on_gpu = t.device.type != "cpu"
    return "tf32" if on_gpu and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _tiles(routing, device) -> tuple[torch.Tensor, ...]:
    """The spec's row-tile table for ``BLOCK_M``-row tiles, the tile columns as int32."""
    tile_expert, tile_row, starts, ends = row_tiles(routing, BLOCK_M, device)
    return tile_expert.to(torch.int32), tile_row.to(torch.int32), starts, ends


def _strides(w: torch.Tensor, transpose: bool = False) -> tuple[int, int, int]:
    """``(expert, n, k)`` strides reading ``w[e]`` as ``W[e]`` (``a @ W[e]^T``) or, transposed,
    as ``W[e]^T`` (``a @ W[e]``)."""
    return (w.stride(0), w.stride(2), w.stride(1)) if transpose else w.stride()


def _mm(
    a, idx, w, tables, n_out: int, k_in: int, w_strides, *,
    w2=None, w2_strides=None, a2=None, mode=PLAIN, dst=None, scale=None,
):  # fmt: skip
    """Grouped ``a @ W[e]^T`` (``w_strides = (expert, n, k)`` pick the layout); float32 result.

    With ``w2`` and ``mode`` ``SWIGLU``: ``silu(a W[e]^T) * (a W2[e]^T)``; ``BOTH``: the pair;
    ``SUM2`` (with ``a2``): ``a W[e]^T + a2 W2[e]^T``. Row ``i`` of the result is multiplied by
    ``scale[i]`` and stored at row ``dst[i]`` when those are given (``dst`` a permutation).
    """
    tile_expert, tile_row, _, ends = tables
    assert a2 is None or a2.stride() == a.stride(), "a and a2 share their row stride"
    rows = idx.numel() if idx is not None else a.shape[0]
    out = torch.empty((rows, n_out), dtype=torch.float32, device=a.device)
    out2 = torch.empty_like(out) if mode == BOTH else out
    if tile_expert.numel() > 0:

        def grid(meta):
            return (tile_expert.numel(), triton.cdiv(n_out, meta["BLOCK_N"]))

        _grouped_mm[grid](
            a, a if a2 is None else a2, a if idx is None else idx, w, w if w2 is None else w2,
            out, out2, out if dst is None else dst, out if scale is None else scale,
            tile_expert, tile_row, ends, rows, a.stride(0), *w_strides,
            *(w_strides if w2_strides is None else w2_strides),
            K=k_in, N=n_out, GATHER=idx is not None, MODE=mode, SCATTER=dst is not None,
            SCALED=scale is not None, PRECISION=_precision(a), BLOCK_M=BLOCK_M,
        )  # fmt: skip
    return (out, out2) if mode == BOTH else out


def _weight_grad(a, idx_a, b, idx_b, tables, num_experts: int, scale_a=None) -> torch.Tensor:
    """``dW[e] = A_e^T B_e`` for every expert (``A``'s rows times ``scale_a``), float32
    ``(E, P, Q)``."""
    _, _, starts, ends = tables
    P, Q = a.shape[1], b.shape[1]
    dw = torch.empty((num_experts, P, Q), dtype=torch.float32, device=a.device)
    grid = (num_experts, triton.cdiv(P, BLOCK_M), triton.cdiv(Q, BLOCK_N))
    _grouped_weight_grad[grid](
        a, a if idx_a is None else idx_a, a if scale_a is None else scale_a,
        b, b if idx_b is None else idx_b, dw, starts, ends, a.stride(0), b.stride(0),
        P=P, Q=Q, GATHER_A=idx_a is not None, GATHER_B=idx_b is not None,
        SCALED_A=scale_a is not None, PRECISION=_precision(a),
        BLOCK_P=BLOCK_M, BLOCK_Q=BLOCK_N, BLOCK_R=BLOCK_K,
    )  # fmt: skip
    return dw


def _activations_dtype(x: torch.Tensor) -> torch.dtype:
    """Matmul inputs stay 16-bit on GPUs (tensor cores); the interpreter computes in float32."""
    return torch.float32 if x.device.type == "cpu" else x.dtype


def _gate_up(x, routing, w_gate, w_up, tables, mode):
    """The gate and up projections of the dispatched rows in one pass: ``silu(gate) * up``
    (``SWIGLU``) or both (``BOTH``)."""
    _, F_, D = w_gate.shape
    idx = routing.token.to(torch.int32)
    xin = x.contiguous().to(_activations_dtype(x))
    out = _mm(
        xin, idx, w_gate, tables, F_, D, _strides(w_gate),
        w2=w_up, w2_strides=_strides(w_up), mode=mode,
    )  # fmt: skip
    return xin, idx, out


def forward(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale):
    D = x.shape[1]
    routing = route(router_logits, top_k, renormalize, scale)
    tables = _tiles(routing, x.device)
    h = _gate_up(x, routing, w_gate, w_up, tables, SWIGLU)[2].to(_activations_dtype(x))
    slot_w = row_weights(routing)
    # the combine in the epilogue: w_ts * y_ts stored at its (token, slot) row
    slots = _mm(
        h, None, w_down, tables, D, w_down.shape[2], _strides(w_down),
        dst=routing.order, scale=slot_w,
    )  # fmt: skip
    return slot_sum(slots, routing).to(x.dtype)


def backward(g, x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale):
    D = x.shape[1]
    E, F_, _ = w_gate.shape
    routing = route(router_logits, top_k, renormalize, scale)
    tables = _tiles(routing, x.device)
    xin, idx, (hg, hu) = _gate_up(x, routing, w_gate, w_up, tables, BOTH)
    act = _activations_dtype(x)
    gin = g.contiguous().to(act)
    # u = g W_down[e]: K = D, N = F, so W[e][k, n] is w_down[e][d, f]
    u = _mm(gin, idx, w_down, tables, F_, D, _strides(w_down, transpose=True))
    h, dweights, dhg, dhu = swiglu_backward(hg, hu, u, routing)
    slot_w = row_weights(routing)
    # dW_down[e] = (w g)_e^T h_e: the rows of g gathered and scaled as they load
    d_down = _weight_grad(gin, idx, h, None, tables, E, scale_a=slot_w)
    d_gate = _weight_grad(dhg, None, xin, idx, tables, E)
    d_up = _weight_grad(dhu, None, xin, idx, tables, E)
    # dx rows = dhg W_gate[e] + dhu W_up[e] in one pass (K = F, N = D), each stored at its
    # (token, slot) row: the dispatch backward is then the slot sum, with no weight factor
    dx_slots = _mm(
        dhg.to(act), None, w_gate, tables, D, F_, _strides(w_gate, transpose=True),
        w2=w_up, w2_strides=_strides(w_up, transpose=True), a2=dhu.to(act), mode=SUM2,
        dst=routing.order,
    )  # fmt: skip
    dlogits = routing_backward(routing, dweights, renormalize, scale)
    return (
        slot_sum(dx_slots, routing).to(x.dtype),
        dlogits.to(router_logits.dtype),
        d_gate.to(w_gate.dtype),
        d_up.to(w_up.dtype),
        d_down.to(w_down.dtype),
    )
