"""Float64 reference math of ``routed_experts``: the plain loop over experts (``moe_experts``'
reference is its routing followed by this)."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F


def math(x, top_k_index, top_k_weights, w_gate, w_up, w_down):
    """The op in float64; autograd of this is the reference gradient."""
    x, w_gate, w_up, w_down = x.double(), w_gate.double(), w_up.double(), w_down.double()
    weights = top_k_weights.double()
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        token, slot = (top_k_index == e).nonzero(as_tuple=True)
        rows = x[token]
        h = F.silu(rows @ w_gate[e].T) * (rows @ w_up[e].T)
        out = out.index_add(0, token, (h @ w_down[e].T) * weights[token, slot, None])
    return out


def forward(x, top_k_index, top_k_weights, w_gate, w_up, w_down):
    return math(x, top_k_index, top_k_weights, w_gate, w_up, w_down).to(x.dtype)


def grads_by_autograd(fn, g, inputs, fixed):
    """Gradients of ``fn(*float64 inputs, **fixed)`` for ``g``, on a fresh thread (autograd is
    switched off, thread-locally, inside a custom op's kernel); unused inputs get zeros."""
    result: list = []

    def work():
        leaves = [t.detach().double().requires_grad_() for t in inputs]
        out = fn(*leaves, **fixed)
        result.extend(torch.autograd.grad(out, leaves, g.double(), allow_unused=True))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    if len(result) != len(inputs):
        raise RuntimeError("reference backward failed (see the thread's traceback)")
    return tuple(
        (torch.zeros_like(t) if d is None else d.to(t.dtype))
        for d, t in zip(result, inputs, strict=True)
    )


def backward(g, x, top_k_index, top_k_weights, w_gate, w_up, w_down):
    def fn(x, top_k_weights, w_gate, w_up, w_down):
        return math(x, top_k_index, top_k_weights, w_gate, w_up, w_down)

    return grads_by_autograd(fn, g, (x, top_k_weights, w_gate, w_up, w_down), {})
