"""Float64 reference math of ``routed_experts``: the plain loop over experts (``moe_experts``'
reference is its routing followed by this)."""

from __future__ import annotations

import torch

from cakeops._activations import ACT, gated
from cakeops._autograd import check_cancelled, grads_by_autograd


def expert(rows, e, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, alpha, limit,
           up_offset):  # fmt: skip
    """Expert ``e`` on ``rows``: the spec's formula, term by term."""
    up = rows @ w_up[e].T + (0 if b_up is None else b_up[e])
    if w_gate is None:
        h = ACT[activation](up, alpha)
    else:
        gate = rows @ w_gate[e].T + (0 if b_gate is None else b_gate[e])
        h = gated(gate, up, activation, alpha, limit, up_offset)
    return h @ w_down[e].T + (0 if b_down is None else b_down[e])


def math(x, top_k_index, top_k_weights, w_gate, w_up, w_down, b_gate=None, b_up=None,
         b_down=None, activation="silu", alpha=1.0, limit=None, up_offset=0.0):  # fmt: skip
    """The op in float64 (ids ``>= E`` add nothing); autograd of this is the reference
    gradient. Only the experts the routing uses are visited: the cost follows the tokens, not
    ``E``."""
    x, top_k_weights = x.double(), top_k_weights.double()
    used = top_k_index.unique()
    used = used[(used >= 0) & (used < w_up.shape[0])]
    # the used experts' weights, gathered once (one scatter of each gradient, not one per expert)
    tensors = [None if t is None else t.index_select(0, used).double()
               for t in (w_gate, w_up, w_down, b_gate, b_up, b_down)]  # fmt: skip
    out = torch.zeros_like(x)
    for i, e in enumerate(used.tolist()):
        check_cancelled()
        token, slot = (top_k_index == e).nonzero(as_tuple=True)
        y = expert(x[token], i, *tensors, activation, alpha, limit, up_offset)
        out = out.index_add(0, token, y * top_k_weights[token, slot, None])
    return out


def forward(x, top_k_index, top_k_weights, *rest):
    return math(x, top_k_index, top_k_weights, *rest).to(x.dtype)


def backward(g, x, top_k_index, top_k_weights, w_gate, w_up, w_down, b_gate, b_up, b_down,
             activation, alpha, limit, up_offset):  # fmt: skip
    def fn(x, top_k_weights, w_gate, w_up, w_down, b_gate, b_up, b_down):
        return math(x, top_k_index, top_k_weights, w_gate, w_up, w_down, b_gate, b_up, b_down,
                    activation, alpha, limit, up_offset)  # fmt: skip

    inputs = (x, top_k_weights, w_gate, w_up, w_down, b_gate, b_up, b_down)
    return grads_by_autograd(fn, g, inputs, {})
