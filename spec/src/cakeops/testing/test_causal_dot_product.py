"""Conformance of ``causal_dot_product`` (docs/content/ops/causal_dot_product.md) for the
backend under test: the checks only this op has (``test_every_op`` has the shared ones)."""

from __future__ import annotations

import pytest
import torch

import cakeops
from cakeops._spec import CHECK_VALUES_ENV, tolerance
from cakeops.reference import causal_dot_product as ref
from cakeops.testing import (
    EMULATED,
    assert_bad_input_raises,
    assert_compiled_matches,
    assert_default_dtype_changes_nothing,
    assert_matches,
    peak_memory,
    reference_outputs,
    run_with_grads,
)

OP = "causal_dot_product"

# name -> (N, H, L, E, M)
CASES = {
    "basic": (2, 3, 37, 8, 8),
    "e-ne-m": (1, 2, 70, 5, 9),
    "l1": (2, 2, 1, 4, 4),
    "e1": (1, 2, 33, 1, 6),
    "m1": (1, 2, 33, 6, 1),
    "l257": (1, 1, 257, 16, 16),
    "l-three-past-a-multiple-of-4": (1, 2, 11, 4, 4),
    "l-multiple-of-64": (1, 2, 128, 8, 8),
}
LONG_L = 8192
#: Which of (out, dq, dk, dv) depend on each input and on the upstream gradient g.
DEPENDS_ON = {
    "q": ("out", "dk", "dv"),
    "k": ("out", "dq", "dv"),
    "v": ("out", "dq", "dk"),
    "g": ("dq", "dk", "dv"),
}
#: The largest chunk the memory bound allows a backend: peak extra memory must stay within
#: a small multiple of N*H*(L*CHUNK_BOUND + E*M) elements beyond the inputs and gradients.
CHUNK_BOUND = 256


def make_inputs(N, H, L, E, M, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(device, dtype)

    # Feature-map-like scales keep the sums over L of comparable size to each term.
    q = rand(N, H, L, E, scale=max(E, 1) ** -0.5).requires_grad_()
    k = rand(N, H, L, E, scale=max(E, 1) ** -0.5).requires_grad_()
    v = rand(N, H, L, M).requires_grad_()
    g = rand(N, H, L, M)
    return q, k, v, g


def check_against_reference(q, k, v, g, got, math=ref.math):
    ref_out, ref_grads = reference_outputs(math, {"q": q, "k": k, "v": v}, (), g)
    out, dq, dk, dv = got
    assert_matches(out, ref_out, "out", q.dtype)
    assert_matches(dq, ref_grads["q"], "dq", q.dtype)
    assert_matches(dk, ref_grads["k"], "dk", k.dtype)
    assert_matches(dv, ref_grads["v"], "dv", v.dtype)


def op(q, k, v):
    return cakeops.causal_dot_product(q, k, v)


class TestCausalDotProduct:
    op = OP

    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_reference(self, cakeops_backend, dtype, cakeops_device, case):
        q, k, v, g = make_inputs(*CASES[case], dtype, cakeops_device)
        check_against_reference(q, k, v, g, run_with_grads(op, (q, k, v), g))

    @pytest.mark.cakeops_dtypes(torch.float32, torch.bfloat16)
    def test_long_sequence_error_stays_within_tolerance(
        self, cakeops_backend, dtype, cakeops_device
    ):
        q, k, v, g = make_inputs(1, 1, LONG_L, 16, 16, dtype, cakeops_device)
        got = run_with_grads(op, (q, k, v), g)
        check_against_reference(q, k, v, g, got)

    @pytest.mark.cakeops_not_for(
        "reference", reason="the float64 reference keeps a state per position"
    )
    def test_long_sequence_memory_is_chunked(self, cakeops_backend, cakeops_device):
        N, H, L, E, M = 1, 1, LONG_L, 16, 16
        q, k, v, g = make_inputs(N, H, L, E, M, torch.float32, cakeops_device)
        peak = peak_memory(lambda: run_with_grads(op, (q, k, v), g), cakeops_device)
        io_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, g))
        bound = 4 * io_bytes + 4 * N * H * (L * CHUNK_BOUND + E * M) * 4
        square = N * H * L * L * 4
        assert square > 4 * bound  # the bound tells an L x L matrix apart
        assert peak <= bound, f"peak {peak / 2**20:.1f} MiB exceeds {bound / 2**20:.1f} MiB"

    @pytest.mark.cakeops_dtypes(torch.float64)
    @pytest.mark.parametrize("shape", [(1, 2, 5, 3, 4), (2, 1, 9, 2, 2)])
    def test_gradcheck(self, cakeops_backend, dtype, cakeops_device, shape):
        q, k, v, _ = make_inputs(*shape, dtype, cakeops_device)
        assert torch.autograd.gradcheck(op, (q, k, v))

    @pytest.mark.parametrize("shape", [(1, 2, 0, 4, 4), (0, 2, 5, 4, 4), (1, 2, 5, 0, 3)])
    def test_empty(self, cakeops_backend, dtype, cakeops_device, shape):
        q, k, v, g = make_inputs(*shape, dtype, cakeops_device)
        out, dq, dk, dv = run_with_grads(op, (q, k, v), g)
        assert out.shape == (*shape[:3], shape[4])
        assert torch.equal(out, torch.zeros_like(out))  # E = 0: every dot product is 0
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert torch.equal(dv, torch.zeros_like(dv))

    def test_transposed_inputs(self, cakeops_backend, dtype, cakeops_device):
        # fast-transformers' layer passes (N, L, H, E) tensors transposed to (N, H, L, E).
        N, L, H, E, M = 2, 45, 3, 6, 5
        gen = torch.Generator().manual_seed(1)

        def nlhe(dim, scale):
            t = torch.randn(N, L, H, dim, generator=gen, dtype=torch.float64) * scale
            return t.to(cakeops_device, dtype).transpose(1, 2).requires_grad_()

        q, k, v = nlhe(E, E**-0.5), nlhe(E, E**-0.5), nlhe(M, 1.0)
        g = torch.randn(N, H, L, M, generator=gen, dtype=torch.float64).to(cakeops_device, dtype)
        assert not q.is_contiguous()
        check_against_reference(q, k, v, g, run_with_grads(op, (q, k, v), g))

    @pytest.mark.parametrize("poisoned", ["q", "k", "v", "g"])
    def test_non_finite_values_reach_only_what_depends_on_them(
        self, cakeops_backend, dtype, cakeops_device, poisoned
    ):
        """The non-finite contract (the op's docs page): a NaN or Inf in an input or in the
        upstream gradient makes non-finite exactly the output and gradient entries the float64
        reference makes non-finite (causal in time, no masked zero times NaN), and every other
        entry is what it is without it. NaN and -Inf sit mid-chunk in different heads."""
        q, k, v, g = make_inputs(1, 2, 40, 4, 4, dtype, cakeops_device)
        clean = dict(q=q, k=k, v=v)
        tensors = {name: t.detach().clone() for name, t in (*clean.items(), ("g", g))}
        tensors[poisoned][0, 1, 21, 1] = float("nan")
        tensors[poisoned][0, 0, 30, 2] = float("-inf")
        g_bad = tensors.pop("g")
        inputs = tuple(t.requires_grad_() for t in tensors.values())
        got = run_with_grads(op, inputs, g_bad)
        ref_out, ref_grads = reference_outputs(ref.math, tensors, (), g_bad)
        clean_out, clean_grads = reference_outputs(ref.math, clean, (), g)
        expected = (ref_out, *ref_grads.values())
        for name, t, want, fine in zip(
            ("out", "dq", "dk", "dv"),
            got,
            expected,
            (clean_out, *clean_grads.values()),
            strict=True,
        ):
            finite = torch.isfinite(want)
            assert finite.all() != (name in DEPENDS_ON[poisoned])  # the poison reached it
            assert torch.equal(torch.isfinite(t), finite), f"{name}: non-finite entries differ"
            assert_matches(t.where(finite, 0), fine.where(finite, 0), name, dtype)


def _bad_inputs(device):
    q = torch.randn(1, 2, 5, 4, device=device)
    v = torch.randn(1, 2, 5, 3, device=device)
    return {
        # name: (args, error type, argument named in the message)
        "q-not-tensor": ((q.tolist(), q, v), TypeError, "q"),
        "q-rank-3": ((q[0], q[0], v[0]), ValueError, "q"),
        "v-rank-5": ((q, q, v[None]), ValueError, "v"),
        "k-length": ((q, q[:, :, :4], v), ValueError, "k"),
        "k-heads": ((q, q[:, :1], v), ValueError, "k"),
        "k-feature": ((q, q[..., :3], v), ValueError, "k"),
        "v-length": ((q, q, v[:, :, :4]), ValueError, "v"),
        "v-batch": ((q, q, torch.cat([v, v])), ValueError, "v"),
        "v-heads-not-a-multiple": ((q, q, torch.cat([v, v[:, :1]], 1)), ValueError, "v"),
        "v-fewer-heads": ((q, q, v[:, :1]), ValueError, "v"),
        "k-dtype": ((q, q.double(), v), TypeError, "k"),
        "v-dtype": ((q, q, v.half()), TypeError, "v"),
        "int-dtype": ((q.long(), q.long(), v.long()), TypeError, "q"),
        "mixed-devices": ((q, q, v.to("meta")), ValueError, "v"),
    }


class TestCausalDotProductBadInput:
    op = OP

    @pytest.mark.parametrize("case", list(_bad_inputs("cpu")))
    def test_bad_input_raises(self, cakeops_backend, cakeops_device, case):
        args, error, argument = _bad_inputs(cakeops_device)[case]
        assert_bad_input_raises(OP, lambda: cakeops.causal_dot_product(*args), error, argument)


# --------------------------------------------------------------------------------------------
# WIP (#27): the options. Backends that do not run them yet are listed here, with the reason.
NOT_YET = {}
#: name -> the options given (``final``: output_final_state with a gradient reaching it)
OPTION_CASES = {
    "scale": ("scale",),
    "decay": ("log_decay",),
    "gates": ("log_gates",),
    "initial": ("initial_state",),
    "final": ("final",),
    "all": ("scale", "log_decay", "log_gates", "initial_state", "final"),
    "packed": ("cu_seqlens", "log_decay", "initial_state", "final"),
}


def _option_inputs(given, dtype, device, N=2, H=2, L=45, E=6, M=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if "cu_seqlens" in given:
        N = 1
    q, k, v, g = make_inputs(N, H, L, E, M, dtype, device, seed)
    cu = torch.tensor([0, 10, 10, 31, L], device=device)
    sequences = cu.numel() - 1 if "cu_seqlens" in given else N
    options = {
        "scale": 0.7,
        "log_decay": -torch.rand(H, generator=gen, dtype=torch.float64) * 0.3,
        "log_gates": -torch.rand(N, H, L, generator=gen, dtype=torch.float64) * 0.3,
        "initial_state": torch.randn(sequences, H, E, M, generator=gen, dtype=torch.float64),
        "cu_seqlens": cu,
    }
    tensors = {n: options[n].to(device, dtype).requires_grad_() for n in
               ("log_decay", "log_gates", "initial_state") if n in given}  # fmt: skip
    fixed = {n: options[n] for n in ("scale", "cu_seqlens") if n in given}
    g_final = torch.randn(sequences, H, E, M, generator=gen, dtype=torch.float64).to(device)
    return (q, k, v), tensors, fixed, g, g_final if "final" in given else None


def log_multiplier_scale(exact, g, g_final=None, fixed=None) -> torch.Tensor:
    """``Gamma_t`` ``(N, H, L)``: the sum of the sizes of the terms whose sum is the gradient of
    the log multiplier at ``t``, ``|exp(lm_{j+1} + ... + lm_i) (q_i . k_j) (g_i . v_j)|`` over
    the pairs ``j < t <= i`` (the initial state a pair before the sequence, the final state's
    gradient one after it), each dot product summed in sizes: that gradient for the absolute
    values of every input but the multipliers, from the float64 leaves ``exact`` (q, k, v and
    the options). What the log multipliers' gradients are accurate relative to (the op's
    page)."""
    q, k, v = (exact[n].detach().abs() for n in "qkv")
    N, H, L = v.shape[:3]
    lm = torch.zeros(N, H, L, dtype=q.dtype, device=q.device)
    if "log_gates" in exact:
        lm = lm + exact["log_gates"].detach()
    if "log_decay" in exact:
        lm = lm + exact["log_decay"].detach()[None, :, None]
    lm.requires_grad_()
    init = exact.get("initial_state")
    fixed = dict(fixed or {})
    if fixed.get("scale") is not None:
        fixed["scale"] = abs(fixed["scale"])
    out, state = ref.scan(q, k, v, log_gates=lm, **fixed,
                          initial_state=None if init is None else init.detach().abs())  # fmt: skip
    loss = (out * g.detach().to(out).abs()).sum()
    if g_final is not None:
        loss = loss + (state * g_final.detach().to(state).abs()).sum()
    (size,) = torch.autograd.grad(loss, [lm])
    return size.cpu()


def assert_log_grads_match(got, want, gamma, dtype, names=("log_decay", "log_gates")) -> None:
    """The log multipliers' gradients within the tolerance relative to ``gamma``
    (:func:`log_multiplier_scale`): each head's ``log_decay`` entry against its ``sum_t
    Gamma_t``, ``log_gates`` normwise against ``Gamma``; plus, per entry, the dtype's smallest
    subnormal, the rounding of a gradient too small for it (float16 holds no ``exp(-30)``)."""
    tol = tolerance(dtype)
    info = torch.finfo(dtype)
    floor = info.smallest_normal * info.eps
    for name, a, b in zip(names, got, want, strict=True):
        err = a.detach().double().cpu() - b.detach().cpu()
        assert torch.isfinite(a).all(), f"d{name}: not finite"
        if name == "log_decay":
            bound = tol * gamma.sum((0, 2)) + floor
            assert (err.abs() <= bound).all(), f"d{name}: errors {err} beyond {bound}"
        else:
            bound = tol * gamma.norm() + floor * err.numel() ** 0.5
            assert err.norm() <= bound, f"d{name}: error {err.norm():.3g} beyond {bound:.3g}"


def check_against_scan(qkv, tensors, fixed, g, g_final, plain_logs=False):
    """Output, final state (with ``g_final``) and every gradient against the float64 scan,
    within the spec's tolerance: the log multipliers' gradients relative to their scale
    (:func:`log_multiplier_scale`), or relative to themselves with ``plain_logs``."""
    leaves = {"q": qkv[0], "k": qkv[1], "v": qkv[2], **tensors}
    final = g_final is not None
    dtype = qkv[0].dtype
    result = cakeops.causal_dot_product(*qkv, **tensors, **fixed, output_final_state=final)
    out, state = result if final else (result, None)
    loss = (out.double() * g.double()).sum()
    if final:
        loss = loss + (state.double() * g_final.double()).sum()
    got = torch.autograd.grad(loss, list(leaves.values()))
    exact = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    ref_out, ref_state = ref.scan(*(exact[n] for n in "qkv"), **{
        n: exact[n] for n in tensors}, **fixed)  # fmt: skip
    ref_loss = (ref_out * g.double()).sum()
    if final:
        ref_loss = ref_loss + (ref_state * g_final.double()).sum()
    want = torch.autograd.grad(ref_loss, list(exact.values()))
    assert_matches(out, ref_out, "out", dtype)
    if final:
        assert_matches(state, ref_state, "final_state", state.dtype)
    logs = [] if plain_logs else [n for n in leaves if n.startswith("log_")]
    for name, a, b in zip(leaves, got, want, strict=True):
        if name not in logs:
            assert_matches(a, b, f"d{name}", leaves[name].dtype)
    if not logs:
        return
    gamma = log_multiplier_scale(exact, g, g_final, fixed)
    index = [list(leaves).index(n) for n in logs]
    assert_log_grads_match([got[i] for i in index], [want[i] for i in index], gamma, dtype,
                           logs)  # fmt: skip


def assert_gradcheck(qkv, tensors, fixed) -> None:
    """Float64 gradcheck of the output and the final state in q, k, v and the tensor options
    ``tensors`` (``fixed``: the others)."""
    names = ["q", "k", "v", *tensors]

    def fn(*values):
        given = dict(zip(names, values, strict=True))
        q, k, v = given.pop("q"), given.pop("k"), given.pop("v")
        return cakeops.causal_dot_product(q, k, v, **given, **fixed, output_final_state=True)

    assert torch.autograd.gradcheck(fn, (*qkv, *tensors.values()))


class TestCausalOptions:
    op = OP

    @pytest.mark.parametrize("case", list(OPTION_CASES))
    def test_options_match_the_scan(self, cakeops_backend, dtype, cakeops_device, case):
        """Each option alone and together: the output, the final state and every gradient
        against the float64 scan (``S_t = exp(log_decay + log_gates_t) S_{t-1} + k_t v_t^T``)."""
        if cakeops_backend in NOT_YET:
            pytest.xfail(NOT_YET[cakeops_backend])
        (q, k, v), tensors, fixed, g, g_final = _option_inputs(
            OPTION_CASES[case], dtype, cakeops_device
        )
        # at these sizes the log multipliers' gradients meet the plain tolerance too
        check_against_scan((q, k, v), tensors, fixed, g, g_final, plain_logs=True)

    @pytest.mark.parametrize("case", [c for c in OPTION_CASES if c != "packed"])
    def test_a_decode_step(self, cakeops_backend, dtype, cakeops_device, case):
        """One position, each option alone and together (a decode step, which a kernel may
        run apart from its chunked form): against the float64 scan."""
        if cakeops_backend in NOT_YET:
            pytest.xfail(NOT_YET[cakeops_backend])
        given = OPTION_CASES[case]
        (q, k, v), tensors, fixed, g, g_final = _option_inputs(given, dtype, cakeops_device, L=1)
        check_against_scan((q, k, v), tensors, fixed, g, g_final, plain_logs=True)

    @pytest.mark.parametrize("case, L", [("all", 45), ("packed", 45), ("initial", 45), ("all", 1)])
    def test_default_dtype_changes_nothing(self, cakeops_backend, cakeops_device, case, L):
        """Every option, a prefill and a decode step: PyTorch's default dtype (bfloat16 in many
        inference scripts) reaches no kernel."""
        qkv, tensors, fixed, g, g_final = _option_inputs(OPTION_CASES[case], torch.float32,
                                                         cakeops_device, L=L)  # fmt: skip
        leaves = [*qkv, *tensors.values()]

        def run():
            out, final = cakeops.causal_dot_product(*qkv, **tensors, **fixed,
                                                    output_final_state=True)  # fmt: skip
            g_state = torch.ones_like(final) if g_final is None else g_final.float()
            grads = torch.autograd.grad((out, final), leaves, (g, g_state))
            return out.detach(), final.detach(), *grads

        assert_default_dtype_changes_nothing(run)

    def test_no_positions_hand_the_initial_state_on(self, cakeops_backend, dtype, cakeops_device):
        """L = 0: the final states are the initial ones, and their gradient reaches them."""
        q, k, v = (torch.zeros(1, 2, 0, d, device=cakeops_device, dtype=dtype) for d in (3, 3, 4))
        s0 = torch.randn(3, 2, 3, 4, device=cakeops_device, dtype=dtype, requires_grad=True)
        decay = torch.tensor([-0.1, -0.2], device=cakeops_device, dtype=dtype, requires_grad=True)
        out, final = cakeops.causal_dot_product(
            q, k, v, log_decay=decay, initial_state=s0, output_final_state=True,
            cu_seqlens=torch.tensor([0, 0, 0, 0], device=cakeops_device))  # fmt: skip
        assert out.shape == (1, 2, 0, 4)
        torch.testing.assert_close(final, s0.detach(), rtol=0, atol=0)
        g_final = torch.randn_like(final)
        d_init, d_decay = torch.autograd.grad(final, (s0, decay), g_final)
        torch.testing.assert_close(d_init, g_final, rtol=0, atol=0)
        assert not d_decay.any()

    def test_wide_heads(self, cakeops_backend, dtype, cakeops_device):
        """Heads wider than 128 features with every option (kernels may split E, as Triton's
        float32 runs do): output, final state and every gradient against the scan."""
        given = ("log_decay", "log_gates", "initial_state", "final")
        (q, k, v), tensors, _, g, g_final = _option_inputs(given, dtype, cakeops_device, N=1, H=2,
                                                               L=20, E=136, M=4)  # fmt: skip
        leaves = {"q": q, "k": k, "v": v, **tensors}
        out, state = cakeops.causal_dot_product(q, k, v, **tensors, output_final_state=True)
        loss = (out.double() * g.double()).sum() + (state.double() * g_final).sum()
        got = torch.autograd.grad(loss, list(leaves.values()))
        exact = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
        ref_out, ref_state = ref.scan(exact["q"], exact["k"], exact["v"], **{
            n: exact[n] for n in tensors})  # fmt: skip
        ref_loss = (ref_out * g.double()).sum() + (ref_state * g_final).sum()
        want = torch.autograd.grad(ref_loss, list(exact.values()))
        assert_matches(out, ref_out, "out", dtype)
        assert_matches(state, ref_state, "final_state", state.dtype)
        for name, a, b in zip(leaves, got, want, strict=True):
            assert_matches(a, b, f"d{name}", leaves[name].dtype)

    @pytest.mark.parametrize("packed", [False, True])
    def test_opcheck_and_compile(self, cakeops_backend, cakeops_device, packed):
        """The custom op with every option (and its backward, a final state's gradient
        included) passes torch.library.opcheck, and torch.compile(fullgraph=True) gives the
        eager results."""
        given = ("scale", "log_decay", "log_gates", "initial_state", "final")
        given += ("cu_seqlens",) if packed else ()
        (q, k, v), tensors, fixed, g, g_final = _option_inputs(given, torch.float32, cakeops_device,
                                                               L=21)  # fmt: skip
        if packed:
            fixed["cu_seqlens"] = torch.tensor([0, 5, 5, 12, 21], device=cakeops_device)
        kwargs = {**tensors, **fixed, "output_final_state": True}
        from cakeops.ops import SPECS

        spec = SPECS[OP]
        values = spec.inputs(q, k, v, **kwargs).values()
        torch.library.opcheck(torch.ops.cakeops.causal_dot_product.default, tuple(values))
        plain = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in values)
        backward = torch.ops.cakeops.causal_dot_product_backward.default
        torch.library.opcheck(backward, (g, g_final.float(), *plain))

        def run(fn):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, *tensors.values())]
            names = list(tensors)

            def call(q, k, v, *rest):
                return fn(q, k, v, **dict(zip(names, rest, strict=True)), **fixed,
                          output_final_state=True)  # fmt: skip

            out, state = call(*leaves)
            loss = (out * g).sum() + (state * g_final.float()).sum()
            return (out, state, *torch.autograd.grad(loss, leaves))

        torch._dynamo.reset()
        eager = run(cakeops.causal_dot_product)
        compiled = run(torch.compile(cakeops.causal_dot_product, fullgraph=True))
        assert_compiled_matches(eager, compiled)

    @pytest.mark.cakeops_dtypes(torch.float64)
    @pytest.mark.parametrize("packed", [False, True])
    def test_gradcheck(self, cakeops_backend, dtype, cakeops_device, packed):
        """Float64 gradcheck of the output and the final state in every differentiable input."""
        if cakeops_backend in NOT_YET:
            pytest.xfail(NOT_YET[cakeops_backend])
        given = ("log_decay", "log_gates", "initial_state", "scale")
        if packed:
            given += ("cu_seqlens",)
        (q, k, v), tensors, fixed, _, _ = _option_inputs(
            given, dtype, cakeops_device, N=2, H=2, L=13, E=3, M=2
        )
        if packed:
            fixed["cu_seqlens"] = torch.tensor([0, 4, 4, 9, 13], device=cakeops_device)
            tensors["initial_state"] = tensors["initial_state"].detach()[:4].requires_grad_()
        # a log multiplier nudged by gradcheck stays <= 0
        assert_gradcheck((q, k, v), tensors, fixed)

    @pytest.mark.parametrize("poisoned", ["q", "k", "v", "g"])
    def test_non_finite_values_stay_causal_with_decay(
        self, cakeops_backend, dtype, cakeops_device, poisoned
    ):
        """The non-finite contract with log multipliers: a NaN or Inf makes non-finite exactly
        the entries of out, dq, dk, dv that the float64 scan makes non-finite, and leaves every
        other entry as it is without it."""
        if cakeops_backend in NOT_YET:
            pytest.xfail(NOT_YET[cakeops_backend])
        q, k, v, g = make_inputs(1, 2, 40, 4, 4, dtype, cakeops_device)
        log_decay = torch.tensor([-0.05, -0.3], device=cakeops_device, dtype=dtype)
        tensors = {name: t.detach().clone() for name, t in (("q", q), ("k", k), ("v", v),
                                                             ("g", g))}  # fmt: skip
        tensors[poisoned][0, 1, 21, 1] = float("nan")
        tensors[poisoned][0, 0, 30, 2] = float("-inf")
        g_bad = tensors.pop("g")

        def run(inputs, upstream, math=False):
            leaves = [t.detach().clone().double() if math else t.detach().clone() for t in inputs]
            leaves = [t.requires_grad_() for t in leaves]
            if math:
                out, _ = ref.scan(*leaves, log_decay=log_decay.double())
            else:
                out = cakeops.causal_dot_product(*leaves, log_decay=log_decay)
            grads = torch.autograd.grad(out, leaves, upstream.to(out.dtype))
            return (out.detach(), *grads)

        got = run(tensors.values(), g_bad)
        want = run(tensors.values(), g_bad, math=True)
        fine = run((q, k, v), g, math=True)
        for name, t, w, f in zip(("out", "dq", "dk", "dv"), got, want, fine, strict=True):
            finite = torch.isfinite(w)
            assert finite.all() != (name in DEPENDS_ON[poisoned])  # the poison reached it
            assert torch.equal(torch.isfinite(t), finite), f"{name}: non-finite entries differ"
            assert_matches(t.where(finite, 0), f.where(finite, 0), name, dtype)

    @pytest.mark.cakeops_not_for(
        "reference", reason="the float64 scan is a Python loop: too slow at 65,536 steps"
    )
    def test_strong_decay_over_65536_steps_stays_finite(self, cakeops_backend, cakeops_device):
        if cakeops_backend in NOT_YET:
            pytest.xfail(NOT_YET[cakeops_backend])
        # the emulators (Triton's interpreter, numba's simulator) run 4,096 steps: 256 chunks,
        # far past the first underflow of exp(-30)
        L = 4096 if EMULATED else 65536
        q = torch.randn(1, 2, L, 8, device=cakeops_device)
        out, state = cakeops.causal_dot_product(
            q, q, q, log_decay=torch.tensor([-30.0, -1e-3], device=cakeops_device),
            output_final_state=True,
        )  # fmt: skip
        assert torch.isfinite(out).all() and torch.isfinite(state).all()

    @pytest.mark.parametrize("reset", ["gates-inf", "decay-inf", "gates-1e30"])
    def test_hard_reset(self, cakeops_backend, dtype, cakeops_device, reset):
        """A log multiplier of -inf (or -1e30) cuts the state: a multiplier of exactly 0.
        Output, final state and every gradient finite and equal to the scan's (they were NaN)."""
        given = ("log_decay", "log_gates", "initial_state", "final")
        (q, k, v), tensors, _, g, g_final = _option_inputs(given, dtype, cakeops_device, L=45)
        with torch.no_grad():
            if reset == "decay-inf":
                tensors["log_decay"][1] = -torch.inf
            else:  # mid-chunk, at a chunk's start, at the last position
                cut = -torch.inf if reset == "gates-inf" else -1e30
                tensors["log_gates"][0, 0, 20] = cut
                tensors["log_gates"][1, 1, 16] = cut
                tensors["log_gates"][1, 0, 44] = cut
        check_against_scan((q, k, v), tensors, {}, g, g_final)

    def test_a_large_gate_keeps_the_small_ones(self, cakeops_backend, dtype, cakeops_device):
        """One gate of -1e4 among small ones: the factors across the small ones keep their
        accuracy (a chunk's running sum of the gates lost them: errors of 4e-4 in float32)."""
        given = ("log_gates", "initial_state", "final")
        (q, k, v), tensors, _, g, g_final = _option_inputs(given, dtype, cakeops_device, L=45)
        with torch.no_grad():
            tensors["log_gates"].mul_(0.01)
            tensors["log_gates"][:, :, 5] = -1e4
            tensors["log_gates"][0, 1, 33] = -1e4
        check_against_scan((q, k, v), tensors, {}, g, g_final)

    @pytest.mark.cakeops_dtypes(torch.float32, torch.float64)  # 16-bit holds no 1e25
    @pytest.mark.parametrize("L", [3, 45])
    @pytest.mark.parametrize("large", ["initial_state", "g_final"])
    def test_a_large_state_behind_a_strong_gate(
        self, cakeops_backend, dtype, cakeops_device, L, large
    ):
        """A state far larger than the terms beside it (``1e25`` in float64, ``1e30`` in
        float32: the initial state, or the final state's gradient for the backward's) behind
        gates of ``-66``: the factor ``exp(-66)`` leaves it a share the size of the terms, so
        no floor on the factors may drop it (an absolute one at ``exp(-64)`` gave errors of
        3e-4 in float64 and 100% in float32). At L = 3, a step-by-step forward beside a
        chunked backward; at 45, across chunks."""
        given = ("log_gates", "initial_state", "final")
        (q, k, v), tensors, _, g, g_final = _option_inputs(given, dtype, cakeops_device, L=L)
        big = 1e25 if dtype == torch.float64 else 1e30
        with torch.no_grad():
            tensors["log_gates"].mul_(0.1)
            tensors["log_gates"][:, :, 1] = -66.0
            if L > 16:
                tensors["log_gates"][:, :, 17] = -66.0
            if large == "initial_state":
                tensors["initial_state"].mul_(big)
        if large == "g_final":
            g_final = g_final * big
        check_against_scan((q, k, v), tensors, {}, g, g_final)

    @pytest.mark.cakeops_dtypes(torch.float32, torch.float64)  # the decay's gradient: ~1e8
    @pytest.mark.cakeops_not_for(
        "reference", reason="the float64 reference is the scan it is compared with (a Python loop)"
    )
    def test_weak_decay_over_a_long_sequence(self, cakeops_backend, dtype, cakeops_device):
        """A factor just below 1 over thousands of steps (exp(-1e-4), 4,096 of them; 1,024
        under the emulators) with positive inputs, whose sums do not cancel: a float32 factor
        rounded the same way at every step compounded to 3e-5 (numba's CPU kernel)."""
        L = 1024 if EMULATED else 4096
        gen = torch.Generator().manual_seed(0)
        q, k = (torch.rand(1, 2, L, 8, generator=gen, dtype=torch.float64) / 8 for _ in "qk")
        v, g = (torch.rand(1, 2, L, 8, generator=gen, dtype=torch.float64) for _ in "vg")
        tensors = {"log_decay": torch.full((2,), -1e-4, dtype=torch.float64),
                   "log_gates": torch.zeros(1, 2, L, dtype=torch.float64)}  # fmt: skip
        leaves = [t.to(cakeops_device, dtype).requires_grad_() for t in (q, k, v)]
        tensors = {n: t.to(cakeops_device, dtype).requires_grad_() for n, t in tensors.items()}
        check_against_scan(leaves, tensors, {}, g.to(cakeops_device, dtype), None)

    def test_scale_is_applied_before_rounding(self, cakeops_backend, dtype, cakeops_device):
        """16-bit outputs hold the scaled value: an unscaled product beyond float16's range
        (65504) with a scaled one of about 1600 is finite and within the tolerance."""
        gen = torch.Generator().manual_seed(0)
        q, k = (torch.randn(1, 2, 40, 8, generator=gen, dtype=torch.float64) * 40 for _ in "qk")
        v = torch.randn(1, 2, 40, 8, generator=gen, dtype=torch.float64)
        q, k, v = (t.to(cakeops_device, dtype) for t in (q, k, v))
        ref_out, _ = ref.scan(q, k, v, scale=1 / 64)
        assert ref_out.abs().max() * 64 > 65504  # unscaled, float16 would overflow
        for options in ({}, {"log_decay": torch.zeros(2, device=cakeops_device, dtype=dtype)}):
            out = cakeops.causal_dot_product(q, k, v, scale=1 / 64, **options)
            assert_matches(out, ref_out, "out", dtype)

    @pytest.mark.parametrize("decay", [-10.0, -30.0])
    def test_log_multiplier_gradient_accuracy(self, cakeops_backend, dtype, cakeops_device, decay):
        """The stated accuracy of the log multipliers' gradients (the op's page): within the
        tolerance relative to ``Gamma_t = sum_{i >= t} (|q_i . dq_i| + |k_i . dk_i|)``, the
        size of the terms whose difference they are, not relative to the gradient itself,
        which a strong decay makes many times smaller (exp(-10) per step)."""
        given = ("log_decay", "log_gates")
        (q, k, v), tensors, _, g, _ = _option_inputs(given, dtype, cakeops_device, N=1, L=256, E=8,
                                                     M=8)  # fmt: skip
        with torch.no_grad():
            tensors["log_decay"].fill_(decay)
        leaves = {"q": q, "k": k, "v": v, **tensors}
        out = cakeops.causal_dot_product(q, k, v, **tensors)
        got = torch.autograd.grad((out.double() * g.double()).sum(), list(leaves.values()))
        exact = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
        ref_out, _ = ref.scan(exact["q"], exact["k"], exact["v"], log_decay=exact["log_decay"],
                              log_gates=exact["log_gates"])  # fmt: skip
        want = torch.autograd.grad((ref_out * g.double()).sum(), list(exact.values()))
        assert_matches(out, ref_out, "out", dtype)
        for name, a, b in zip("qkv", got, want, strict=False):
            assert_matches(a, b, f"d{name}", dtype)
        assert_log_grads_match(got[3:], want[3:], log_multiplier_scale(exact, g), dtype)

    def test_strongly_decaying_gates_in_packed_sequences(
        self, cakeops_backend, dtype, cakeops_device
    ):
        """Mamba2's scan (``dt A`` down to -16): a gate of exp(-12) to exp(-6) at every step,
        packed sequences with initial and final states: the log gates' gradients within the
        tolerance relative to the sizes of their own terms (summed as ``q.dq - k.dk``
        backwards over the row, each position's own term and every later one cancelled: 20
        times that)."""
        given = ("cu_seqlens", "log_gates", "initial_state", "final")
        (q, k, v), tensors, fixed, g, g_final = _option_inputs(given, dtype, cakeops_device, L=150,
                                                               E=8, M=8)  # fmt: skip
        fixed["cu_seqlens"] = torch.tensor([0, 70, 70, 83, 150], device=cakeops_device)
        with torch.no_grad():
            tensors["log_gates"].uniform_(-12.0, -6.0)
        check_against_scan((q, k, v), tensors, fixed, g, g_final)

    def test_strided_cu_seqlens(self, cakeops_backend, cakeops_device):
        """``cu_seqlens`` as a strided view (every other element of a buffer) gives the results
        of its contiguous copy (Triton read it as contiguous: out of bounds)."""
        given = ("cu_seqlens", "log_decay", "initial_state", "final")
        (q, k, v), tensors, fixed, g, g_final = _option_inputs(given, torch.float32, cakeops_device)
        buffer = torch.stack([fixed["cu_seqlens"], torch.full_like(fixed["cu_seqlens"], 999)], 1)
        strided = buffer.reshape(-1)[::2]
        assert not strided.is_contiguous() and torch.equal(strided, fixed["cu_seqlens"])
        results = []
        for cu in (fixed["cu_seqlens"], strided):
            out, state = cakeops.causal_dot_product(q, k, v, **tensors, cu_seqlens=cu,
                                                    output_final_state=True)  # fmt: skip
            loss = (out * g).sum() + (state * g_final.float()).sum()
            results.append((out, state, *torch.autograd.grad(loss, [q, k, v, *tensors.values()])))
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

    @pytest.mark.parametrize("bad", ["positive-decay", "positive-gates", "gates-shape",
                                     "decay-int", "scale-nan", "cu-unsorted", "cu-past-end",
                                     "cu-n2", "initial-shape", "cu-float"])  # fmt: skip
    def test_bad_options_raise(self, cakeops_backend, cakeops_device, bad, monkeypatch):
        q = torch.randn(2, 2, 8, 4, device=cakeops_device)
        cases = {
            "positive-decay": ({"log_decay": torch.tensor([0.1, -0.1])}, ValueError, "log_decay"),
            "positive-gates": ({"log_gates": torch.full((2, 2, 8), 0.5)}, ValueError,
                               "log_gates"),
            "gates-shape": ({"log_gates": -torch.ones(2, 2, 7)}, ValueError, "log_gates"),
            "decay-int": ({"log_decay": torch.tensor([0, -1])}, TypeError, "log_decay"),
            "scale-nan": ({"scale": float("nan")}, ValueError, "scale"),
            "cu-past-end": ({"cu_seqlens": torch.tensor([0, 4, 9])}, ValueError, "cu_seqlens"),
            "cu-unsorted": ({"cu_seqlens": torch.tensor([0, 5, 3, 8])}, ValueError, "cu_seqlens"),
            "cu-n2": ({"cu_seqlens": torch.tensor([0, 8])}, ValueError, "cu_seqlens"),
            "initial-shape": ({"initial_state": torch.zeros(1, 2, 4, 4)}, ValueError,
                              "initial_state"),
            "cu-float": ({"cu_seqlens": torch.tensor([0.0, 8.0])}, TypeError, "cu_seqlens"),
        }  # fmt: skip
        kwargs, error, argument = cases[bad]
        x = q[:1] if bad.startswith("cu-") and bad != "cu-n2" else q
        kwargs = {n: t.to(cakeops_device) if isinstance(t, torch.Tensor) else t
                  for n, t in kwargs.items()}  # fmt: skip
        call = lambda: cakeops.causal_dot_product(x, x, x, **kwargs)  # noqa: E731
        if bad.startswith("positive") and cakeops_device.type != "cpu":
            # a device's log multipliers are read only when asked (a host synchronisation a
            # call): unchecked, a positive one grows the state and the call runs
            call()
            monkeypatch.setenv(CHECK_VALUES_ENV, "1")
        assert_bad_input_raises(OP, call, error, argument)


# --------------------------------------------------------------------------------------------
# Key heads shared by groups of value heads: q and k of Hk heads, v of H = G Hk (value head h
# reads key head h // G), as Mamba2's B and C are shared by head groups.
GROUP_CASES = {"plain": (), "gates": ("log_gates",), "all": OPTION_CASES["all"],
               "packed": OPTION_CASES["packed"]}  # fmt: skip


def _grouped_inputs(given, dtype, device, key_heads, group=3, **shape):
    """:func:`_option_inputs` with ``key_heads`` heads of q and k for ``key_heads * group``
    value heads."""
    (q, k, v), tensors, fixed, g, g_final = _option_inputs(
        given, dtype, device, H=key_heads * group, **shape
    )
    q, k = (t.detach()[:, :key_heads].clone().requires_grad_() for t in (q, k))
    return (q, k, v), tensors, fixed, g, g_final


class TestKeyHeadGroups:
    op = OP

    @pytest.mark.parametrize("key_heads", [1, 2])
    @pytest.mark.parametrize("case", list(GROUP_CASES))
    def test_value_heads_share_key_heads(
        self, cakeops_backend, dtype, cakeops_device, case, key_heads
    ):
        """Without options and with each kind of option: the output, the final state and every
        gradient (each key head's the sum over its group) against the float64 scan."""
        qkv, tensors, fixed, g, g_final = _grouped_inputs(GROUP_CASES[case], dtype, cakeops_device,
                                                          key_heads)  # fmt: skip
        check_against_scan(qkv, tensors, fixed, g, g_final, plain_logs=True)

    @pytest.mark.parametrize("key_heads", [1, 2])
    def test_a_decode_step(self, cakeops_backend, dtype, cakeops_device, key_heads):
        """One position with every option but packing, from key heads shared by groups."""
        qkv, tensors, fixed, g, g_final = _grouped_inputs(
            OPTION_CASES["all"], dtype, cakeops_device, key_heads, L=1
        )
        check_against_scan(qkv, tensors, fixed, g, g_final, plain_logs=True)

    def test_many_value_heads_per_key_head(self, cakeops_backend, dtype, cakeops_device):
        """One key head for 16 value heads (Mamba2's one group), packed: more value heads than
        a backend may give each task."""
        qkv, tensors, fixed, g, g_final = _grouped_inputs(
            OPTION_CASES["packed"], dtype, cakeops_device, 1, group=16, L=45, E=4, M=3
        )
        check_against_scan(qkv, tensors, fixed, g, g_final, plain_logs=True)

    @pytest.mark.cakeops_dtypes(torch.float64)
    def test_gradcheck(self, cakeops_backend, dtype, cakeops_device):
        """Float64 gradcheck of the output and the final state, two key heads for four value
        heads, packed, every option."""
        given = ("log_decay", "log_gates", "initial_state", "scale", "cu_seqlens")
        (q, k, v), tensors, fixed, _, _ = _grouped_inputs(given, dtype, cakeops_device, 2, group=2,
                                                          L=13, E=3, M=2)  # fmt: skip
        fixed["cu_seqlens"] = torch.tensor([0, 4, 4, 9, 13], device=cakeops_device)
        assert_gradcheck((q, k, v), tensors, fixed)

    def test_opcheck(self, cakeops_backend, cakeops_device):
        """The custom op and its backward pass torch.library.opcheck with shared key heads."""
        (q, k, v), tensors, fixed, g, g_final = _grouped_inputs(OPTION_CASES["all"],
                                                                torch.float32, cakeops_device, 2,
                                                                L=21)  # fmt: skip
        from cakeops.ops import SPECS

        kwargs = {**tensors, **fixed, "output_final_state": True}
        values = SPECS[OP].inputs(q, k, v, **kwargs).values()
        torch.library.opcheck(torch.ops.cakeops.causal_dot_product.default, tuple(values))
        plain = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in values)
        backward = torch.ops.cakeops.causal_dot_product_backward.default
        torch.library.opcheck(backward, (g, g_final.float(), *plain))
