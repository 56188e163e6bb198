"""Conformance of ``routed_experts`` (docs/content/ops/routed_experts.md) for the backend under
test: the checks only this op has (``test_every_op`` has the shared ones)."""

from __future__ import annotations

import pytest
import torch

import cakeops
from cakeops import testing as t
from cakeops.reference import routed_experts as ref

OP = "routed_experts"
GRADS = ("x", "top_k_weights", "w_gate", "w_up", "w_down")

#: (name, T, D, F, E, top_k)
CASES = [
    ("mixtral-like", 16, 12, 20, 4, 2),
    ("top-1", 12, 8, 6, 4, 1),
    ("top-k-equals-e", 9, 8, 6, 3, 3),
    ("one-expert", 5, 8, 6, 1, 1),
    ("odd-sizes", 13, 10, 14, 5, 2),
    ("one-token", 1, 8, 6, 4, 2),
]


def make_inputs(T, D, F, E, k, dtype, device, *, packed=False, weight_dtype=None, skew=False,
                index_dtype=torch.int64, seed=0):  # fmt: skip
    """Inputs with distinct experts per token (``skew``: every token picks experts 0 and E-1);
    ``packed``: ``w_gate``, ``w_up`` are views of one ``(E, 2F, D)`` tensor, as in Hugging Face."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(shape, generator=gen, dtype=torch.float64) * scale

    if skew:
        index = torch.tensor([0, E - 1][:k]).repeat(T, 1)
    else:
        index = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.softmax(rand(T, k), dim=-1).to(device, dtype).requires_grad_()
    wd = weight_dtype or dtype
    if packed:
        gate_up = rand(E, 2 * F, D, scale=max(D, 1) ** -0.5).to(device, wd).requires_grad_()
        w_gate, w_up = gate_up[:, :F], gate_up[:, F:]
    else:
        w_gate = rand(E, F, D, scale=max(D, 1) ** -0.5).to(device, wd).requires_grad_()
        w_up = rand(E, F, D, scale=max(D, 1) ** -0.5).to(device, wd).requires_grad_()
    w_down = rand(E, D, F, scale=max(F, 1) ** -0.5).to(device, wd).requires_grad_()
    x = rand(T, D).to(device, dtype).requires_grad_()
    g = rand(T, D).to(device, dtype)
    return (x, index.to(device, index_dtype), weights, w_gate, w_up, w_down), g


def run(tensors, g):
    """Output and the gradients of ``x``, ``top_k_weights`` and the three weights."""
    x, index, *rest = tensors
    return t.run_with_grads(lambda x, *r: cakeops.routed_experts(x, index, *r), (x, *rest), g)


def check_against_reference(tensors, g, got):
    x, index, *rest = tensors
    leaves = dict(zip(GRADS, (x, *rest), strict=True))
    ref_out, ref_grads = t.reference_outputs(
        lambda x, w, wg, wu, wd: ref.math(x, index, w, wg, wu, wd), leaves, (), g
    )
    t.assert_matches(got[0], ref_out, "out", x.dtype)
    for (name, leaf), grad in zip(leaves.items(), got[1:], strict=True):
        t.assert_matches(grad, ref_grads[name], f"d{name}", leaf.dtype)


class TestRoutedExperts:
    op = OP

    @pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
    def test_matches_reference(self, backend, dtype, device, case):
        tensors, g = make_inputs(*case[1:], dtype, device)
        check_against_reference(tensors, g, run(tensors, g))

    def test_packed_gate_up_views(self, backend, dtype, device):
        """Hugging Face's ``gate_up_proj[:, :F]`` and ``[:, F:]``: no copy needed, and the
        gradient lands in the packed tensor."""
        tensors, g = make_inputs(16, 12, 20, 4, 2, dtype, device, packed=True)
        assert not tensors[3].is_contiguous()
        check_against_reference(tensors, g, run(tensors, g))

    @pytest.mark.cakeops_dtypes(torch.float16, torch.bfloat16)
    def test_float32_master_weights(self, backend, dtype, device):
        tensors, g = make_inputs(16, 12, 20, 4, 2, dtype, device, weight_dtype=torch.float32)
        got = run(tensors, g)
        assert got[0].dtype == dtype and all(d.dtype == torch.float32 for d in got[3:])
        check_against_reference(tensors, g, got)

    def test_int32_ids(self, backend, device):
        tensors, g = make_inputs(12, 8, 6, 4, 2, torch.float32, device, index_dtype=torch.int32)
        check_against_reference(tensors, g, run(tensors, g))

    def test_empty_experts_get_exact_zeros(self, backend, dtype, device):
        tensors, g = make_inputs(10, 8, 6, 5, 2, dtype, device, skew=True)
        got = run(tensors, g)
        check_against_reference(tensors, g, got)
        for grad in got[3:]:
            assert torch.equal(grad[1:4], torch.zeros_like(grad[1:4]))

    @pytest.mark.parametrize("D, F, k", [(0, 6, 2), (8, 0, 2), (8, 6, 0)], ids=["d0", "f0", "k0"])
    def test_empty_dims(self, backend, dtype, device, D, F, k):
        """No hidden features, no intermediate features or no slots: the output is exactly zero,
        and so is every gradient (each shaped like its input)."""
        tensors, g = make_inputs(5, D, F, 4, k, dtype, device)
        got = run(tensors, g)
        x, _, *rest = tensors
        for value, like in zip(got, (x, x, *rest), strict=True):
            assert value.shape == like.shape and torch.equal(value, torch.zeros_like(value))

    def test_same_as_moe_experts_with_its_routing(self, backend, device):
        """``moe_experts`` is its routing followed by these experts."""
        x = torch.randn(10, 8, device=device)
        logits = torch.randn(10, 4, device=device)
        w = [torch.randn(4, 6, 8, device=device) * 0.3 for _ in range(2)]
        w.append(torch.randn(4, 8, 6, device=device) * 0.3)
        probs = torch.softmax(logits, dim=-1)
        weights, index = torch.topk(probs, 2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = cakeops.routed_experts(x, index, weights, *w)
        whole = cakeops.moe_experts(x, logits, *w, top_k=2)
        t.assert_matches(routed, whole.double(), "out", torch.float32)


def _bad_inputs(device):
    x = torch.randn(4, 8, device=device)
    index = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]], device=device)
    w = torch.full((4, 2), 0.5, device=device)
    wg, wu = torch.randn(3, 6, 8, device=device), torch.randn(3, 6, 8, device=device)
    wd = torch.randn(3, 8, 6, device=device)
    return {
        # name: (args, error type, argument named in the message)
        "ids-float": ((x, index.float(), w, wg, wu, wd), TypeError, "top_k_index"),
        "ids-shape": ((x, index[:3], w, wg, wu, wd), ValueError, "top_k_index"),
        "weights-shape": ((x, index, w[:, :1], wg, wu, wd), ValueError, "top_k_weights"),
        "weights-int": ((x, index, w.long(), wg, wu, wd), TypeError, "top_k_weights"),
        "gate-hidden": ((x, index, w, wg[..., :7], wu, wd), ValueError, "w_gate"),
        "down-shape": ((x, index, w, wg, wu, wd[..., :5]), ValueError, "w_down"),
        "x-rank": ((x[None], index, w, wg, wu, wd), ValueError, "x"),
    }


def _bad_ids(device):
    index = _bad_inputs(device)["ids-float"][0][1].long()
    return {"id-too-large": index + 2, "id-negative": index - 1}


class TestRoutedExpertsBadInput:
    op = OP

    @pytest.mark.parametrize("case", list(_bad_inputs("cpu")))
    def test_bad_input_raises(self, backend, device, case):
        args, error, argument = _bad_inputs(device)[case]
        t.assert_bad_input_raises(OP, lambda: cakeops.routed_experts(*args), error, argument)

    @pytest.mark.parametrize("case", ["id-too-large", "id-negative"])
    def test_ids_out_of_range(self, backend, device, case):
        """Ids outside 0..E-1 are an error naming the argument (on the CPU at the call; on a
        GPU by a device assertion, which does not synchronise)."""
        if torch.device(device).type != "cpu":
            pytest.skip("a device assertion is reported asynchronously, not as a ValueError")
        args, _, _ = _bad_inputs(device)["ids-float"]
        x, _, w, wg, wu, wd = args
        bad = _bad_ids(device)[case]
        call = lambda: cakeops.routed_experts(x, bad, w, wg, wu, wd)  # noqa: E731
        t.assert_bad_input_raises(OP, call, ValueError, "top_k_index")
