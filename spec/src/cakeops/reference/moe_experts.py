"""Float64 reference math of ``moe_experts``: the plain loop over experts."""

from __future__ import annotations

import torch

from cakeops._autograd import grads_by_autograd
from cakeops.reference import routed_experts as routed


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, scale: float):
    """``(experts, weights)``: the ``top_k`` experts of each token (``(T, top_k)``, selected on
    the float32 softmax the spec prescribes, ties to the lower id) and their float64 combine
    weights.

    Renormalised top-k probabilities are the softmax of the selected logits alone, which is how
    they are computed here: autograd then gives the non-selected logits exactly zero gradients,
    and top-1 (a constant weight) exactly zero everywhere, as the math says.
    """
    p32 = torch.softmax(router_logits.float(), dim=-1)
    experts = torch.sort(p32, dim=-1, descending=True, stable=True).indices[:, :top_k]
    logits = router_logits.double()
    if renormalize:
        weights = torch.softmax(logits.gather(1, experts), dim=-1)
    else:
        weights = torch.softmax(logits, dim=-1).gather(1, experts)
    return experts, weights * scale


def math(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale, *options):
    """The op in float64: its routing, then the experts of ``routed_experts`` (``options``: the
    biases and the activation's, in order); autograd of this is the reference gradient."""
    experts, weights = route(router_logits, top_k, renormalize, scale)
    return routed.math(x, experts, weights, w_gate, w_up, w_down, *options)


def forward(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale, *options):
    out = math(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale, *options)
    return out.to(x.dtype)


def backward(g, x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale, b_gate, b_up,
             b_down, activation, alpha, limit, up_offset):  # fmt: skip
    def fn(x, router_logits, w_gate, w_up, w_down, b_gate, b_up, b_down):
        return math(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale, b_gate,
                    b_up, b_down, activation, alpha, limit, up_offset)  # fmt: skip

    inputs = (x, router_logits, w_gate, w_up, w_down, b_gate, b_up, b_down)
    return grads_by_autograd(fn, g, inputs, {})
