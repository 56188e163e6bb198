"""Float64 reference math of ``moe_experts``: the plain loop over experts."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F


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


def math(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale):
    """The op in float64; autograd of this is the reference gradient."""
    x, w_gate, w_up, w_down = x.double(), w_gate.double(), w_up.double(), w_down.double()
    experts, weights = route(router_logits, top_k, renormalize, scale)
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        rows = x[token]
        h = F.silu(rows @ w_gate[e].T) * (rows @ w_up[e].T)
        out = out.index_add(0, token, (h @ w_down[e].T) * weights[token, slot, None])
    return out


def forward(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale):
    return math(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale).to(x.dtype)


def backward(g, x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale):
    """Autograd of :func:`math`, run on a fresh thread: autograd is switched off (thread-locally)
    inside a custom op's kernel."""
    inputs = (x, router_logits, w_gate, w_up, w_down)
    result: list = []

    def work():
        leaves = [t.detach().double().requires_grad_() for t in inputs]
        out = math(*leaves, top_k, renormalize, scale)
        result.extend(torch.autograd.grad(out, leaves, g.double(), allow_unused=True))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    if len(result) != len(inputs):
        raise RuntimeError("moe_experts: reference backward failed (see the thread's traceback)")
    return tuple(
        (torch.zeros_like(t) if d is None else d.to(t.dtype))
        for d, t in zip(result, inputs, strict=True)
    )
