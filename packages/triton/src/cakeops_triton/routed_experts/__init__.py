"""The routed SwiGLU experts in Triton, for a given routing: grouped GEMMs over rows sorted by
expert (``moe_experts`` is the spec's routing followed by these).

The sort by expert uses the spec's helpers (PyTorch ops that never wait for the device: the
row-tile table is sized by an upper bound and the tiles past the last real one exit at once).
``w_gate`` and ``w_up`` are read through their strides, so views of a packed ``(E, 2F, D)``
tensor need no copy. The experts' math (this module: which products, fused how, in what order)
runs on the grouped GEMM kernels of :mod:`.grouped_gemm`, each one launch for all experts,
16-bit operands on tensor cores with float32 accumulation. With float32 master weights the
products run in float32 (``x`` widened as it loads), so that every gradient is as accurate as
its own dtype asks. What is left to PyTorch is the sort by expert and the sum of the
routing-weight partials over column tiles.
"""

from __future__ import annotations

import torch

from cakeops.helpers import (
    ExpertWeights,
    Routing,
    down_bias_dots,
    given_routing,
    row_tiles,
    row_weights,
)
from cakeops_triton._common import serialised
from cakeops_triton.routed_experts.grouped_gemm import (
    SUM2,
    SWIGLU,
    SWIGLU_BWD,
    WIDE_BLOCK_M,
    matmul,
    row_sum,
    rows_per_tile,
    slot_sum,
    weight_grad,
)


def experts_forward(x, routing: Routing, ew: ExpertWeights) -> torch.Tensor:
    """The experts and the combine for a routing: ``(T, D)`` in ``x.dtype``."""
    D, F_ = x.shape[1], ew.w_up.shape[1]
    form = None if ew.is_swiglu else ew.activation
    first = ew.w_up if form is not None and not form.gated else ew.w_gate
    block_m = rows_per_tile(routing, x, *(w for w in ew.tensors[:3] if w is not None))
    tables = row_tiles(routing, block_m)
    out_dtype = x.dtype
    x = _in_products_dtype(x.contiguous(), ew)
    h = matmul(x, routing.token, first, tables, F_, D, w2=ew.w_up, mode=SWIGLU, block_m=block_m,
            b1=ew.b_gate, b2=ew.b_up, form=form)  # fmt: skip
    # the combine in the epilogue: w_ts * y_ts stored at its (token, slot) row
    slots = matmul(h, None, ew.w_down, tables, D, F_, dst=routing.order, scale=row_weights(routing),
                block_m=block_m, b1=ew.b_down,
                form=None if ew.b_down is None else form)  # fmt: skip
    return slot_sum(slots, routing, out_dtype)


def _in_products_dtype(t: torch.Tensor, ew: ExpertWeights) -> torch.Tensor:
    """``t`` in the products' dtype: a 16-bit ``x`` (or gradient) with float32 weights is
    converted once, so that it runs the float32 kernels' binaries (every kernel converts its
    operands to that dtype as it loads them: the same products, bit for bit) instead of a
    binary per mix of dtypes."""
    compute = t.dtype
    for w in ew.tensors[:3]:
        if w is not None:
            compute = torch.promote_types(compute, w.dtype)
    return t.to(compute)


def experts_backward(g, x, routing: Routing, ew: ExpertWeights) -> tuple[torch.Tensor, ...]:
    """``(dx, dL/dw_ts (T, k) float32, dw_gate, dw_up, dw_down, db_gate, db_up, db_down)`` for a
    routing (None for a tensor not given); ``dx`` in ``x.dtype``, each weight and bias gradient
    in its own dtype."""
    D = x.shape[1]
    E, F_, _ = ew.w_up.shape
    form = None if ew.is_swiglu else ew.activation
    gated = ew.w_gate is not None
    first = ew.w_gate if gated else ew.w_up
    weights = [w for w in ew.tensors[:3] if w is not None]
    block_m = rows_per_tile(routing, x, *weights)
    tables = row_tiles(routing, block_m)
    out_dtype = x.dtype
    x, g = _in_products_dtype(x.contiguous(), ew), _in_products_dtype(g.contiguous(), ew)
    idx = routing.token
    slot_w = row_weights(routing)
    # gate, up and u = g W_down[e] in one pass; the SwiGLU backward in its epilogue. On
    # 128-row tiles u is a product of its own first (wide tiles, float32 rows): the SwiGLU pass
    # then reads one operand row and two weights per step instead of two and three, which its
    # three accumulators (64-wide columns) would otherwise wait for from L2.
    u = None
    if block_m == WIDE_BLOCK_M:
        u = matmul(g, idx, ew.w_down, tables, F_, D, transpose=True, block_m=block_m)
    h, d_gate_rows, d_up_rows, parts = matmul(
        x, idx, first, tables, F_, D, w2=ew.w_up, w3=ew.w_down, a2=g, mode=SWIGLU_BWD,
        scale=slot_w, block_m=block_m, u=u, b1=ew.b_gate, b2=ew.b_up, form=form,
    )  # fmt: skip
    dweights = torch.empty(routing.order.numel(), dtype=torch.float32, device=x.device)
    dot = parts.sum(0)
    if ew.b_down is not None:  # <y, g> = <h, u> + <b_down[e], g>
        dot += down_bias_dots(g, ew.b_down, routing)
    dweights[routing.order] = dot
    # dW_down[e] = (w g)_e^T h_e: the rows of g gathered and scaled as they load
    d_down = weight_grad(g, idx, h, None, tables, E, ew.w_down.dtype, scale_a=slot_w)
    d_up = weight_grad(d_up_rows, None, x, idx, tables, E, ew.w_up.dtype)
    d_gate = weight_grad(d_gate_rows, None, x, idx, tables, E, ew.w_gate.dtype) if gated else None
    # the biases' gradients: each expert's rows summed
    db_gate, db_up, db_down = (
        None if b is None else row_sum(rows, rows_idx, tables, E, b.dtype, scale)
        for b, rows, rows_idx, scale in ((ew.b_gate, d_gate_rows, None, None),
                                         (ew.b_up, d_up_rows, None, None),
                                         (ew.b_down, g, idx, slot_w))
    )  # fmt: skip
    # dx rows = dhg W_gate[e] + dhu W_up[e] in one pass (K = F, N = D), each stored at its
    # (token, slot) row: the dispatch backward is then the slot sum, with no weight factor
    if gated:
        dx_slots = matmul(
            d_gate_rows, None, ew.w_gate, tables, D, F_, transpose=True, w2=ew.w_up,
            a2=d_up_rows, mode=SUM2, dst=routing.order, block_m=block_m,
        )  # fmt: skip
    else:
        dx_slots = matmul(d_up_rows, None, ew.w_up, tables, D, F_, transpose=True,
                       dst=routing.order, block_m=block_m)  # fmt: skip
    dx = slot_sum(dx_slots, routing, out_dtype)
    return dx, dweights.view_as(routing.weights), d_gate, d_up, d_down, db_gate, db_up, db_down


def _routing(top_k_index, top_k_weights, num_experts: int) -> Routing:
    return given_routing(top_k_index, top_k_weights.float(), num_experts)


@serialised
def forward(x, top_k_index, top_k_weights, *weights):
    ew = ExpertWeights.of(*weights)
    routing = _routing(top_k_index, top_k_weights, ew.w_up.shape[0])
    return experts_forward(x, routing, ew)


@serialised
def backward(g, x, top_k_index, top_k_weights, *weights):
    ew = ExpertWeights.of(*weights)
    routing = _routing(top_k_index, top_k_weights, ew.w_up.shape[0])
    dx, dweights, *dws = experts_backward(g, x, routing, ew)
    return dx, dweights.to(top_k_weights.dtype), *dws
