"""The routed SwiGLU experts of an MoE layer in Triton: the spec's routing, then the experts of
:mod:`cakeops_triton.routed_experts`; the backward recomputes the routing and adds its backward
(PyTorch ops that never wait for the device)."""

from __future__ import annotations

from cakeops.helpers import ExpertWeights, route, routing_backward
from cakeops_triton._common import serialised
from cakeops_triton.routed_experts import experts_backward, experts_forward


@serialised
def forward(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale, *options):
    routing = route(router_logits, top_k, renormalize, scale)
    return experts_forward(x, routing, ExpertWeights.of(w_gate, w_up, w_down, *options))


@serialised
def backward(g, x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale, *options):
    routing = route(router_logits, top_k, renormalize, scale)
    ew = ExpertWeights.of(w_gate, w_up, w_down, *options)
    dx, dweights, *dws = experts_backward(g, x, routing, ew)
    dlogits = routing_backward(routing, dweights, renormalize, scale)
    return dx, dlogits.to(router_logits.dtype), *dws
