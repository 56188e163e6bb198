"""The routed SwiGLU experts of an MoE layer in plain PyTorch: the spec's routing, then the
experts of :mod:`cakeops_torch.routed_experts` (sorted, dropless, deterministic, grouped matmuls
where they apply); the backward recomputes the routing and adds its backward."""

from __future__ import annotations

from cakeops import compute_dtype
from cakeops.helpers import ExpertWeights, cast_grads, route, routing_backward, top_k_choice
from cakeops_torch.routed_experts import (
    experts_backward,
    experts_forward,
    few_rows,
    few_rows_forward,
)


def forward(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale, *options):
    ew = ExpertWeights.of(w_gate, w_up, w_down, *options)
    if few_rows(x, x.shape[0] * top_k):  # a decode step: no sort by expert
        _, experts, _, weights = top_k_choice(router_logits, top_k, renormalize, scale,
                                              compute_dtype(x.dtype))  # fmt: skip
        return few_rows_forward(x, experts, weights, ew)
    routing = route(router_logits, top_k, renormalize, scale, compute_dtype(x.dtype))
    return experts_forward(x, routing, ew)


def backward(g, x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale, *options):
    ew = ExpertWeights.of(w_gate, w_up, w_down, *options)
    routing = route(router_logits, top_k, renormalize, scale, compute_dtype(x.dtype))
    dx, dweights, *dws = experts_backward(g, x, routing, ew)
    dlogits = routing_backward(routing, dweights, renormalize, scale)
    return cast_grads((dx, dlogits, *dws), (x, router_logits, *ew.tensors))
