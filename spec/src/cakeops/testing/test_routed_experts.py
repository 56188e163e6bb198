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
OPTIONS = ("b_gate", "b_up", "b_down")

#: The forms of expert the Hugging Face families use: the op's options, the tensors given
#: (``biases``: all three, ``"up-down"``: no gate bias) and the layout the weights are read in
#: (``packed``: HF's (E, 2F, D); ``interleaved``: gate and up alternating rows; ``transposed``:
#: views of (E, D, F) tensors). ``kink``: the activation's derivative jumps (relu, a limit), so
#: a 16-bit rounding across the jump moves a gradient by O(1): float32 and float64 only.
FORMS = {
    "gelu": ({"activation": "gelu"}, {}),
    "gelu-tanh": ({"activation": "gelu_tanh"}, {}),
    "relu2": ({"activation": "relu2"}, {}),
    "quick-gelu": ({"alpha": 1.702}, {}),
    "relu": ({"activation": "relu"}, {"kink": True}),
    "clamped-silu": ({"limit": 0.6}, {"kink": True}),  # DeepSeek-V4, GLM-5, HY-V4
    "gpt-oss": ({"alpha": 1.702, "limit": 0.8, "up_offset": 1.0},
                {"biases": True, "layout": "interleaved-transposed", "kink": True}),
    "biases": ({}, {"biases": True}),
    "transposed": ({}, {"layout": "transposed"}),  # Aria
    "interleaved": ({}, {"layout": "interleaved"}),
    "no-gate-relu2": ({"activation": "relu2"}, {"gated": False}),  # Nemotron-H
    "no-gate-biases": ({"activation": "gelu"}, {"gated": False, "biases": "up-down"}),
}  # fmt: skip
#: (T, D, F, E, top_k) of the forms' checks: small (the simulator and interpreter run them)
FORM_SHAPE = (10, 8, 12, 4, 2)

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
                index_dtype=torch.int64, seed=0, layout=None, gated=True, biases=False,
                kink=False):  # fmt: skip
    """Inputs with distinct experts per token (``skew``: every token picks experts 0 and E-1);
    ``packed``: ``w_gate``, ``w_up`` are views of one ``(E, 2F, D)`` tensor, as in Hugging Face;
    ``layout``, ``gated`` and ``biases`` as in :data:`FORMS` (the biases come in ``options``,
    which the tensors then end with: ``(..., w_down, options)``)."""
    del kink
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(shape, generator=gen, dtype=torch.float64) * scale

    if skew:
        index = torch.tensor([0, E - 1][:k]).repeat(T, 1)
    else:
        index = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.softmax(rand(T, k), dim=-1).to(device, dtype).requires_grad_()
    wd = weight_dtype or dtype

    def leaf(*shape, scale):
        return rand(*shape, scale=scale).to(device, wd).requires_grad_()

    layout = "packed" if packed else layout
    sd, sf = max(D, 1) ** -0.5, max(F, 1) ** -0.5
    if layout == "packed":
        gate_up = leaf(E, 2 * F, D, scale=sd)
        w_gate, w_up = gate_up[:, :F], gate_up[:, F:]
    elif layout == "interleaved":
        gate_up = leaf(E, 2 * F, D, scale=sd)
        w_gate, w_up = gate_up[:, ::2], gate_up[:, 1::2]
    elif layout == "interleaved-transposed":  # GPT-OSS: (E, D, 2F), gate and up alternating
        gate_up = leaf(E, D, 2 * F, scale=sd)
        w_gate, w_up = gate_up[..., ::2].transpose(1, 2), gate_up[..., 1::2].transpose(1, 2)
    elif layout and layout.endswith("transposed"):
        w_gate, w_up = (leaf(E, D, F, scale=sd).transpose(1, 2) for _ in range(2))
    else:
        w_gate, w_up = leaf(E, F, D, scale=sd), leaf(E, F, D, scale=sd)
    if layout and layout.endswith("transposed"):
        w_down = leaf(E, F, D, scale=sf).transpose(1, 2)
    else:
        w_down = leaf(E, D, F, scale=sf)
    x = rand(T, D).to(device, dtype).requires_grad_()
    g = rand(T, D).to(device, dtype)
    tensors = (x, index.to(device, index_dtype), weights, w_gate if gated else None, w_up, w_down)
    if not biases:
        return tensors, g
    options = {"b_up": leaf(E, F, scale=0.5), "b_down": leaf(E, D, scale=0.5)}
    if gated and biases is True:
        options["b_gate"] = leaf(E, F, scale=0.5)
    return (*tensors, options), g


def _split(tensors):
    """``(x, index, the differentiable tensors by name, options)`` of :func:`make_inputs`'
    tensors (the names of those given: no ``w_gate`` without a gate, the biases given)."""
    options = tensors[6] if len(tensors) > 6 else {}
    x, index, weights, w_gate, w_up, w_down = tensors[:6]
    named = {"x": x, "top_k_weights": weights, "w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    named.update((k, options[k]) for k in OPTIONS if k in options)
    return x, index, {k: v for k, v in named.items() if v is not None}, options


def _of_leaves(fn, names, index, **kwargs):
    """``fn`` (the op, or the reference math) as a function of the leaves ``names`` names, in
    that order (``w_gate`` None when not among them)."""

    def call(*values):
        given = {"w_gate": None, **dict(zip(names, values, strict=True))}
        return fn(top_k_index=index, **given, **kwargs)

    return call


def run(tensors, g, **kwargs):
    """Output and the gradients of every differentiable tensor given (``x``,
    ``top_k_weights``, the weights, the biases), in :func:`_split`'s order."""
    _, index, leaves, _ = _split(tensors)
    op = _of_leaves(cakeops.routed_experts, list(leaves), index, **kwargs)
    return t.run_with_grads(op, list(leaves.values()), g)


def check_against_reference(tensors, g, got, **kwargs):
    x, index, leaves, _ = _split(tensors)
    math = _of_leaves(ref.math, list(leaves), index, **kwargs)
    ref_out, ref_grads = t.reference_outputs(math, leaves, (), g)
    t.assert_matches(got[0], ref_out, "out", x.dtype)
    for (name, leaf), grad in zip(leaves.items(), got[1:], strict=True):
        t.assert_matches(grad, ref_grads[name], f"d{name}", leaf.dtype)


class TestRoutedExperts:
    op = OP

    @pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
    def test_matches_reference(self, cakeops_backend, dtype, cakeops_device, case):
        tensors, g = make_inputs(*case[1:], dtype, cakeops_device)
        check_against_reference(tensors, g, run(tensors, g))

    @pytest.mark.parametrize("form", [f for f in FORMS if not FORMS[f][1].get("kink")])
    def test_forms_of_expert(self, cakeops_backend, dtype, cakeops_device, form):
        """Every activation, biases, no gate, transposed and interleaved weights (read through
        their strides): output and every gradient against the reference."""
        options, make = FORMS[form]
        tensors, g = make_inputs(*FORM_SHAPE, dtype, cakeops_device, **make)
        got = run(tensors, g, **options)
        check_against_reference(tensors, g, got, **options)

    @pytest.mark.parametrize("form", ["biases", "no-gate-biases"])
    def test_default_dtype_changes_nothing(self, cakeops_backend, cakeops_device, form):
        """The forms with biases (their gradients sum rows a backend may sum as a product
        with ones): PyTorch's default dtype (bfloat16 in many inference scripts) reaches no
        kernel."""
        options, make = FORMS[form]
        tensors, g = make_inputs(*FORM_SHAPE, torch.float32, cakeops_device, **make)
        t.assert_default_dtype_changes_nothing(lambda: run(tensors, g, **options))

    @pytest.mark.cakeops_dtypes(torch.float32, torch.float64)
    @pytest.mark.parametrize("form", [f for f in FORMS if FORMS[f][1].get("kink")])
    def test_forms_with_a_kink(self, cakeops_backend, dtype, cakeops_device, form):
        """relu and the limits (GPT-OSS, DeepSeek-V4): their derivative jumps, so these run in
        float32 and float64 (see :data:`FORMS`)."""
        options, make = FORMS[form]
        tensors, g = make_inputs(*FORM_SHAPE, dtype, cakeops_device, **make)
        got = run(tensors, g, **options)
        check_against_reference(tensors, g, got, **options)

    def test_large_finite_gate_projections(self, cakeops_backend, dtype, cakeops_device):
        """Gate pre-activations in the thousands, both signs (silu saturates): the reference's
        finite result, where a naive ``1 / (1 + exp(-h))`` overflows (an error in numba's
        simulator, inf on a GPU)."""
        tensors, g = make_inputs(*FORM_SHAPE, dtype, cakeops_device)
        with torch.no_grad():
            tensors[3].mul_(4000)
        check_against_reference(tensors, g, run(tensors, g))

    @pytest.mark.parametrize("form", ["relu", "relu2", "no-gate-relu2", "swiglu-default"])
    def test_nan_in_a_token_reaches_its_output(self, cakeops_backend, dtype, cakeops_device, form):
        """A NaN in one token's hidden state makes that token's output NaN and leaves the
        others as they are, in every activation (a GPU's ``tl.maximum`` returns 0 for a NaN:
        relu and relu² dropped it)."""
        options, make = FORMS.get(form, ({}, {}))
        tensors, g = make_inputs(*FORM_SHAPE, dtype, cakeops_device, **make)
        bad = tensors[0].detach().clone()
        bad[3] = float("nan")
        out = run((bad.requires_grad_(), *tensors[1:]), g, **options)[0]
        assert torch.isnan(out[3]).all(), out[3]
        others = torch.ones(out.shape[0], dtype=torch.bool)
        others[3] = False
        clean = run(tensors, g, **options)[0]
        assert torch.equal(out[others], clean[others])

    @pytest.mark.parametrize("weight", ["finite", "nan", "inf"])
    def test_dropped_slots(self, cakeops_backend, dtype, cakeops_device, weight):
        """Ids ``>= E`` (transformers' expert parallelism: experts on another rank) and ``-1``
        (DeepEP's dispatch: not on this rank) add nothing and get zero gradients, whatever their
        weight (a NaN or inf there made the output NaN); the rest is the op on the slots that
        are kept."""
        tensors, g = make_inputs(*FORM_SHAPE, dtype, cakeops_device)
        x, index, weights, *w = tensors
        dropped = index.clone()
        dropped[::3, 1] = 4  # E: the first id past the local experts
        dropped[1::5, 0] = 1000
        dropped[2::7, 0] = -1
        kept = (dropped >= 0) & (dropped < 4)
        if weight != "finite":
            with torch.no_grad():
                signs = (-1.0) ** torch.arange(int((~kept).sum()), device=cakeops_device)
                weights[~kept] = (float(weight) * signs).to(weights.dtype)
        got = run((x, dropped, weights, *w), g)
        # the same tokens with those slots' weights at zero and any valid id: the same result
        zeroed = torch.where(kept, weights, 0).detach().requires_grad_()
        want = run((x, torch.where(kept, dropped, 0), zeroed, *w), g)
        t.assert_matches(got[0], want[0].double(), "out", x.dtype)
        for name, a, b in zip(("dx", "dtop_k_weights", "dw_gate", "dw_up", "dw_down"), got[1:],
                              want[1:], strict=True):  # fmt: skip
            if name == "dtop_k_weights":
                assert torch.equal(a[~kept], torch.zeros_like(a[~kept])), name
                a, b = a[kept], b[kept]
            t.assert_matches(a, b.double(), name, a.dtype)

    def test_every_slot_dropped(self, cakeops_backend, dtype, cakeops_device):
        """No slot kept: the output and every gradient are exactly zero (the reference's
        backward raised "element 0 of tensors does not require grad")."""
        tensors, g = make_inputs(*FORM_SHAPE, dtype, cakeops_device)
        x, index, *rest = tensors
        got = run((x, torch.full_like(index, 4), *rest), g)
        for value, like in zip(got, (x, x, *rest), strict=True):
            assert value.shape == like.shape and torch.equal(value, torch.zeros_like(value))

    def test_packed_gate_up_views(self, cakeops_backend, dtype, cakeops_device):
        """Hugging Face's ``gate_up_proj[:, :F]`` and ``[:, F:]``: no copy needed, and the
        gradient lands in the packed tensor."""
        tensors, g = make_inputs(16, 12, 20, 4, 2, dtype, cakeops_device, packed=True)
        assert not tensors[3].is_contiguous()
        check_against_reference(tensors, g, run(tensors, g))

    @pytest.mark.cakeops_dtypes(torch.float16, torch.bfloat16)
    def test_float32_master_weights(self, cakeops_backend, dtype, cakeops_device):
        tensors, g = make_inputs(
            16, 12, 20, 4, 2, dtype, cakeops_device, weight_dtype=torch.float32
        )
        got = run(tensors, g)
        assert got[0].dtype == dtype and all(d.dtype == torch.float32 for d in got[3:])
        check_against_reference(tensors, g, got)

    def test_int32_ids(self, cakeops_backend, cakeops_device):
        tensors, g = make_inputs(
            12, 8, 6, 4, 2, torch.float32, cakeops_device, index_dtype=torch.int32
        )
        check_against_reference(tensors, g, run(tensors, g))

    def test_empty_experts_get_exact_zeros(self, cakeops_backend, dtype, cakeops_device):
        tensors, g = make_inputs(10, 8, 6, 5, 2, dtype, cakeops_device, skew=True)
        got = run(tensors, g)
        check_against_reference(tensors, g, got)
        for grad in got[3:]:
            assert torch.equal(grad[1:4], torch.zeros_like(grad[1:4]))

    @pytest.mark.parametrize("D, F, k", [(0, 6, 2), (8, 0, 2), (8, 6, 0)], ids=["d0", "f0", "k0"])
    def test_empty_dims(self, cakeops_backend, dtype, cakeops_device, D, F, k):
        """No hidden features, no intermediate features or no slots: the output is exactly zero,
        and so is every gradient (each shaped like its input)."""
        tensors, g = make_inputs(5, D, F, 4, k, dtype, cakeops_device)
        got = run(tensors, g)
        x, _, *rest = tensors
        for value, like in zip(got, (x, x, *rest), strict=True):
            assert value.shape == like.shape and torch.equal(value, torch.zeros_like(value))

    def test_same_as_moe_experts_with_its_routing(self, cakeops_backend, cakeops_device):
        """``moe_experts`` is its routing followed by these experts."""
        x = torch.randn(10, 8, device=cakeops_device)
        logits = torch.randn(10, 4, device=cakeops_device)
        w = [torch.randn(4, 6, 8, device=cakeops_device) * 0.3 for _ in range(2)]
        w.append(torch.randn(4, 8, 6, device=cakeops_device) * 0.3)
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


def _bad_options(device):
    """Bad biases and activation options: (kwargs, w_gate given, error, argument)."""
    bias = torch.zeros(3, 6, device=device)
    return {
        "activation": ({"activation": "tanh"}, True, ValueError, "activation"),
        "alpha-not-silu": ({"activation": "gelu", "alpha": 2.0}, True, ValueError, "alpha"),
        "alpha-negative": ({"alpha": -1.0}, True, ValueError, "alpha"),
        "limit-zero": ({"limit": 0.0}, True, ValueError, "limit"),
        "limit-nan": ({"limit": float("nan")}, True, ValueError, "limit"),
        "offset-inf": ({"up_offset": float("inf")}, True, ValueError, "up_offset"),
        "bias-shape": ({"b_gate": bias[:, :5]}, True, ValueError, "b_gate"),
        "bias-dtype": ({"b_down": torch.zeros(3, 8, device=device).double()}, True, TypeError,
                       "b_down"),
        "gate-bias-no-gate": ({"b_gate": bias}, False, ValueError, "b_gate"),
        "limit-no-gate": ({"limit": 1.0}, False, ValueError, "limit"),
        "offset-no-gate": ({"up_offset": 1.0}, False, ValueError, "up_offset"),
        "activation-type": ({"activation": 1}, True, TypeError, "activation"),
        "bias-not-tensor": ({"b_up": [0.0]}, True, TypeError, "b_up"),
    }  # fmt: skip


class TestRoutedExpertsBadInput:
    op = OP

    @pytest.mark.parametrize("case", list(_bad_inputs("cpu")))
    def test_bad_input_raises(self, cakeops_backend, cakeops_device, case):
        args, error, argument = _bad_inputs(cakeops_device)[case]
        t.assert_bad_input_raises(OP, lambda: cakeops.routed_experts(*args), error, argument)

    @pytest.mark.parametrize("case", list(_bad_options("cpu")))
    def test_bad_options_raise(self, cakeops_backend, cakeops_device, case):
        args, _, _ = _bad_inputs(cakeops_device)["ids-float"]
        x, index, w, wg, wu, wd = args
        kwargs, gated, error, argument = _bad_options(cakeops_device)[case]
        call = lambda: cakeops.routed_experts(  # noqa: E731
            x, index.long(), w, wg if gated else None, wu, wd, **kwargs
        )
        t.assert_bad_input_raises(OP, call, error, argument)

    def test_negative_ids_raise(self, cakeops_backend, cakeops_device):
        """Ids below -1 are an error naming the argument (on the CPU at the call; on a GPU a
        device assertion, which does not synchronise and so is not a ValueError)."""
        if torch.device(cakeops_device).type != "cpu":
            pytest.skip("a device assertion is reported asynchronously, not as a ValueError")
        args, _, _ = _bad_inputs(cakeops_device)["ids-float"]
        x, index, w, wg, wu, wd = args
        call = lambda: cakeops.routed_experts(x, index.long() - 2, w, wg, wu, wd)  # noqa: E731
        t.assert_bad_input_raises(OP, call, ValueError, "top_k_index")
