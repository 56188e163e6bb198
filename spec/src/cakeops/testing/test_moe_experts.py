"""Conformance of ``moe_experts`` (docs/content/ops/moe_experts.md) for the backend under test."""

from __future__ import annotations

import pytest
import torch

import cakeops
from cakeops.reference import moe_experts as ref
from cakeops.testing import (
    assert_bad_input_raises,
    assert_matches,
    reference_outputs,
    run_with_grads,
)

OP = "moe_experts"
NAMES = ("x", "router_logits", "w_gate", "w_up", "w_down")

# name -> (T, D, F, E, top_k, renormalize, scale)
CASES = {
    "mixtral-like": (16, 12, 20, 4, 2, True, 1.0),
    "no-renormalize": (16, 12, 20, 4, 2, False, 1.0),
    "top-1": (12, 8, 6, 4, 1, True, 1.0),
    "top-k-equals-e": (9, 8, 6, 3, 3, True, 1.0),
    "top-k-equals-e-no-renormalize": (9, 8, 6, 3, 3, False, 1.0),
    "one-expert": (5, 8, 6, 1, 1, True, 1.0),
    "odd-sizes-scaled": (13, 10, 14, 5, 2, True, 2.5),
    "one-token": (1, 8, 6, 4, 2, False, 1.0),
}


def make_inputs(T, D, F, E, dtype, device, weight_dtype=None, seed=0, skew=False):
    """Inputs whose routing has no near-ties: each token's logits are a permutation of well
    separated levels (so finite differences and rounding never flip a selection)."""
    gen = torch.Generator().manual_seed(seed)
    levels = torch.arange(E, dtype=torch.float64) * 0.6
    perm = torch.stack([torch.randperm(E, generator=gen) for _ in range(T)]) if T else None
    logits = levels[perm] if T else torch.empty(0, E, dtype=torch.float64)
    logits = logits + torch.rand(T, E, generator=gen, dtype=torch.float64) * 0.05
    if skew:  # every token picks experts 0 and E-1 (in that order): the others stay empty
        logits = torch.zeros(T, E, dtype=torch.float64)
        logits[:, 0], logits[:, E - 1] = 3.0, 2.0
        logits += torch.rand(T, E, generator=gen, dtype=torch.float64) * 0.05

    def rand(*shape, scale):
        return torch.randn(shape, generator=gen, dtype=torch.float64) * scale

    wd = weight_dtype or dtype
    x = rand(T, D, scale=1.0).to(device, dtype).requires_grad_()
    w_gate = rand(E, F, D, scale=max(D, 1) ** -0.5).to(device, wd).requires_grad_()
    w_up = rand(E, F, D, scale=max(D, 1) ** -0.5).to(device, wd).requires_grad_()
    w_down = rand(E, D, F, scale=max(F, 1) ** -0.5).to(device, wd).requires_grad_()
    router_logits = logits.to(device, torch.float32).requires_grad_()
    g = rand(T, D, scale=1.0).to(device, dtype)
    return (x, router_logits, w_gate, w_up, w_down), g


def op_with(top_k, renormalize=True, scale=1.0):
    def op(x, router_logits, w_gate, w_up, w_down):
        return cakeops.moe_experts(
            x,
            router_logits,
            w_gate,
            w_up,
            w_down,
            top_k=top_k,
            renormalize=renormalize,
            scale=scale,
        )

    return op


def check_against_reference(tensors, g, params, got):
    ref_out, ref_grads = reference_outputs(
        ref.math, dict(zip(NAMES, tensors, strict=True)), params, g
    )
    x = tensors[0]
    top_k, renormalize, _ = params
    assert_matches(got[0], ref_out, "out", x.dtype)
    for name, t, grad in zip(NAMES, tensors, got[1:], strict=True):
        if name == "router_logits" and renormalize and top_k == 1:
            # The combine weight is the constant ``scale``: the exact gradient is zero (the
            # float64 reference only reaches rounding noise around it).
            assert torch.equal(grad, torch.zeros_like(grad)), "drouter_logits must be exactly 0"
        else:
            assert_matches(grad, ref_grads[name], f"d{name}", t.dtype)


def check_form(form, dtype, device):
    """``moe_experts`` with one of ``routed_experts``' forms of expert (its weights, biases and
    options) against the reference: output and every gradient."""
    from cakeops.testing import test_routed_experts as routed

    options, make = routed.FORMS[form]
    T, D, F, E, k = routed.FORM_SHAPE
    (_, logits, *_), _ = make_inputs(T, D, F, E, dtype, device)
    tensors, g = routed.make_inputs(T, D, F, E, k, dtype, device, **make)
    x, _, _, w_gate, w_up, w_down, *rest = tensors
    biases = rest[0] if rest else {}
    leaves = {"x": x, "router_logits": logits, "w_gate": w_gate, "w_up": w_up, "w_down": w_down,
              **biases}  # fmt: skip
    leaves = {k: v for k, v in leaves.items() if v is not None}
    names = list(leaves)
    params = {"top_k": k, **options}

    def given(values):
        return {"w_gate": None, **dict(zip(names, values, strict=True))}

    def op(*values):
        return cakeops.moe_experts(**given(values), **params)

    def math(*values):
        tensors = given(values)
        index, weights = ref.route(tensors.pop("router_logits"), k, True, 1.0)
        return ref.routed.math(top_k_index=index, top_k_weights=weights, **tensors, **options)

    got = run_with_grads(op, list(leaves.values()), g)
    ref_out, ref_grads = reference_outputs(math, leaves, (), g)
    assert_matches(got[0], ref_out, "out", x.dtype)
    for (name, leaf), grad in zip(leaves.items(), got[1:], strict=True):
        assert_matches(grad, ref_grads[name], f"d{name}", leaf.dtype)


class TestMoEExperts:
    op = OP

    @pytest.mark.parametrize("form", ["gelu-tanh", "no-gate-biases", "interleaved"])
    def test_forms_of_expert(self, cakeops_backend, dtype, cakeops_device, form):
        """The forms of expert of ``routed_experts`` (biases, activations, no gate, layouts)."""
        check_form(form, dtype, cakeops_device)

    @pytest.mark.cakeops_dtypes(torch.float32, torch.float64)
    def test_gpt_oss_form(self, cakeops_backend, dtype, cakeops_device):
        """GPT-OSS's clamped SwiGLU with biases, interleaved and transposed (a derivative with
        jumps: float32 and float64, as in ``routed_experts``)."""
        check_form("gpt-oss", dtype, cakeops_device)

    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_reference(self, cakeops_backend, dtype, cakeops_device, case):
        T, D, F, E, k, renorm, scale = CASES[case]
        tensors, g = make_inputs(T, D, F, E, dtype, cakeops_device)
        got = run_with_grads(op_with(k, renorm, scale), tensors, g)
        check_against_reference(tensors, g, (k, renorm, scale), got)

    @pytest.mark.cakeops_dtypes(torch.float16, torch.bfloat16)
    def test_float32_master_weights(self, cakeops_backend, dtype, cakeops_device):
        tensors, g = make_inputs(16, 12, 20, 4, dtype, cakeops_device, weight_dtype=torch.float32)
        got = run_with_grads(op_with(2), tensors, g)
        assert got[0].dtype == dtype and all(d.dtype == torch.float32 for d in got[3:])
        check_against_reference(tensors, g, (2, True, 1.0), got)

    @pytest.mark.parametrize("renorm", [True, False])
    def test_skewed_routing_leaves_empty_experts_exactly_zero(
        self, cakeops_backend, dtype, cakeops_device, renorm
    ):
        tensors, g = make_inputs(10, 8, 6, 5, dtype, cakeops_device, skew=True)
        got = run_with_grads(op_with(2, renorm), tensors, g)
        check_against_reference(tensors, g, (2, renorm, 1.0), got)
        for grad in got[3:]:
            assert torch.equal(grad[1:4], torch.zeros_like(grad[1:4]))

    def test_logits_gradient_of_unselected_experts(self, cakeops_backend, cakeops_device):
        tensors, g = make_inputs(12, 8, 6, 5, torch.float32, cakeops_device)
        experts = ref.route(tensors[1], 2, True, 1.0)[0]
        unselected = torch.ones(12, 5, dtype=torch.bool).scatter_(1, experts.cpu(), False)
        with_renorm = run_with_grads(op_with(2, True), tensors, g)[2].cpu()
        assert torch.equal(with_renorm[unselected], torch.zeros_like(with_renorm[unselected]))
        without = run_with_grads(op_with(2, False), tensors, g)[2].cpu()
        assert (without[unselected] != 0).all()  # -p_te * sum_s r_ts dr_ts

    @pytest.mark.cakeops_dtypes(torch.float64)
    @pytest.mark.parametrize("renorm", [True, False])
    def test_gradcheck(self, cakeops_backend, dtype, cakeops_device, renorm):
        tensors, _ = make_inputs(5, 4, 3, 4, dtype, cakeops_device)
        tensors = (tensors[0], tensors[1].detach().double().requires_grad_(), *tensors[2:])
        assert torch.autograd.gradcheck(op_with(2, renorm, 1.5), tensors)

    def test_empty(self, cakeops_backend, dtype, cakeops_device):
        tensors, g = make_inputs(0, 8, 6, 4, dtype, cakeops_device)
        out, dx, dlogits, *dweights = run_with_grads(op_with(2), tensors, g)
        assert out.shape == (0, 8) and dx.shape == (0, 8) and dlogits.shape == (0, 4)
        for dw, w in zip(dweights, tensors[2:], strict=True):
            assert torch.equal(dw, torch.zeros_like(w))

    @pytest.mark.parametrize("D, F", [(0, 6), (8, 0)], ids=["d0", "f0"])
    def test_empty_feature_dims(self, cakeops_backend, dtype, cakeops_device, D, F):
        """No hidden or no intermediate features: the output is exactly zero (``(T, 0)`` or
        zeros), and so are every gradient that has elements."""
        tensors, g = make_inputs(5, D, F, 4, dtype, cakeops_device)
        out, dx, dlogits, *dweights = run_with_grads(op_with(2), tensors, g)
        assert out.shape == (5, D) and torch.equal(out, torch.zeros_like(out))
        assert torch.equal(dx, torch.zeros_like(dx))
        assert torch.equal(dlogits, torch.zeros_like(dlogits))
        for dw, w in zip(dweights, tensors[2:], strict=True):
            assert torch.equal(dw, torch.zeros_like(w))

    def test_ties_go_to_the_lower_expert(self, cakeops_backend, cakeops_device):
        tensors, _ = make_inputs(4, 8, 6, 4, torch.float32, cakeops_device)
        logits = torch.zeros(
            4, 4, device=cakeops_device
        )  # all tied: experts 0 and 1 must be chosen
        out = op_with(2)(tensors[0].detach(), logits, *(t.detach() for t in tensors[2:]))
        keep = (tensors[0].detach(), logits[:, :2], *(t.detach()[:2] for t in tensors[2:]))
        only_two = op_with(2)(*keep)  # the same with only experts 0 and 1 present
        assert torch.equal(out, only_two)

    def test_nan_propagates(self, cakeops_backend, dtype, cakeops_device):
        """NaN in one token's x and another's router logits: the output and every gradient are
        non-finite exactly where the float64 reference's are; the other tokens are untouched."""
        tensors, g = make_inputs(6, 8, 6, 4, dtype, cakeops_device)
        x, logits = (t.detach().clone() for t in tensors[:2])
        x[2, 3] = float("nan")
        logits[4, 1] = float("nan")
        poisoned = (x.requires_grad_(), logits.requires_grad_(), *tensors[2:])
        got = run_with_grads(op_with(2), poisoned, g)
        ref_out, ref_grads = reference_outputs(
            ref.math, dict(zip(NAMES, poisoned, strict=True)), (2, True, 1.0), g
        )
        for name, t, want in zip(("out", *NAMES), got, (ref_out, *ref_grads.values()),
                                 strict=True):  # fmt: skip
            assert torch.equal(torch.isfinite(t), torch.isfinite(want)), name
        out, dx = got[:2]
        assert torch.isnan(out[[2, 4]]).all() and torch.isfinite(out[[0, 1, 3, 5]]).all()
        assert torch.isfinite(dx[[0, 1, 3, 5]]).all()


def _bad_inputs(device):
    x = torch.randn(4, 8, device=device)
    logits = torch.randn(4, 3, device=device)
    wg, wu, wd = torch.randn(3, 6, 8), torch.randn(3, 6, 8), torch.randn(3, 8, 6)
    wg, wu, wd = wg.to(device), wu.to(device), wd.to(device)
    ok = (x, logits, wg, wu, wd)
    return {
        # name: (args, kwargs, error type, argument named in the message)
        "x-not-tensor": ((x.tolist(), *ok[1:]), {"top_k": 2}, TypeError, "x"),
        "x-rank": ((x[None], *ok[1:]), {"top_k": 2}, ValueError, "x"),
        "logits-tokens": ((x, logits[:3], wg, wu, wd), {"top_k": 2}, ValueError, "router_logits"),
        "gate-experts": ((x, logits, wg[:2], wu, wd), {"top_k": 2}, ValueError, "w_gate"),
        "gate-hidden": ((x, logits, wg[..., :7], wu, wd), {"top_k": 2}, ValueError, "w_gate"),
        "up-shape": ((x, logits, wg, wu[:, :5], wd), {"top_k": 2}, ValueError, "w_up"),
        "down-shape": ((x, logits, wg, wu, wd[..., :5]), {"top_k": 2}, ValueError, "w_down"),
        "down-layout": (
            (x, logits, wg, wu, wd.transpose(1, 2)),
            {"top_k": 2},
            ValueError,
            "w_down",
        ),
        "top-k-zero": (ok, {"top_k": 0}, ValueError, "top_k"),
        "top-k-above-e": (ok, {"top_k": 4}, ValueError, "top_k"),
        "top-k-float": (ok, {"top_k": 2.0}, TypeError, "top_k"),
        "scale-inf": (ok, {"top_k": 2, "scale": float("inf")}, ValueError, "scale"),
        "scale-nan": (ok, {"top_k": 2, "scale": float("nan")}, ValueError, "scale"),
        "renormalize-int": (ok, {"top_k": 2, "renormalize": 1}, TypeError, "renormalize"),
        "int-x": ((x.long(), logits, wg, wu, wd), {"top_k": 2}, TypeError, "x"),
        "weight-dtype": (
            (x.half(), logits, wg.double(), wu, wd),
            {"top_k": 2},
            TypeError,
            "w_gate",
        ),
        "mixed-weights": ((x, logits, wg, wu.double(), wd), {"top_k": 2}, TypeError, "w_up"),
        "mixed-devices": ((x, logits, wg, wu, wd.to("meta")), {"top_k": 2}, ValueError, "w_down"),
    }


class TestMoEExpertsBadInput:
    op = OP

    @pytest.mark.parametrize("case", list(_bad_inputs("cpu")))
    def test_bad_input_raises(self, cakeops_backend, cakeops_device, case):
        args, kwargs, error, argument = _bad_inputs(cakeops_device)[case]
        assert_bad_input_raises(OP, lambda: cakeops.moe_experts(*args, **kwargs), error, argument)
