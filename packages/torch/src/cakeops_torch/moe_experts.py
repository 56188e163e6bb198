"""The routed SwiGLU experts in plain PyTorch: sorted, dropless, deterministic.

The (token, slot) pairs are sorted by expert once; each expert then runs one grouped pass over its
own contiguous rows (no dense all-experts compute, no padding to a capacity). The combine sums the
``(T, top_k, D)`` view of the expert outputs in slot order, and the dispatch backward sums each
token's copies the same way: no ``index_add_``, no atomics. The backward recomputes the routing
and the gate/up projections; experts that received no token keep exact zero gradients.

Matmuls run in float32 for 16-bit inputs on the CPU (weights cast per expert, on the fly) and in
the input dtype with float32 accumulation on accelerators.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cakeops import compute_dtype
from cakeops.ops.moe_experts import Routing, route, routing_backward


def _mm_dtype(x: torch.Tensor) -> torch.dtype:
    if x.dtype == torch.float64:
        return torch.float64
    return x.dtype if x.device.type != "cpu" else torch.float32


def _experts(routing: Routing):
    """``(e, start, end)`` for every expert that received rows."""
    for e in range(len(routing.bounds) - 1):
        start, end = routing.bounds[e], routing.bounds[e + 1]
        if end > start:
            yield e, start, end


def forward(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale):
    T, D = x.shape
    mm = _mm_dtype(x)
    acc = compute_dtype(x.dtype)
    routing = route(router_logits, top_k, renormalize, scale, acc)
    rows = x[routing.token]  # dispatch: (T * k, D) sorted by expert, cast per expert
    y = torch.empty((T * top_k, D), dtype=acc, device=x.device)
    for e, s, t in _experts(routing):
        xe = rows[s:t].to(mm)
        h = F.silu((xe @ w_gate[e].to(mm).T).to(acc)).mul_((xe @ w_up[e].to(mm).T).to(acc))
        y[routing.order[s:t]] = (h.to(mm) @ w_down[e].to(mm).T).to(acc)
    # combine in slot order: out_t = sum_s w_ts y_(t,s)
    out = (y.view(T, top_k, D) * routing.weights.to(acc).unsqueeze(-1)).sum(1)
    return out.to(x.dtype)


def backward(g, x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale):
    T, D = x.shape
    mm = _mm_dtype(x)
    acc = compute_dtype(x.dtype)
    routing = route(router_logits, top_k, renormalize, scale, acc)
    rows = x[routing.token]
    g_rows = g[routing.token]  # each slot's copy of its token's gradient
    slot_w = routing.weights.flatten()[routing.order].to(acc)
    dx_rows = torch.empty((T * top_k, D), dtype=acc, device=x.device)
    dw_flat = torch.empty(T * top_k, dtype=acc, device=x.device)
    # Each expert's weight gradient is one float32-accumulated matmul over its rows, stored in the
    # weight's dtype as it is produced: no float32 buffer for all experts at once.
    grads = [
        torch.zeros_like(w, memory_format=torch.contiguous_format) for w in (w_gate, w_up, w_down)
    ]
    for e, s, t in _experts(routing):
        xe, ge, we = rows[s:t].to(mm), g_rows[s:t].to(mm), slot_w[s:t, None]
        wg, wu, wd = w_gate[e].to(mm), w_up[e].to(mm), w_down[e].to(mm)
        hg, hu = (xe @ wg.T).to(acc), (xe @ wu.T).to(acc)
        sig = torch.sigmoid(hg)
        gate = hg * sig
        h = gate * hu
        u = (ge @ wd).to(acc)  # g_t W_down: dL/dh before the routing weight
        dw_flat[routing.order[s:t]] = (h * u).sum(-1)  # <y, g> = <h W_down^T, g> = <h, g W_down>
        dh = u.mul_(we)
        grads[2][e] = (ge.to(acc) * we).T @ h  # dW_down = dy^T h with dy = w g
        dhu = dh * gate
        dhg = dh.mul_(hu).mul_(sig.mul_(hg.mul_(1 - sig).add_(1)))  # dh * hu * silu'(hg)
        xe_acc = xe.to(acc)
        grads[0][e] = dhg.T @ xe_acc
        grads[1][e] = dhu.T @ xe_acc
        dx_rows[routing.order[s:t]] = (dhg.to(mm) @ wg + dhu.to(mm) @ wu).to(acc)
    # dispatch backward: each token's copies summed in slot order (no routing weight again)
    dx = dx_rows.view(T, top_k, D).sum(1).to(x.dtype)
    dlogits = routing_backward(routing, dw_flat.view(T, top_k), renormalize, scale)
    return (
        dx,
        dlogits.to(router_logits.dtype),
        *grads,
    )
