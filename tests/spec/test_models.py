"""Equivalence with the model code users replace."""

import pytest
import torch
import torch.nn.functional as F

import cakeops


class Qwen2MoEStyleBlock(torch.nn.Module):
    """What model code writes: a router linear, softmax, top-k, per-expert nn.Linear SwiGLU
    experts, and a combine with index_add_ (the Qwen2-MoE / Mixtral layout)."""

    def __init__(self, E, D, F_, top_k, norm_topk_prob):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = torch.nn.Linear(D, E, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "gate_proj": torch.nn.Linear(D, F_, bias=False),
                    "up_proj": torch.nn.Linear(D, F_, bias=False),
                    "down_proj": torch.nn.Linear(F_, D, bias=False),
                }
            )
            for _ in range(E)
        )

    def forward(self, x):
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, selected = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(selected == e)
            h = F.silu(expert["gate_proj"](x[token])) * expert["up_proj"](x[token])
            y = expert["down_proj"](h) * weights[token, slot, None].to(x.dtype)
            out.index_add_(0, token, y)
        return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_experts_matches_a_qwen2_moe_style_block(norm_topk_prob):
    torch.manual_seed(0)
    E, D, F_, k = 6, 16, 24, 2
    # float32, as such blocks run: their routing is float32 (softmax(..., dtype=torch.float))
    block = Qwen2MoEStyleBlock(E, D, F_, k, norm_topk_prob)
    experts = cakeops.nn.MoEExperts(E, D, F_, k, renormalize=norm_topk_prob)
    with torch.no_grad():
        for e, ex in enumerate(block.experts):
            experts.w_gate[e].copy_(ex["gate_proj"].weight)
            experts.w_up[e].copy_(ex["up_proj"].weight)
            experts.w_down[e].copy_(ex["down_proj"].weight)
    x = torch.randn(20, D, requires_grad=True)
    g = torch.randn(20, D)

    want = block(x)
    want_grads = torch.autograd.grad(want, [x, block.gate.weight], g)
    got = experts(x, block.gate(x))
    got_grads = torch.autograd.grad(got, [x, block.gate.weight], g)
    assert cakeops.relative_error(got, want) <= cakeops.tolerance(torch.float32)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert cakeops.relative_error(a, b) <= cakeops.tolerance(torch.float32)
    # expert weight gradients, expert by expert
    dg = torch.autograd.grad(experts(x, block.gate(x)), experts.w_gate, g)[0]
    dg_want = torch.autograd.grad(block(x), [ex["gate_proj"].weight for ex in block.experts], g)
    for e in range(E):
        assert cakeops.relative_error(dg[e], dg_want[e]) <= cakeops.tolerance(torch.float32)


def test_moe_module_defaults():
    m = cakeops.nn.MoEExperts(4, 8, 12, 2)
    assert m.w_gate.shape == (4, 12, 8) and m.w_down.shape == (4, 8, 12)
    assert m.w_gate.dtype == torch.float32
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert m(x, torch.randn(3, 4)).dtype == torch.bfloat16
    assert "top_k=2" in repr(m)


def test_modules_initialise_after_meta_construction():
    """The deferred-initialisation pattern: build on the meta device, ``to_empty``, then
    ``reset_parameters`` gives the same weights as eager construction (no garbage memory)."""
    with torch.device("meta"):
        norm = cakeops.nn.RMSNormSiLUGate(8)
        moe = cakeops.nn.MoEExperts(4, 8, 6, top_k=2)
    norm.to_empty(device="cpu").reset_parameters()
    moe.to_empty(device="cpu")
    torch.manual_seed(0)
    moe.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(8))
    torch.manual_seed(0)
    eager = cakeops.nn.MoEExperts(4, 8, 6, top_k=2)
    for name in ("w_gate", "w_up", "w_down"):
        assert torch.equal(getattr(moe, name), getattr(eager, name)), name
    assert cakeops.nn.MoEExperts(2, 0, 3, top_k=1).w_gate.shape == (2, 3, 0)  # D = 0 initialises
