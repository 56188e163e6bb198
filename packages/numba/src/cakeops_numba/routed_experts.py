"""The routed SwiGLU experts in numba-cuda, for a given routing: tiled grouped GEMMs over rows
sorted by expert (``moe_experts`` is the spec's routing followed by these).

The sort by expert uses the spec's helpers (PyTorch ops); the weights are read through their
strides, so ``w_gate`` and ``w_up`` may be views of a packed ``(E, 2F, D)`` tensor. Two kernels
do the rest, each one launch for all experts, with ``TILE x TILE`` thread blocks and
shared-memory tiles:

- ``_grouped_mm``: ``out[rows of e] = A[rows of e] @ W[e]^T`` (or ``@ W[e]``), its row tiles
  mapped to experts by a host-built table and the rows of ``A`` optionally gathered through an
  index (no gathered or padded copy of ``x``). With a second weight it multiplies the rows by
  ``W_gate[e]`` and ``W_up[e]`` in the same pass and stores ``silu(gate) * up`` (forward) or both
  products (backward);
- ``_weight_grad``: ``dW[e] = A[rows of e]^T @ B[rows of e]``, each block walking one expert's
  rows in order (deterministic; an expert with no rows stores exact zeros).

The combine and the dispatch backward sum each token's ``top_k`` slots in slot order in PyTorch.
Every form of expert but the default SwiGLU (biases, another activation, a limit or offset, no
gate) takes the projections from the kernel (``BOTH``, or ``PLAIN`` without a gate) and applies
the biases and :class:`cakeops.helpers.Activation` in PyTorch; the bias gradients are weight
gradients against a column of ones (each expert's rows in order: deterministic).
"""

from __future__ import annotations

import torch
from numba import cuda, float32

from cakeops.helpers import (
    ExpertWeights,
    Routing,
    cast_grads,
    combine,
    dispatch_backward,
    down_bias_dots,
    given_routing,
    row_experts,
    row_tiles,
    row_weights,
    swiglu_backward,
)
from cakeops_numba import SIMULATOR
from cakeops_numba._elements import sigmoid, widen
from cakeops_numba._launch import on_stream, view

# The simulator runs each thread as a Python thread: small tiles there.
TILE = 4 if SIMULATOR else 16
PLAIN, SWIGLU, BOTH = 0, 1, 2  # what _grouped_mm stores


@cuda.jit
def _grouped_mm(a, idx, w, w2, out, out2, tile_expert, tile_row, ends, gather, trans, mode):
    """``w``/``w2``: ``(E, N, K)``, or ``(E, K, N)`` with ``trans``; ``out``: ``(rows, N)``."""
    a_tile = cuda.shared.array((TILE, TILE), float32)
    w_tile = cuda.shared.array((TILE, TILE), float32)
    w2_tile = cuda.shared.array((TILE, TILE), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    e = tile_expert[cuda.blockIdx.x]
    row = tile_row[cuda.blockIdx.x] + ty
    row_ok = row < ends[e]
    col = cuda.blockIdx.y * TILE + tx
    N, K = out.shape[1], a.shape[1]
    src = 0
    if row_ok:
        src = idx[row] if gather else row
    acc = float32(0.0)
    acc2 = float32(0.0)
    for k0 in range(0, K, TILE):
        k = k0 + tx
        a_tile[ty, tx] = widen(a[src, k]) if row_ok and k < K else float32(0.0)
        k = k0 + ty  # the weight tile is (k, n)
        if col < N and k < K:
            w_tile[ty, tx] = widen(w[e, k, col]) if trans else widen(w[e, col, k])
            if mode != PLAIN:
                w2_tile[ty, tx] = widen(w2[e, k, col]) if trans else widen(w2[e, col, k])
        else:
            w_tile[ty, tx] = float32(0.0)
            w2_tile[ty, tx] = float32(0.0)
        cuda.syncthreads()
        for q in range(TILE):
            acc += a_tile[ty, q] * w_tile[q, tx]
            if mode != PLAIN:
                acc2 += a_tile[ty, q] * w2_tile[q, tx]
        cuda.syncthreads()
    if row_ok and col < N:
        if mode == SWIGLU:
            out[row, col] = acc * sigmoid(acc) * acc2
        else:
            out[row, col] = acc
            if mode == BOTH:
                out2[row, col] = acc2


@cuda.jit
def _weight_grad(a, idx_a, b, idx_b, dw, starts, ends, gather_a, gather_b):
    """``dw[e, p, q] = sum over the rows r of e, in order, of A[r, p] * B[r, q]``."""
    a_tile = cuda.shared.array((TILE, TILE), float32)
    b_tile = cuda.shared.array((TILE, TILE), float32)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    e = cuda.blockIdx.x
    p = cuda.blockIdx.y * TILE + ty
    q = cuda.blockIdx.z * TILE + tx
    P, Q = dw.shape[1], dw.shape[2]
    start, end = starts[e], ends[e]
    acc = float32(0.0)
    for r0 in range(start, end, TILE):
        # a_tile[r, p] and b_tile[r, q] for TILE rows: thread (ty, tx) loads row r0 + ty
        r = r0 + ty
        pa = cuda.blockIdx.y * TILE + tx
        a_tile[ty, tx] = float32(0.0)
        b_tile[ty, tx] = float32(0.0)
        if r < end:
            ra = idx_a[r] if gather_a else r
            rb = idx_b[r] if gather_b else r
            if pa < P:
                a_tile[ty, tx] = widen(a[ra, pa])
            if q < Q:
                b_tile[ty, tx] = widen(b[rb, q])
        cuda.syncthreads()
        for i in range(TILE):
            acc += a_tile[i, ty] * b_tile[i, tx]
        cuda.syncthreads()
    if p < P and q < Q:
        dw[e, p, q] = acc


def _mm(a, idx, w, tables, n_out: int, trans: bool, w2=None, mode=PLAIN):
    """Grouped ``a @ W[e]^T`` (``trans``: ``a @ W[e]``), float32; see ``_grouped_mm``."""
    tile_expert, tile_row, _, ends = tables
    rows = idx.numel() if idx is not None else a.shape[0]
    out = torch.empty((rows, n_out), dtype=torch.float32, device=a.device)
    out2 = torch.empty_like(out) if mode == BOTH else out
    if tile_expert.numel() > 0 and n_out > 0:
        grid = (tile_expert.numel(), (n_out + TILE - 1) // TILE)
        with on_stream(a.device) as stream:
            _grouped_mm[grid, (TILE, TILE), stream](
                view(a), view(idx if idx is not None else tile_row), view(w),
                view(w if w2 is None else w2), view(out), view(out2),
                view(tile_expert), view(tile_row), view(ends), idx is not None, trans, mode,
            )  # fmt: skip
    return (out, out2) if mode == BOTH else out


def _grad(a, idx_a, b, idx_b, tables, num_experts: int) -> torch.Tensor:
    """``dW[e] = A_e^T B_e`` for every expert, float32 ``(E, P, Q)``."""
    _, _, starts, ends = tables
    P, Q = a.shape[1], b.shape[1]
    dw = torch.empty((num_experts, P, Q), dtype=torch.float32, device=a.device)
    if dw.numel() > 0:
        grid = (num_experts, (P + TILE - 1) // TILE, (Q + TILE - 1) // TILE)
        with on_stream(a.device) as stream:
            _weight_grad[grid, (TILE, TILE), stream](
                view(a), view(idx_a if idx_a is not None else starts), view(b),
                view(idx_b if idx_b is not None else starts), view(dw), view(starts), view(ends),
                idx_a is not None, idx_b is not None,
            )  # fmt: skip
    return dw


def _row_bias(b, routing: Routing) -> torch.Tensor | int:
    """The bias of each sorted row's expert, float32 ``(rows, N)`` (0 without a bias; dropped
    rows take the last expert's, and are left out downstream)."""
    return 0 if b is None else b.float()[row_experts(routing)]


def _projections(x, routing: Routing, ew: ExpertWeights, tables):
    """``(gate or None, up)``: the pre-activations of every sorted row, float32, biases added."""
    F_ = ew.w_up.shape[1]
    if ew.w_gate is None:
        hg, hu = None, _mm(x, routing.token, ew.w_up, tables, F_, False)
    else:
        hg, hu = _mm(x, routing.token, ew.w_gate, tables, F_, False, ew.w_up, BOTH)
        hg = hg + _row_bias(ew.b_gate, routing)
    return hg, hu + _row_bias(ew.b_up, routing)


def experts_forward(x, routing: Routing, ew: ExpertWeights) -> torch.Tensor:
    """The experts and the combine for a routing: ``(T, D)`` in ``x.dtype``."""
    D = x.shape[1]
    tables = row_tiles(routing, TILE)
    if ew.is_swiglu:
        h = _mm(x, routing.token, ew.w_gate, tables, ew.w_gate.shape[1], False, ew.w_up, SWIGLU)
    else:
        h = ew.activation.forward(*_projections(x, routing, ew, tables))
    y = _mm(h, None, ew.w_down, tables, D, False) + _row_bias(ew.b_down, routing)
    return combine(y, routing).to(x.dtype)


def experts_backward(g, x, routing: Routing, ew: ExpertWeights) -> tuple[torch.Tensor, ...]:
    """``(dx, dL/dw_ts (T, k), dw_gate, dw_up, dw_down, db_gate, db_up, db_down)`` for a
    routing, float32 (None for a tensor not given)."""
    D = x.shape[1]
    E, F_, _ = ew.w_up.shape
    tables = row_tiles(routing, TILE)
    idx = routing.token
    hg, hu = _projections(x, routing, ew, tables)
    u = _mm(g, idx, ew.w_down, tables, F_, True)  # g W_down[e]: w_down[e] is (D, F) = (K, N)
    h, dweights, dhg, dhu = swiglu_backward(hg, hu, u, routing, ew.activation)
    if ew.b_down is not None:  # <y, g> = <h, u> + <b_down[e], g>
        dweights.view(-1)[routing.order] += down_bias_dots(g, ew.b_down, routing)
    gw = g[idx].float().mul_(row_weights(routing).unsqueeze(-1))  # dy = w g, per sorted row
    d_down = _grad(gw, None, h, None, tables, E)
    d_up = _grad(dhu, None, x, idx, tables, E)
    d_gate = None if dhg is None else _grad(dhg, None, x, idx, tables, E)
    # the biases' gradients: each expert's rows summed, as a weight gradient against ones
    ones = torch.ones((idx.numel(), 1), dtype=torch.float32, device=x.device)
    db_gate, db_up, db_down = (
        None if b is None else _grad(rows, None, ones, None, tables, E)[..., 0]
        for b, rows in ((ew.b_gate, dhg), (ew.b_up, dhu), (ew.b_down, gw))
    )
    # dx rows = dhg W_gate[e] + dhu W_up[e]: w_gate[e] is (F, D) = (K, N)
    dx_rows = _mm(dhu, None, ew.w_up, tables, D, True)
    if dhg is not None:
        dx_rows += _mm(dhg, None, ew.w_gate, tables, D, True)
    grads = (d_gate, d_up, d_down, db_gate, db_up, db_down)
    return dispatch_backward(dx_rows, routing), dweights, *grads


def forward(x, top_k_index, top_k_weights, *weights):
    ew = ExpertWeights.of(*weights)
    routing = given_routing(top_k_index, top_k_weights.float(), ew.w_up.shape[0])
    return experts_forward(x, routing, ew)


def backward(g, x, top_k_index, top_k_weights, *weights):
    ew = ExpertWeights.of(*weights)
    routing = given_routing(top_k_index, top_k_weights.float(), ew.w_up.shape[0])
    grads = experts_backward(g, x, routing, ew)
    return cast_grads(grads, (x, top_k_weights, *ew.tensors))
