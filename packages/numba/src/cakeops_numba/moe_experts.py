"""The routed SwiGLU experts of an MoE layer in numba-cuda: the spec's routing, then the experts
of :mod:`cakeops_numba.routed_experts`; the backward recomputes the routing and adds its
backward."""

from __future__ import annotations

from cakeops.helpers import ExpertWeights, cast_grads, route, routing_backward
from cakeops_numba.routed_experts import experts_backward, experts_forward


def forward(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale, *options):
    routing = route(router_logits, top_k, renormalize, scale)
    return experts_forward(x, routing, ExpertWeights.of(w_gate, w_up, w_down, *options))


def backward(g, x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale, *options):
    routing = route(router_logits, top_k, renormalize, scale)
    ew = ExpertWeights.of(w_gate, w_up, w_down, *options)
    dx, dweights, *dws = experts_backward(g, x, routing, ew)
    dlogits = routing_backward(routing, dweights, renormalize, scale)
    return cast_grads((dx, dlogits, *dws), (x, router_logits, *ew.tensors))
