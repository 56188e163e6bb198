"""Conformance of ``causal_conv1d`` (docs/content/ops/causal_conv1d.md) for the backend under
test: the checks only this op has (``test_every_op`` has the shared ones). The oracle is the
float64 sum over the kernel's taps of :mod:`cakeops.reference.causal_conv1d`."""

from __future__ import annotations

import itertools

import pytest
import torch

import cakeops
from cakeops.reference import causal_conv1d as ref
from cakeops.testing import (
    EMULATED,
    assert_bad_input_raises,
    assert_compiled_matches,
    assert_matches,
    assert_opcheck_and_compile_with_state,
    check_with_state,
    run_with_state,
)
from cakeops.testing.stateful import StatefulOpChecks

OP = "causal_conv1d"

#: name -> the options a case gives (the width is Mamba2's 4 unless a case says)
OPTION_CASES = {
    "plain": (),
    "bias": ("bias",),
    "silu": ("silu",),
    "initial_state": ("initial_state",),
    "final": ("final",),
    "packed": ("packed",),
    "together": ("bias", "silu", "initial_state", "final", "packed"),
}
#: The sequence length of most checks: past a block of positions of the GPU kernels (64; 8
#: under an emulator, where each position costs milliseconds).
L = 19 if EMULATED else 150
#: empty sequences and sequences shorter than the state among them
CU_SEQLENS = [0, 2, 2, 9, 10, 10, 19] if EMULATED else [0, 2, 2, 70, 71, 71, 150]


def make_inputs(given=(), dtype=torch.float32, device="cpu", N=2, C=5, L=L, W=4, seed=0):
    """``(tensors by name, fixed options, g_out, g_final)``: x, weight (and bias,
    initial_state) requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    N = 1 if "packed" in given else N

    def rand(*shape, scale=1.0):
        return torch.randn(shape, generator=gen, dtype=torch.float64) * scale

    tensors = {"x": rand(N, C, L), "weight": rand(C, W, scale=0.5)}
    if "bias" in given:
        tensors["bias"] = rand(C, scale=0.5)
    fixed: dict = {}
    sequences = N
    if "packed" in given:
        fixed["cu_seqlens"] = torch.tensor(CU_SEQLENS, device=device)
        sequences = len(CU_SEQLENS) - 1
    if "initial_state" in given:
        tensors["initial_state"] = rand(sequences, C, W - 1)
    if "silu" in given:
        fixed["activation"] = "silu"
    fixed["output_final_state"] = "final" in given
    tensors = {n: t.to(device, dtype).requires_grad_() for n, t in tensors.items()}
    g_out = rand(N, C, L).to(device, dtype)
    g_final = rand(sequences, C, W - 1).to(device)
    return tensors, fixed, g_out, g_final


def run(tensors, fixed, g_out, g_final, math=False):
    """``(out, final_state or None, *gradients)`` of the op (or of its float64 reference)."""
    return run_with_state(cakeops.causal_conv1d, ref.conv, tensors, fixed, g_out, g_final, math)


def check_against_reference(tensors, fixed, g_out, g_final):
    check_with_state(cakeops.causal_conv1d, ref.conv, tensors, fixed, g_out, g_final)


class TestCausalConv1d(StatefulOpChecks):
    op = OP
    make_inputs, run = staticmethod(make_inputs), staticmethod(run)
    L, CU_SEQLENS, ALONG = L, CU_SEQLENS, ("x",)
    PACKED = EVERY_OPTION = OPTION_CASES["together"]
    CONTINUED = ("bias", "silu", "final")

    @pytest.mark.parametrize("case", list(OPTION_CASES))
    def test_options_match_the_reference(self, cakeops_backend, dtype, cakeops_device, case):
        """Each option alone and together: the output, the final state and every gradient
        against the float64 sum."""
        check_against_reference(*make_inputs(OPTION_CASES[case], dtype, cakeops_device))

    @pytest.mark.parametrize("W", [1, 2, 3, 5])
    def test_widths(self, cakeops_backend, dtype, cakeops_device, W):
        """Kernel widths other than 4 (1: no state at all), every option."""
        given = ("bias", "silu", "initial_state", "final", "packed")
        check_against_reference(*make_inputs(given, dtype, cakeops_device, W=W))

    @pytest.mark.parametrize("L", [1, 2, 5])
    @pytest.mark.parametrize("start", ["initial_state", "zeros"])
    def test_short_sequences(self, cakeops_backend, dtype, cakeops_device, L, start):
        """Decoding's sizes (one position; fewer positions than the state holds), from a given
        state and from zeros."""
        given = ("bias", "silu", "final") + (("initial_state",) if start != "zeros" else ())
        check_against_reference(*make_inputs(given, dtype, cakeops_device, L=L))

    @pytest.mark.cakeops_dtypes(torch.float16, torch.bfloat16)
    def test_float32_weight_and_state_with_16_bit_x(self, cakeops_backend, dtype, cakeops_device):
        """As models may call it in 16-bit: x in 16-bit, weight, bias and the state in float32;
        every result within the 16-bit tolerance, each gradient in its input's dtype, the final
        state in the initial state's dtype."""
        given = ("bias", "silu", "initial_state", "final")
        tensors, fixed, g_out, g_final = make_inputs(given, dtype, cakeops_device)
        for name in ("weight", "bias", "initial_state"):
            tensors[name] = tensors[name].detach().float().requires_grad_()
        got = run(tensors, fixed, g_out, g_final)
        want = run(tensors, fixed, g_out, g_final, math=True)
        assert got[1].dtype == torch.float32
        names = ["out", "final_state", *(f"d{n}" for n in tensors)]
        for name, a, b in zip(names, got, want, strict=True):
            assert_matches(a, b, name, a.dtype)
        for name, t, grad in zip(tensors, tensors.values(), got[2:], strict=True):
            assert grad.dtype == t.dtype, name

    def test_final_state_is_the_last_inputs(self, cakeops_backend, dtype, cakeops_device):
        """The final state holds the inputs themselves (exactly: no arithmetic), reaching into
        the initial state for a sequence shorter than it."""
        given = ("initial_state", "final", "packed")
        tensors, fixed, _, _ = make_inputs(given, dtype, cakeops_device)
        _, final = cakeops.causal_conv1d(**tensors, **fixed)
        x, s0 = tensors["x"].detach(), tensors["initial_state"].detach()
        for i, (s, e) in enumerate(itertools.pairwise(CU_SEQLENS)):
            want = torch.cat([s0[i], x[0, :, s:e]], 1)[:, -3:]
            assert torch.equal(final[i], want), f"sequence {i}"

    @pytest.mark.parametrize("packed", [False, True])
    def test_strided_views_in_the_models_layout(self, cakeops_backend, cakeops_device, packed):
        """x in Hugging Face's ``(N, L, C)`` layout passed as a ``transpose(1, 2)`` view gives
        the results of a contiguous copy, its output and gradient laid out like x (the models
        transpose them back without a copy)."""
        given = ("bias", "silu", "initial_state", "final") + (("packed",) if packed else ())
        tensors, fixed, g_out, g_final = make_inputs(given, torch.float32, cakeops_device, C=6)
        views = dict(tensors)
        views["x"] = tensors["x"].detach().transpose(1, 2).contiguous().transpose(1, 2)
        views["x"].requires_grad_()
        assert not views["x"].is_contiguous()
        out, _ = cakeops.causal_conv1d(**views, **fixed)
        assert out.stride() == views["x"].stride()
        got = run(views, fixed, g_out.transpose(1, 2).contiguous().transpose(1, 2), g_final)
        want = run(tensors, fixed, g_out, g_final)
        names = ["out", "final_state", *(f"d{n}" for n in tensors)]
        for name, a, b in zip(names, got, want, strict=True):  # the sums' order may differ
            assert_matches(a, b.double(), name, torch.float32)

    def test_opcheck_and_compile_in_the_models_layout(self, cakeops_backend, cakeops_device):
        """With x a transposed view, the custom op passes opcheck (its fake output laid out
        like x, as the kernel's) and a compiled call returns the eager results, in x's
        layout."""
        given = ("bias", "silu", "initial_state", "final")
        tensors, fixed, _, _ = make_inputs(given, torch.float32, cakeops_device, L=12)
        x = tensors["x"].detach().transpose(1, 2).contiguous().transpose(1, 2)
        tensors["x"] = x.requires_grad_()
        from cakeops.ops import SPECS

        values = SPECS[OP].inputs(**tensors, **fixed).values()
        torch.library.opcheck(torch.ops.cakeops.causal_conv1d.default, tuple(values))
        torch._dynamo.reset()
        eager = cakeops.causal_conv1d(**tensors, **fixed)
        compiled = torch.compile(cakeops.causal_conv1d, fullgraph=True)(**tensors, **fixed)
        assert [a.stride() for a in eager] == [b.stride() for b in compiled]
        assert_compiled_matches(eager, compiled)
        assert compiled[0].stride() == x.stride()

    @pytest.mark.parametrize("packed", [False, True])
    def test_opcheck_and_compile(self, cakeops_backend, cakeops_device, packed):
        """The custom op with every option passes torch.library.opcheck (its backward too), and
        torch.compile(fullgraph=True) gives the eager results."""
        given = ("bias", "silu", "initial_state", "final") + (("packed",) if packed else ())
        tensors, fixed, g_out, g_final = make_inputs(given, torch.float32, cakeops_device, L=12)
        if packed:
            fixed["cu_seqlens"] = torch.tensor([0, 2, 2, 7, 12], device=cakeops_device)
            tensors["initial_state"] = tensors["initial_state"].detach()[:4].requires_grad_()
            g_final = g_final[:4]
        assert_opcheck_and_compile_with_state(OP, tensors, fixed, g_out, g_final)

    @pytest.mark.cakeops_dtypes(torch.float64)
    def test_gradcheck(self, cakeops_backend, dtype, cakeops_device):
        """Float64 gradcheck of the output and the final state in every differentiable input,
        every option given, packed (a sequence shorter than the state among them)."""
        given = ("bias", "silu", "initial_state", "final", "packed")
        tensors, fixed, _, _ = make_inputs(given, dtype, cakeops_device, C=2, L=9, W=3)
        fixed["cu_seqlens"] = torch.tensor([0, 1, 1, 6, 9], device=cakeops_device)
        tensors["initial_state"] = tensors["initial_state"].detach()[:4].requires_grad_()
        names = list(tensors)

        def fn(*values):
            return cakeops.causal_conv1d(**dict(zip(names, values, strict=True)), **fixed)

        assert torch.autograd.gradcheck(fn, tuple(tensors.values()))

    @pytest.mark.parametrize("poisoned", ["x", "g_out"])
    def test_non_finite_values_stay_local(self, cakeops_backend, dtype, cakeops_device, poisoned):
        """A NaN makes non-finite exactly the entries of the output and of the gradients that
        the float64 sum makes non-finite (the windows it falls in), and leaves every other
        entry as it is without it."""
        given = ("bias", "silu", "initial_state", "final")
        tensors, fixed, g_out, g_final = make_inputs(given, dtype, cakeops_device)
        bad = {n: t.detach().clone() for n, t in tensors.items()}
        bad["g_out"] = g_out.clone()
        bad[poisoned][0, 1, L // 2] = float("nan")
        g_bad = bad.pop("g_out")
        leaves = {n: t.requires_grad_() for n, t in bad.items()}
        got = run(leaves, fixed, g_bad, g_final)
        want = run(leaves, fixed, g_bad, g_final, math=True)
        fine = run(tensors, fixed, g_out, g_final, math=True)
        names = ["out", "final", *(f"d{n}" for n in tensors)]
        for name, a, w, f in zip(names, got, want, fine, strict=True):
            finite = torch.isfinite(w)
            assert torch.equal(torch.isfinite(a).cpu(), finite.cpu()), f"{name}: non-finite differ"
            assert_matches(a.where(finite, 0), f.where(finite, 0), name, a.dtype)

    @pytest.mark.parametrize("bad", ["x-2d", "weight-shape", "weight-empty", "bias-shape",
                                     "weight-dtype", "activation", "cu-unsorted", "cu-n2",
                                     "initial-shape", "cu-float"])  # fmt: skip
    def test_bad_inputs_raise(self, cakeops_backend, cakeops_device, bad):
        x = torch.randn(2, 4, 8, device=cakeops_device)
        weight = torch.randn(4, 4, device=cakeops_device)
        args = {"x": x, "weight": weight}
        cases = {
            "x-2d": ({"x": x[0]}, ValueError, "x"),
            "weight-shape": ({"weight": weight[:3]}, ValueError, "weight"),
            "weight-empty": ({"weight": weight[:, :0]}, ValueError, "weight"),
            "bias-shape": ({"bias": torch.zeros(3)}, ValueError, "bias"),
            "weight-dtype": ({"weight": weight.double()}, TypeError, "weight"),
            "activation": ({"activation": "relu"}, ValueError, "activation"),
            "cu-unsorted": ({"cu_seqlens": torch.tensor([0, 5, 3, 8])}, ValueError,
                            "cu_seqlens"),
            "cu-n2": ({"cu_seqlens": torch.tensor([0, 8])}, ValueError, "cu_seqlens"),
            "cu-float": ({"cu_seqlens": torch.tensor([0.0, 8.0])}, TypeError, "cu_seqlens"),
            "initial-shape": ({"initial_state": torch.zeros(2, 4, 4)}, ValueError,
                              "initial_state"),
        }  # fmt: skip
        kwargs, error, argument = cases[bad]
        if bad in ("cu-unsorted", "cu-float"):
            args["x"] = x[:1]
        kwargs = {n: t.to(cakeops_device) if isinstance(t, torch.Tensor) else t
                  for n, t in kwargs.items()}  # fmt: skip
        call = lambda: cakeops.causal_conv1d(**{**args, **kwargs})  # noqa: E731
        assert_bad_input_raises(OP, call, error, argument)
