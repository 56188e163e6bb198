"""Conformance of ``gated_delta_rule`` (docs/content/ops/gated_delta_rule.md) for the backend
under test: the checks only this op has (``test_every_op`` has the shared ones). The oracle is
the float64 recurrence of :mod:`cakeops.reference.gated_delta_rule`, one step at a time."""

from __future__ import annotations

import pytest
import torch

import cakeops
from cakeops._spec import CHECK_VALUES_ENV
from cakeops.reference import gated_delta_rule as ref
from cakeops.testing import (
    EMULATED,
    assert_bad_input_raises,
    assert_matches,
    assert_opcheck_and_compile_with_state,
    check_with_state,
    run_with_state,
)
from cakeops.testing.stateful import StatefulOpChecks

OP = "gated_delta_rule"

#: name -> the options a case gives (every case has grouped value heads: 2 per key head)
OPTION_CASES = {
    "plain": (),
    "kda": ("kda",),
    "scale": ("scale",),
    "initial_state": ("initial_state",),
    "final": ("final",),
    "l2norm": ("l2norm",),
    "packed": ("packed",),
    "one-value-head-per-key-head": ("ungrouped",),
    "together": ("scale", "initial_state", "final", "l2norm", "packed"),
    "together-kda": ("kda", "scale", "initial_state", "final", "l2norm", "packed"),
}
#: The sequence length of most checks, and a position that starts a chunk of the backends'
#: kernels (torch: chunks of 64; under an emulator the kernels take chunks of 4, and the checks
#: shorter sequences, each position costing milliseconds there).
L = 12 if EMULATED else 77
CHUNK_START = 8 if EMULATED else 64
#: empty sequences among them, a chunk boundary crossed
CU_SEQLENS = [0, 3, 3, 8, 11, 11, 12] if EMULATED else [0, 9, 9, 40, 70, 70, 77]


def make_inputs(given=(), dtype=torch.float32, device="cpu", N=2, H=2, G=2, L=L, K=8, V=6,
                seed=0):  # fmt: skip
    """``(tensors by name, fixed options, g_out, g_final)``: q, k, v, g, beta (and
    initial_state) requiring grad, as models give them (unit keys, sigmoid-like beta)."""
    gen = torch.Generator().manual_seed(seed)
    G = 1 if "ungrouped" in given else G
    N = 1 if "packed" in given else N
    Hv = H * G

    def rand(*shape, scale=1.0):
        return torch.randn(shape, generator=gen, dtype=torch.float64) * scale

    k = rand(N, H, L, K)
    if "l2norm" not in given:
        k = torch.nn.functional.normalize(k, dim=-1)
    tensors = {
        "q": rand(N, H, L, K, scale=1.0 if "l2norm" in given else K**-0.5 * 2),
        "k": k,
        "v": rand(N, Hv, L, V),
        "g": -0.4
        * torch.rand(
            (N, Hv, L, K) if "kda" in given else (N, Hv, L), generator=gen, dtype=torch.float64
        ),
        "beta": torch.rand(N, Hv, L, generator=gen, dtype=torch.float64),
    }
    fixed: dict = {}
    sequences = N
    if "packed" in given:
        fixed["cu_seqlens"] = torch.tensor(CU_SEQLENS, device=device)
        sequences = len(CU_SEQLENS) - 1
    if "initial_state" in given:
        tensors["initial_state"] = rand(sequences, Hv, K, V, scale=0.5)
    if "scale" in given:
        fixed["scale"] = 0.7
    if "l2norm" in given:
        fixed["use_qk_l2norm"] = True
    fixed["output_final_state"] = "final" in given
    tensors = {n: t.to(device, dtype).requires_grad_() for n, t in tensors.items()}
    g_out = rand(N, Hv, L, V).to(device, dtype)
    g_final = rand(sequences, Hv, K, V).to(device)
    return tensors, fixed, g_out, g_final


def run(tensors, fixed, g_out, g_final, math=False):
    """``(out, final_state or None, *gradients)`` of the op (or of its float64 reference)."""
    return run_with_state(cakeops.gated_delta_rule, ref.scan, tensors, fixed, g_out, g_final, math)


def check_against_reference(tensors, fixed, g_out, g_final):
    check_with_state(cakeops.gated_delta_rule, ref.scan, tensors, fixed, g_out, g_final)


class TestGatedDeltaRule(StatefulOpChecks):
    op = OP
    make_inputs, run = staticmethod(make_inputs), staticmethod(run)
    L, CU_SEQLENS, ALONG = L, CU_SEQLENS, ("q", "k", "v", "g", "beta")
    PACKED = ("kda", "initial_state", "final", "l2norm", "packed")
    EVERY_OPTION = OPTION_CASES["together-kda"]
    CONTINUED = ("kda", "l2norm", "final")

    @pytest.mark.parametrize("case", list(OPTION_CASES))
    def test_options_match_the_recurrence(self, cakeops_backend, dtype, cakeops_device, case):
        """Each option alone and together: the output, the final state and every gradient
        against the float64 recurrence."""
        check_against_reference(*make_inputs(OPTION_CASES[case], dtype, cakeops_device))

    @pytest.mark.parametrize("L", [1, 3])
    @pytest.mark.parametrize("kda", [False, True])
    @pytest.mark.parametrize("start", ["initial_state", "zeros"])
    def test_short_sequences(self, cakeops_backend, dtype, cakeops_device, L, kda, start):
        """Decoding's sizes (a backend may run them step by step): every option but packing,
        from a given state and from zeros."""
        given = ("scale", "final", "l2norm") + (("kda",) if kda else ())
        given += ("initial_state",) if start == "initial_state" else ()
        check_against_reference(*make_inputs(given, dtype, cakeops_device, L=L))

    @pytest.mark.cakeops_dtypes(torch.float16, torch.bfloat16)
    def test_float32_gates_and_state_with_16_bit_inputs(
        self, cakeops_backend, dtype, cakeops_device
    ):
        """As the models call it in 16-bit: q, k, v and beta in 16-bit, the log gates and the
        state in float32; every result within the 16-bit tolerance, each gradient in its
        input's dtype."""
        given = ("kda", "initial_state", "final", "l2norm")
        tensors, fixed, g_out, g_final = make_inputs(given, dtype, cakeops_device)
        for name in ("g", "initial_state"):
            tensors[name] = tensors[name].detach().float().requires_grad_()
        got = run(tensors, fixed, g_out, g_final)
        want = run(tensors, fixed, g_out, g_final, math=True)
        assert got[1].dtype == torch.float32
        names = ["out", "final_state", *(f"d{n}" for n in tensors)]
        for name, a, b in zip(names, got, want, strict=True):
            assert_matches(a, b, name, a.dtype)
        for name, t, grad in zip(tensors, tensors.values(), got[2:], strict=True):
            assert grad.dtype == t.dtype, name

    @pytest.mark.cakeops_dtypes(torch.float32, torch.float64)  # 16-bit holds no 1e25
    @pytest.mark.parametrize("L", [3, L])
    @pytest.mark.parametrize("kda", [False, True])
    @pytest.mark.parametrize("large", ["initial_state", "g_final"])
    def test_a_large_state_behind_a_strong_gate(
        self, cakeops_backend, dtype, cakeops_device, L, kda, large
    ):
        """A state far larger than the terms beside it (``1e25`` in float64, ``1e30`` in
        float32: the initial state, or the final state's gradient for the backward's) behind
        gates of ``-66`` (small betas keep it): the factor ``exp(-66)`` leaves it a share the
        size of the terms, so no floor on the factors may drop it (an absolute one at
        ``exp(-64)`` gave errors of 1e-6 in float64 and 12% in float32). At L = 3, a
        step-by-step forward beside a chunked backward; at L, across chunks."""
        given = ("initial_state", "final") + (("kda",) if kda else ())
        tensors, fixed, g_out, g_final = make_inputs(given, dtype, cakeops_device, L=L)
        big = 1e25 if dtype == torch.float64 else 1e30
        with torch.no_grad():
            tensors["g"].mul_(0.25)
            tensors["beta"].mul_(0.01)
            for t in {1, CHUNK_START + 1} & set(range(L)):
                tensors["g"][:, :, t] = -66.0
            if large == "initial_state":
                tensors["initial_state"].mul_(big)
        if large == "g_final":
            g_final = g_final * big
        check_against_reference(tensors, fixed, g_out, g_final)

    def test_wide_heads(self, cakeops_backend, dtype, cakeops_device):
        """Head sizes past 128 (kernels may split K or V): every option, KDA."""
        given = ("kda", "initial_state", "final", "l2norm")
        check_against_reference(
            *make_inputs(given, dtype, cakeops_device, N=1, H=1, L=20, K=136, V=5)
        )

    @pytest.mark.parametrize("beta", [0.0, 1.0])
    def test_beta_zero_and_one(self, cakeops_backend, dtype, cakeops_device, beta):
        """beta 0: nothing is written, the state only decays; beta 1: the key's slot is
        overwritten with v (u = v - S^T k)."""
        tensors, fixed, g_out, g_final = make_inputs(
            ("initial_state", "final"), dtype, cakeops_device
        )
        with torch.no_grad():
            tensors["beta"].fill_(beta)
            tensors["g"].mul_(0.1)  # a final state within 16-bit's normal range
        check_against_reference(tensors, fixed, g_out, g_final)
        if beta == 0.0 and dtype in (torch.float32, torch.float64):  # (16-bit: subnormal)
            _, final = cakeops.gated_delta_rule(**tensors, **fixed)
            decay = tensors["g"].detach().double().sum(-1).exp()[..., None, None]
            want = tensors["initial_state"].detach().double() * decay
            assert_matches(final, want, "final_state", final.dtype)

    def test_hard_reset(self, cakeops_backend, dtype, cakeops_device):
        """A log gate of -inf (or -1e30) cuts the state (a factor of exactly 0): output, final
        state and every gradient finite and equal to the recurrence's; a gate of -1e4 beside
        small ones keeps their accuracy."""
        for given in (("initial_state", "final"), ("kda", "initial_state", "final")):
            tensors, fixed, g_out, g_final = make_inputs(given, dtype, cakeops_device)
            with torch.no_grad():
                g = tensors["g"]
                g[0, 0, CHUNK_START // 2 + 3] = -torch.inf  # mid-chunk
                g[1, 1, CHUNK_START] = -1e30  # at a chunk's start
                g[0, 3, L - 1] = -torch.inf  # the last position
                g[1, 2, 5] = -1e4
            check_against_reference(tensors, fixed, g_out, g_final)

    @pytest.mark.cakeops_not_for(
        "reference", reason="the float64 recurrence is a Python loop: too slow at 65,536 steps"
    )
    def test_strong_gates_over_65536_steps_stay_finite(self, cakeops_backend, cakeops_device):
        L = 64 if EMULATED else 65536
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, L, 16, generator=gen).to(cakeops_device)
        v = torch.randn(1, 2, L, 16, generator=gen).to(cakeops_device)
        g = torch.full((1, 2, L), -30.0, device=cakeops_device)
        g[:, 1] = -1e-3
        beta = torch.ones(1, 2, L, device=cakeops_device)
        leaves = [t.requires_grad_() for t in (q, v, g, beta)]
        out, final = cakeops.gated_delta_rule(leaves[0], leaves[0], leaves[1], leaves[2],
                                              leaves[3], output_final_state=True,
                                              use_qk_l2norm=True)  # fmt: skip
        grads = torch.autograd.grad(out.sum() + final.sum(), leaves)
        for t in (out, final, *grads):
            assert torch.isfinite(t).all()

    def test_strided_views_in_the_models_layout(self, cakeops_backend, cakeops_device):
        """Inputs in Hugging Face's ``(N, L, H, D)`` layout passed as ``transpose(1, 2)`` views
        give the results of contiguous copies."""
        tensors, fixed, g_out, g_final = make_inputs(
            ("final", "l2norm"), torch.float32, cakeops_device
        )
        views = {n: t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
                 for n, t in tensors.items()}  # fmt: skip
        assert not views["q"].is_contiguous()
        for a, b in zip(run(views, fixed, g_out, g_final), run(tensors, fixed, g_out, g_final),
                        strict=True):  # fmt: skip
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    @pytest.mark.parametrize("packed", [False, True])
    def test_opcheck_and_compile(self, cakeops_backend, cakeops_device, packed):
        """The custom op with every option passes torch.library.opcheck (its backward too), and
        torch.compile(fullgraph=True) gives the eager results."""
        given = ("kda", "scale", "initial_state", "final", "l2norm") + (("packed",) if packed
                                                                          else ())  # fmt: skip
        length, heads = (12, 1) if EMULATED else (21, 2)
        tensors, fixed, g_out, g_final = make_inputs(given, torch.float32, cakeops_device, H=heads,
                                                     L=length)  # fmt: skip
        if packed:
            cu = [0, 5, 5, 12, 21] if length == 21 else [0, 3, 3, 7, 12]
            fixed["cu_seqlens"] = torch.tensor(cu, device=cakeops_device)
            tensors["initial_state"] = tensors["initial_state"].detach()[:4].requires_grad_()
            g_final = g_final[:4]
        assert_opcheck_and_compile_with_state(OP, tensors, fixed, g_out, g_final)

    @pytest.mark.cakeops_dtypes(torch.float64)
    @pytest.mark.parametrize("kda", [False, True])
    def test_gradcheck(self, cakeops_backend, dtype, cakeops_device, kda):
        """Float64 gradcheck of the output and the final state in every differentiable input,
        every option given, packed."""
        given = ("initial_state", "final", "l2norm", "scale", "packed") + (("kda",) if kda
                                                                            else ())  # fmt: skip
        tensors, fixed, _, _ = make_inputs(given, dtype, cakeops_device, H=1, G=2, L=13, K=3, V=2)
        fixed["cu_seqlens"] = torch.tensor([0, 4, 4, 9, 13], device=cakeops_device)
        tensors["initial_state"] = tensors["initial_state"].detach()[:4].requires_grad_()
        names = list(tensors)

        def fn(*values):
            return cakeops.gated_delta_rule(**dict(zip(names, values, strict=True)), **fixed)

        # a log gate nudged by gradcheck stays <= 0
        with torch.no_grad():
            tensors["g"].clamp_(max=-0.01)
        assert torch.autograd.gradcheck(fn, tuple(tensors.values()))

    @pytest.mark.parametrize("kda", [False, True])
    @pytest.mark.parametrize("poisoned", ["k", "v", "g_out"])
    def test_non_finite_values_stay_causal(
        self, cakeops_backend, dtype, cakeops_device, poisoned, kda
    ):
        """A NaN makes non-finite exactly the entries of the output and of the gradients that
        the float64 recurrence makes non-finite (the positions it reaches), and leaves every
        other entry as it is without it."""
        tensors, fixed, g_out, g_final = make_inputs(("kda",) if kda else (), dtype, cakeops_device)
        bad = {n: t.detach().clone() for n, t in tensors.items()}
        bad["g_out"] = g_out.clone()
        bad[poisoned][0, 1, L // 2] = float("nan")  # key head 1 (value heads 2, 3)
        g_bad = bad.pop("g_out")
        leaves = {n: t.requires_grad_() for n, t in bad.items()}
        got = run(leaves, fixed, g_bad, g_final)
        want = run(leaves, fixed, g_bad, g_final, math=True)
        fine = run(tensors, fixed, g_out, g_final, math=True)
        names = ["out", "final", *(f"d{n}" for n in tensors)]
        for name, a, w, f in zip(names, got, want, fine, strict=True):
            if a is None:
                continue
            finite = torch.isfinite(w)
            assert torch.equal(torch.isfinite(a).cpu(), finite.cpu()), f"{name}: non-finite differ"
            assert_matches(a.where(finite, 0), f.where(finite, 0), name, a.dtype)

    @pytest.mark.parametrize("bad", ["positive-g", "g-shape", "beta-shape", "heads", "k-shape",
                                     "v-dtype", "scale-nan", "cu-unsorted", "cu-n2",
                                     "initial-shape", "cu-float", "q-3d"])  # fmt: skip
    def test_bad_inputs_raise(self, cakeops_backend, cakeops_device, bad, monkeypatch):
        q = torch.randn(2, 2, 8, 4, device=cakeops_device)
        v = torch.randn(2, 4, 8, 3, device=cakeops_device)
        g = -torch.rand(2, 4, 8, device=cakeops_device)
        beta = torch.rand(2, 4, 8, device=cakeops_device)
        args = {"q": q, "k": q, "v": v, "g": g, "beta": beta}
        cases = {
            "positive-g": ({"g": g.abs() + 0.1}, ValueError, "g"),
            "g-shape": ({"g": g[:, :2]}, ValueError, "g"),
            "beta-shape": ({"beta": beta[..., None]}, ValueError, "beta"),
            "heads": ({"v": v[:, :3]}, ValueError, "v"),
            "k-shape": ({"k": q[:, :, :7]}, ValueError, "k"),
            "v-dtype": ({"v": v.double()}, TypeError, "v"),
            "scale-nan": ({"scale": float("nan")}, ValueError, "scale"),
            "cu-unsorted": ({"cu_seqlens": torch.tensor([0, 5, 3, 8])}, ValueError,
                            "cu_seqlens"),
            "cu-n2": ({"cu_seqlens": torch.tensor([0, 8])}, ValueError, "cu_seqlens"),
            "cu-float": ({"cu_seqlens": torch.tensor([0.0, 8.0])}, TypeError, "cu_seqlens"),
            "initial-shape": ({"initial_state": torch.zeros(2, 2, 4, 3)}, ValueError,
                              "initial_state"),
            "q-3d": ({"q": q[0]}, ValueError, "q"),
        }  # fmt: skip
        kwargs, error, argument = cases[bad]
        if bad in ("cu-unsorted", "cu-float"):
            args = {n: t[:1] for n, t in args.items()}
        kwargs = {n: t.to(cakeops_device) if isinstance(t, torch.Tensor) else t
                  for n, t in kwargs.items()}  # fmt: skip
        call = lambda: cakeops.gated_delta_rule(**{**args, **kwargs})  # noqa: E731
        if bad.startswith("positive") and cakeops_device.type != "cpu":
            # a device's log multipliers are read only when asked (a host synchronisation a
            # call): unchecked, a positive one grows the state and the call runs
            call()
            monkeypatch.setenv(CHECK_VALUES_ENV, "1")
        assert_bad_input_raises(OP, call, error, argument)
