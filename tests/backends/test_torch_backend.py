"""The torch backend's own paths that the conformance suite's small shapes do not all reach.

The CPU rmsnorm kernels and the moe_experts SwiGLU backward switch to one inductor-compiled loop
from ``COMPILE_MIN_ELEMENTS``; these tests lower that threshold so the compiled paths run on small
inputs, check them against the float64 reference, and check that they can be turned off and
survive a failing compiler. The moe_experts kernels use grouped matmuls where
``torch._grouped_mm`` takes the operands; these tests pin down which inputs take which path, and
the grouped one with empty experts and split runs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._inductor.exc
from torch.utils._python_dispatch import TorchDispatchMode

import cakeops
from cakeops.testing import run_with_grads
from cakeops.testing import test_moe_experts as moe_suite
from cakeops.testing.test_rmsnorm_silu_gate import check_against_reference, make_inputs, run
from cakeops_torch import _compile as compile_
from cakeops_torch import moe_experts as moe_kernel
from cakeops_torch import rmsnorm_silu_gate as kernels
from cakeops_torch import routed_experts as moe_kernels  # the experts of moe_experts


@pytest.fixture
def compiled_path(monkeypatch):
    """Every input takes the compiled paths; yields the list of compiled functions that ran."""
    monkeypatch.setattr(kernels, "COMPILE_MIN_ELEMENTS", 0)
    monkeypatch.setattr(moe_kernels, "COMPILE_MIN_ELEMENTS", 0)
    monkeypatch.setattr(compile_, "_compile_error", None)
    monkeypatch.delenv(compile_.COMPILE_ENV, raising=False)
    ran = []
    run_compiled = compile_.run_compiled

    def counting(op, fn, *args):
        result = run_compiled(op, fn, *args)
        if result is not compile_.FAILED:
            ran.append(fn.__name__)
        return result

    for module in (kernels, moe_kernels):
        monkeypatch.setattr(module, "run_compiled", counting)
    with cakeops.use_backend("torch"):
        yield ran


@pytest.fixture
def broken_compiler(monkeypatch):
    """Compiling fails as it does without a C++ compiler."""

    def broken(fn):
        def call(*args):
            raise torch._inductor.exc.CppCompileError(["c++", "kernel.cpp"], "no C++ compiler")

        return call

    monkeypatch.setattr(compile_, "_compiled", broken)


# (shape, group_size, norm_before_gate): grouped both ways, one feature per group (the exact
# form of its gradient), whole rows with several row blocks (the last one shorter).
CASES = {
    "grouped": ((6, 48), 16, True),
    "grouped-gate-first": ((2, 3, 48), 16, False),
    "d1": ((9, 1), None, True),
    "blocks": ((2 * 16 + 5, 64), None, False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_path_matches_reference(compiled_path, monkeypatch, dtype, case):
    shape, group_size, nbg = CASES[case]
    blocks = 1
    if case == "blocks":
        monkeypatch.setattr(kernels, "COMPILED_BLOCK_ELEMENTS", 16 * 64)
        monkeypatch.setattr(kernels, "COMPILED_BACKWARD_BLOCK_ELEMENTS", 16 * 64)
        blocks = 3
    x, z, w, g = make_inputs(shape, dtype, "cpu")
    got = run(x, z, w, g, group_size, nbg)
    assert compiled_path == ["_fused_forward"] * blocks + ["_fused_backward"] * blocks
    check_against_reference(x, z, w, g, group_size, nbg, got)
    again = run(x, z, w, g, group_size, nbg)
    for a, b in zip(got, again, strict=True):
        assert torch.equal(a, b)


def test_compiled_path_takes_float32_master_weight(compiled_path):
    x, z, w, g = make_inputs((5, 64), torch.bfloat16, "cpu", weight_dtype=torch.float32)
    got = run(x, z, w, g, 32, True)
    assert compiled_path and got[3].dtype == torch.float32
    check_against_reference(x, z, w, g, 32, True, got)


def test_compiled_path_inside_torch_compile(compiled_path):
    x, z, w, g = make_inputs((8, 64), torch.float32, "cpu")

    def f(x, z, w):
        return cakeops.rmsnorm_silu_gate(x, z, w, group_size=16, norm_before_gate=False)

    got = torch.compile(f, fullgraph=True)(x, z, w)
    assert compiled_path == ["_fused_forward"]
    expected = f(x, z, w)
    assert torch.equal(got, expected)
    grads = torch.autograd.grad(got, (x, z, w), g)
    check_against_reference(x, z, w, g, 16, False, (got.detach(), *grads))


def test_env_var_turns_compiling_off(compiled_path, monkeypatch):
    monkeypatch.setenv(compile_.COMPILE_ENV, "0")
    x, z, w, g = make_inputs((4, 32), torch.float32, "cpu")
    check_against_reference(x, z, w, g, None, True, run(x, z, w, g))
    assert compiled_path == []


@pytest.mark.parametrize("value, compiled", [("1", True), ("", True), (" 0 ", False),
                                             ("false", None), ("off", None)])  # fmt: skip
def test_env_var_is_0_or_1(compiled_path, monkeypatch, value, compiled):
    """``CAKEOPS_TORCH_COMPILE`` is 0 or 1 (empty: the default): another value is a clear error
    (``false`` and ``off`` read as on, silently)."""
    monkeypatch.setenv(compile_.COMPILE_ENV, value)
    x, z, w, g = make_inputs((4, 32), torch.float32, "cpu")
    if compiled is None:
        with pytest.raises(
            ValueError, match=f"CAKEOPS_TORCH_COMPILE expected 0 or 1, got '{value}'"
        ):
            run(x, z, w, g)
        return
    check_against_reference(x, z, w, g, None, True, run(x, z, w, g))
    assert bool(compiled_path) == compiled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size, norm_before_gate", [(None, True), (8, False), (1, True)])
def test_blocked_eager_kernels_beyond_one_block(monkeypatch, dtype, group_size, norm_before_gate):
    """Inputs larger than one block (as on a GPU, or with compiling off) take the blocked
    forward and backward; a block or less the short ones: both against float64, and the same
    values."""
    monkeypatch.setenv(compile_.COMPILE_ENV, "0")
    monkeypatch.setattr(kernels, "BLOCK_ELEMENTS", 64)
    x, z, w, g = make_inputs((7, 32), dtype, "cpu")
    with cakeops.use_backend("torch"):
        got = run(x, z, w, g, group_size, norm_before_gate)
        check_against_reference(x, z, w, g, group_size, norm_before_gate, got)
        monkeypatch.setattr(kernels, "BLOCK_ELEMENTS", 1 << 18)
        short = run(x, z, w, g, group_size, norm_before_gate)
        check_against_reference(x, z, w, g, group_size, norm_before_gate, short)
    for a, b in zip(short, got, strict=True):
        torch.testing.assert_close(a, b)


def test_failing_compiler_falls_back_with_a_warning(compiled_path, broken_compiler):
    x, z, w, g = make_inputs((4, 32), torch.float32, "cpu")
    with pytest.warns(RuntimeWarning, match="CppCompileError"):
        got = run(x, z, w, g, 8, False)
    check_against_reference(x, z, w, g, 8, False, got)
    assert compile_._compile_error is not None
    # Later calls go straight to the eager kernels, without a warning each time.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(x, z, w, g, 8, False)


def test_runtime_error_in_compiled_path_propagates(compiled_path, monkeypatch):
    """Out of memory (or any error that is not the compiler's) is the caller's to see: no silent
    fallback, and the compiled path stays on."""

    def out_of_memory(fn):
        def call(*args):
            raise torch.OutOfMemoryError("CPU out of memory")

        return call

    monkeypatch.setattr(compile_, "_compiled", out_of_memory)
    x, z, w, g = make_inputs((4, 32), torch.float32, "cpu")
    with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
        run(x, z, w, g)
    assert compile_._compile_error is None


@pytest.fixture
def grouped_spy(monkeypatch):
    """Records which moe_experts backward pass ran: the grouped matmuls or the per-expert loop."""
    ran = []
    for name in ("_grouped_backward", "_loop_backward"):
        original = getattr(moe_kernels, name)

        def spy(*args, _original=original, _name=name):
            ran.append(_name)
            return _original(*args)

        monkeypatch.setattr(moe_kernels, name, spy)
    with cakeops.use_backend("torch"):
        yield ran


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("skew", [False, True], ids=["spread", "skewed"])
@pytest.mark.parametrize("group_elements", [1 << 21, 64], ids=["one-run", "runs"])
def test_moe_grouped_matmul_path(grouped_spy, monkeypatch, skew, group_elements):
    """Aligned float32 on the CPU takes ``torch._grouped_mm``, in one run of experts or several
    (a bound of 64 elements puts every expert in a run of its own); empty experts stay zero."""
    monkeypatch.setattr(moe_kernels, "GROUP_ELEMENTS", group_elements)
    tensors, g = moe_suite.make_inputs(12, 8, 12, 5, torch.float32, "cpu", skew=skew)
    got = run_with_grads(moe_suite.op_with(2), tensors, g)
    assert grouped_spy == ["_grouped_backward"]
    moe_suite.check_against_reference(tensors, g, (2, True, 1.0), got)
    if skew:
        for grad in got[3:]:
            assert torch.equal(grad[1:4], torch.zeros_like(grad[1:4]))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouped_weight_gradients_only_for_experts_with_rows(grouped_spy, monkeypatch):
    """A run of experts with empty ones between those that have rows (a decode step's): the
    weight gradients' grouped products (grouped over the rows: one output per group) take only
    the experts with rows, each product one group per such expert, not a zero gradient for each
    empty one; every gradient the float64 reference's, the empty experts' exactly zero."""
    calls = []
    grouped_mm = torch._grouped_mm

    def spy(a, b, *, offs, **kw):
        calls.append((a.shape[0], b.dim(), offs.numel()))
        return grouped_mm(a, b, offs=offs, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    E, D, F_ = 12, 8, 16
    x, g = torch.randn(3, D), torch.randn(3, D)
    index = torch.tensor([[1, 6], [6, 4], [1, 1]])  # experts 1, 4, 6: 2, 3 and 5 without rows
    weights = torch.rand(3, 2)
    w_gate, w_up = torch.randn(E, F_, D) * D**-0.5, torch.randn(E, F_, D) * D**-0.5
    args = (x, index, weights, w_gate, w_up, torch.randn(E, D, F_) * F_**-0.5)
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in args]
    monkeypatch.setattr(moe_kernels, "FEW_ROWS", 0)  # (the few rows' forward: no routing)
    wanted = [leaves[i] for i in (0, 2, 3, 4, 5)]
    grads = torch.autograd.grad(cakeops.routed_experts(*leaves), wanted, g)
    assert grouped_spy == ["_grouped_backward"]
    weight_products = [c for c in calls if c[1] == 2]  # (D or F, rows) x (rows, F or D)
    assert len(weight_products) == 3 and all(c[2] == 3 for c in weight_products), calls
    with cakeops.use_backend("reference"):
        args64 = [t.double() if t.is_floating_point() else t for t in args]
        leaves64 = [t.requires_grad_(t.is_floating_point()) for t in args64]
        want = torch.autograd.grad(cakeops.routed_experts(*leaves64),
                                   [leaves64[i] for i in (0, 2, 3, 4, 5)], g.double())  # fmt: skip
    for got, ref in zip(grads, want, strict=True):
        assert cakeops.relative_error(got, ref) <= cakeops.tolerance(torch.float32)
    for grad in grads[2:]:
        assert not grad[[0, 2, 3, 5, 7, 8, 9, 10, 11]].any()


@pytest.mark.parametrize(
    "D, F, dtype", [(10, 12, torch.float32), (8, 6, torch.float32), (8, 12, torch.bfloat16)]
)
def test_moe_loop_where_grouped_matmul_does_not_apply(grouped_spy, D, F, dtype):
    """Rows not 16-byte aligned, or 16-bit on the CPU (computed in float32 per expert): the loop."""
    tensors, g = moe_suite.make_inputs(12, D, F, 4, dtype, "cpu")
    got = run_with_grads(moe_suite.op_with(2), tensors, g)
    assert grouped_spy == ["_loop_backward"]
    moe_suite.check_against_reference(tensors, g, (2, True, 1.0), got)


@pytest.mark.parametrize(
    "D, F, dtype", [(8, 12, torch.float32), (10, 12, torch.float32), (8, 12, torch.bfloat16)]
)
def test_moe_compiled_swiglu_matches_reference(compiled_path, D, F, dtype):
    """The fused SwiGLU backward, in the grouped pass and in the loop, against float64."""
    tensors, g = moe_suite.make_inputs(12, D, F, 4, dtype, "cpu", skew=True)
    got = run_with_grads(moe_suite.op_with(2), tensors, g)
    assert compiled_path and set(compiled_path) == {"_fused_swiglu"}
    moe_suite.check_against_reference(tensors, g, (2, True, 1.0), got)


def test_moe_swiglu_eager_when_compiling_is_off(compiled_path, monkeypatch):
    monkeypatch.setenv(compile_.COMPILE_ENV, "0")
    tensors, g = moe_suite.make_inputs(12, 8, 12, 4, torch.float32, "cpu")
    got = run_with_grads(moe_suite.op_with(2), tensors, g)
    assert compiled_path == []
    moe_suite.check_against_reference(tensors, g, (2, True, 1.0), got)


def test_moe_swiglu_failing_compiler_falls_back_with_a_warning(compiled_path, broken_compiler):
    tensors, g = moe_suite.make_inputs(12, 8, 12, 4, torch.float32, "cpu")
    with pytest.warns(RuntimeWarning, match="torch.compile of moe_experts failed"):
        got = run_with_grads(moe_suite.op_with(2), tensors, g)
    assert compiled_path == [] and compile_._compile_error is not None
    moe_suite.check_against_reference(tensors, g, (2, True, 1.0), got)


# --------------------------------------------------------------------------------------------
# gated_delta_rule: the paths the conformance shapes may not take


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("path", ["one-chunk-groups", "guarded", "recurrent-limit"])
def test_gated_delta_rule_paths_agree(monkeypatch, kda, path):
    """Groups of one chunk (long sequences), the guarded products a non-finite input turns on
    (forced here on finite inputs) and the step-by-step path of short calls all give the
    float64 recurrence's results."""
    from cakeops.testing import test_gated_delta_rule as gdr
    from cakeops_torch import gated_delta_rule as kernel

    given = ("initial_state", "final", "l2norm") + (("kda",) if kda else ())
    L = 150
    if path == "one-chunk-groups":
        monkeypatch.setattr(kernel.chunk, "GROUP_BYTES", 1)
    elif path == "guarded":
        monkeypatch.setattr(kernel.chunk, "_needs_guard", lambda *a, **k: True)
    else:
        L = 4
        monkeypatch.setattr(kernel, "RECURRENT_UP_TO", 3)  # L = 4 through the chunks
    with cakeops.use_backend("torch"):
        gdr.check_against_reference(*gdr.make_inputs(given, torch.float64, "cpu", L=L))


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("given", [("l2norm",), ("initial_state", "final", "kda")])
def test_gated_delta_rule_compiled_step(monkeypatch, compiled_path, given, L):
    """The step-by-step path of short calls compiled (as decode-sized states take it on the
    CPU), and one position's backward, against the float64 recurrence (float32 inputs: the
    path's dtype); one position's forward is never compiled (its eager ops are faster)."""
    from cakeops.testing import test_gated_delta_rule as gdr
    from cakeops_torch import gated_delta_rule as kernel

    ran = []
    run_compiled = compile_.run_compiled
    monkeypatch.setattr(kernel.recurrent, "RECURRENT_COMPILE_MIN_STATE", 0)
    monkeypatch.setattr(
        kernel.recurrent, "run_compiled", lambda *a: ran.append(a[1].__name__) or run_compiled(*a)
    )
    gdr.check_against_reference(*gdr.make_inputs(given, torch.float32, "cpu", L=L))
    assert ("_recurrent" in ran) == (L > 1) and ("_step_backward" in ran) == (L == 1)


def _calls(monkeypatch, module, name: str) -> list[int]:
    """A list that grows by one at each call of ``module.name`` (which still runs)."""
    calls, original = [], getattr(module, name)

    def spy(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(module, name, spy)
    return calls


def _small_experts(gen, E: int, D: int, F: int, dtype) -> list[torch.Tensor]:
    """``w_gate``, ``w_up`` ``(E, F, D)`` and ``w_down`` ``(E, D, F)``, small values."""
    shapes = ((E, F, D), (E, F, D), (E, D, F))
    return [torch.randn(s, generator=gen).to(dtype) * 0.2 for s in shapes]


#: expert forms besides the default: gpt-oss's (biases, alpha, limit, up offset), an ungated one
_FORMS = {
    "swiglu": {},
    "gpt-oss": {"biases": True, "activation": "silu", "alpha": 1.702, "limit": 0.3,
                "up_offset": 1.0},
    "ungated": {"ungated": True, "activation": "relu2"},
}  # fmt: skip


@pytest.mark.parametrize("form", sorted(_FORMS))
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_experts_of_a_few_rows_run_slot_by_slot(monkeypatch, T, dtype, form):
    """A decode-sized call (at most ``FEW_ROWS`` (token, slot) rows) of any expert form runs
    each slot's expert directly: no routing sort and no runs of grouped matmuls, whose fixed
    cost is most of such a call; a dropped slot (id >= E, or -1) adds nothing; the result is
    the sorted path's and the reference's within the tolerance."""
    sorted_calls = _calls(monkeypatch, moe_kernels, "given_routing")
    gen = torch.Generator().manual_seed(0)
    E, D, F = 6, 16, 24
    x = torch.randn(T, D, generator=gen).to(dtype)
    w_gate, w_up, w_down = _small_experts(gen, E, D, F, dtype)
    idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(T)])
    idx[0, 1] = E  # dropped
    idx[-1, 0] = -1  # dropped (DeepEP's "not on this rank")
    weights = torch.rand(T, 2, generator=gen).to(dtype)
    options = dict(_FORMS[form])
    if options.pop("biases", False):
        for name, n in (("b_gate", F), ("b_up", F), ("b_down", D)):
            options[name] = torch.randn(E, n, generator=gen).to(dtype) * 0.2
    if options.pop("ungated", False):
        w_gate = None
    assert idx.numel() <= moe_kernels.FEW_ROWS
    outs = []
    monkeypatch.setattr(moe_kernels, "PADDED_ROWS", 0)  # (the sorted path, not the padded one)
    for few in (moe_kernels.FEW_ROWS, 0):
        monkeypatch.setattr(moe_kernels, "FEW_ROWS", few)
        with cakeops.use_backend("torch"):
            outs.append(cakeops.routed_experts(x, idx, weights, w_gate, w_up, w_down, **options))
        assert len(sorted_calls) == (0 if few else 1)
    assert outs[0].dtype == dtype
    assert cakeops.relative_error(outs[0], outs[1]) <= cakeops.tolerance(dtype)
    wide = [None if t is None else t.double() for t in (x, weights, w_gate, w_up, w_down)]
    wide_options = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    with cakeops.use_backend("reference"):
        want = cakeops.routed_experts(wide[0], idx, *wide[1:], **wide_options)
    assert cakeops.relative_error(outs[0], want) <= cakeops.tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_of_a_few_rows_skip_the_sort_by_expert(monkeypatch, dtype):
    """A decode-sized ``moe_experts`` call chooses its experts (softmax, top-k, weights) and
    runs them slot by slot, without the routing's sort by expert that a bigger call needs (most
    of a decode step's routing cost); the result and gradients are the sorted path's within
    the tolerance."""
    routed = _calls(monkeypatch, moe_kernel, "route")
    monkeypatch.setattr(moe_kernels, "PADDED_ROWS", 0)  # (the sorted path, not the padded one)
    gen = torch.Generator().manual_seed(1)
    E, D, F, T, k = 6, 16, 24, 3, 2
    x = torch.randn(T, D, generator=gen).to(dtype)
    logits = torch.randn(T, E, generator=gen).to(dtype)
    w_gate, w_up, w_down = _small_experts(gen, E, D, F, dtype)
    outs, grads = [], []
    for few in (moe_kernels.FEW_ROWS, 0):
        monkeypatch.setattr(moe_kernels, "FEW_ROWS", few)
        routed.clear()
        with cakeops.use_backend("torch"):
            with torch.no_grad():
                outs.append(cakeops.moe_experts(x, logits, w_gate, w_up, w_down, top_k=k))
            assert routed == ([] if few else [1])
            leaves = [t.detach().requires_grad_() for t in (x, logits, w_gate, w_up, w_down)]
            out = cakeops.moe_experts(*leaves, top_k=k)
            grads.append(torch.autograd.grad(out, leaves, torch.ones_like(out)))
    assert outs[0].dtype == dtype
    assert cakeops.relative_error(outs[0], outs[1]) <= cakeops.tolerance(dtype)
    for a, b in zip(*grads, strict=True):
        assert cakeops.relative_error(a, b) <= cakeops.tolerance(dtype)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouped_products_only_for_operands_they_take(monkeypatch):
    """The sorted path's grouped matmuls take float32 operands on a CPU with 16-byte aligned
    sizes and strides (a packed gate/up tensor's halves qualify); anything else goes one product
    per expert, with the reference's result (a misaligned weight view would raise in
    ``torch._grouped_mm``)."""
    gen = torch.Generator().manual_seed(0)
    E, D, F, T = 4, 16, 8, 12
    x = torch.randn(T, D, generator=gen)
    gate_up = torch.randn(E, 2 * F, D, generator=gen) * 0.2
    w_down = torch.randn(E, D, F, generator=gen) * 0.2
    halves = gate_up[:, :F], gate_up[:, F:]
    assert moe_kernels._grouped(x, *halves, w_down)
    assert not moe_kernels._grouped(x.double(), *(t.double() for t in (*halves, w_down)))
    assert not moe_kernels._grouped(x, halves[0], halves[1].bfloat16(), w_down)
    assert not moe_kernels._grouped(x[:, :6], halves[0][..., :6], halves[1][..., :6],
                                    w_down[:, :6])  # fmt: skip
    odd = (torch.randn(E, F, D + 1, generator=gen) * 0.2)[..., :D]  # rows 68 bytes apart
    assert not moe_kernels._grouped(x, odd, halves[1], w_down)
    assert not moe_kernels._grouped(x, *halves, w_down.transpose(1, 2).contiguous().mT)
    monkeypatch.setattr(moe_kernels, "PADDED_ROWS", 0)  # (the sorted path, not the padded one)
    idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(T)])
    weights = torch.rand(T, 2, generator=gen)
    with cakeops.use_backend("torch"):
        out = cakeops.routed_experts(x, idx, weights, odd, halves[1], w_down)
    want = cakeops.routed_experts(x.double(), idx, weights.double(), odd.double(),
                                  halves[1].double(), w_down.double())  # fmt: skip
    assert cakeops.relative_error(out, want) <= cakeops.tolerance(torch.float32)


def test_padded_experts_read_few_weights_of_experts_without_rows(monkeypatch):
    """An expert without rows between two with rows has its weights read by the padded
    products: the path declines beyond ``PADDED_SPARE_BYTES`` of them (big experts: one product
    per expert reads less)."""
    from cakeops.helpers import ExpertWeights

    ew = ExpertWeights.of(torch.randn(3, 8, 4), torch.randn(3, 8, 4), torch.randn(3, 4, 8))
    x, w = torch.randn(2, 4), torch.rand(2, 2)
    ids = torch.tensor([[0, 2], [2, 0]])  # expert 1 gets no row
    assert moe_kernels._padded_forward(x, ids, w, ew) is not None
    monkeypatch.setattr(moe_kernels, "PADDED_SPARE_BYTES", 3 * 8 * 4 * 4 - 1)
    assert moe_kernels._padded_forward(x, ids, w, ew) is None
    assert moe_kernels._padded_forward(x, torch.tensor([[0, 1], [1, 0]]), w, ew) is not None


@pytest.mark.parametrize("form", sorted(_FORMS))
@pytest.mark.parametrize("spread", [True, False], ids=["padded", "too-skewed"])
@pytest.mark.parametrize("op", ["routed_experts", "moe_experts"])
def test_experts_of_few_rows_as_padded_batched_products(monkeypatch, op, spread, form):
    """A CPU call of at most ``PADDED_ROWS`` (token, slot) rows, of any expert form, runs two
    ``bmm`` over its experts' rows padded to the busiest expert's count, from ids read on the
    host; where that would more than double the rows (every token on one expert), the sorted
    path. Dropped slots (id ``E``, ``-1``, a NaN weight) add nothing; forward and gradients are
    the reference's."""
    outcomes = []
    original = moe_kernels._padded_forward
    monkeypatch.setattr(moe_kernels, "_padded_forward",
                        lambda *a: outcomes.append(original(*a)) or outcomes[-1])  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    T, E, D, F = 12, 6, 16, 24
    x = torch.randn(T, D, generator=gen)
    ws = [torch.randn(E, F, D, generator=gen) * 0.2 for _ in "gu"]
    ws.append(torch.randn(E, D, F, generator=gen) * 0.2)
    options = dict(_FORMS[form])
    biases = {}
    if options.pop("biases", False):
        biases = {name: torch.randn(E, n, generator=gen) * 0.2
                  for name, n in (("b_gate", F), ("b_up", F), ("b_down", D))}  # fmt: skip
    gated = not options.pop("ungated", False)
    ws = [*ws[not gated :], *biases.values()]  # the tensors checked (float64 in the reference)

    def experts(t):  # (w_gate, w_up, w_down) and the options from the checked tensors
        w = [*t[: 3 - (not gated)]]
        return [None] * (not gated) + w, {**options, **dict(zip(biases, t[len(w) :], strict=True))}

    if op == "routed_experts":
        if spread:
            idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(T)])
            idx[0, 1], idx[-1, 0] = E, -1  # dropped slots
        else:
            idx = torch.stack([torch.zeros(T, dtype=torch.long), torch.full((T,), E - 1)], 1)
        weights = torch.rand(T, 2, generator=gen)
        if spread:
            weights[0, 1] = float("nan")  # on a dropped slot: reaches nothing

        def call(*t):
            w, kwargs = experts(t[2:])
            return cakeops.routed_experts(t[0], idx, t[1], *w, **kwargs)

        tensors = (x, weights, *ws)
    else:
        logits = torch.randn(T, E, generator=gen)
        if not spread:
            logits[:, 0] += 4.0  # every token's first choice

        def call(*t):
            w, kwargs = experts(t[2:])
            return cakeops.moe_experts(t[0], t[1], *w, top_k=2, **kwargs)

        tensors = (x, logits, *ws)
    _check_against_reference(call, tensors, torch.randn(T, D, generator=gen))
    assert len(outcomes) == 1 and (outcomes[0] is None) != spread


def _check_against_reference(call, tensors, g) -> None:
    """``call(*tensors)`` on the torch backend, forward and gradients for ``g``, within the
    float32 tolerance of the float64 reference backend's."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    with cakeops.use_backend("torch"):
        out = call(*leaves)
    leaves64 = [t.detach().double().requires_grad_() for t in tensors]
    with cakeops.use_backend("reference"):
        want = call(*leaves64)
    assert cakeops.relative_error(out, want) <= cakeops.tolerance(torch.float32)
    grads = torch.autograd.grad(out, leaves, g)
    wants = torch.autograd.grad(want, leaves64, g.double())
    for got, ref in zip(grads, wants, strict=True):
        assert cakeops.relative_error(got, ref) <= cakeops.tolerance(torch.float32)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("op", ["routed_experts", "moe_experts"])
@pytest.mark.parametrize("T", [1, 5])
def test_experts_device_path_reads_no_routing_on_the_host(monkeypatch, op, T):
    """The experts' path off the CPU (a GPU's decode step: one grouped matmul per projection
    over every expert, offsets on the device), run here on the CPU: no value of the routing is
    read on the host (no ``.tolist()``, ``.item()``, ``bool()``: each a synchronisation on a
    GPU), dropped slots (id ``E`` and ``-1``) add nothing, and the forward is the reference's
    within the tolerance, with the backward's gradients."""
    monkeypatch.setattr(moe_kernels, "_off_the_host", lambda x: True)
    ran = []
    original = moe_kernels._device_forward
    monkeypatch.setattr(moe_kernels, "_device_forward", lambda *a: ran.append(1) or original(*a))
    gen = torch.Generator().manual_seed(0)
    E, D, F = 6, 16, 24
    x = torch.randn(T, D, generator=gen)
    ws = [torch.randn(E, F, D, generator=gen) * 0.2 for _ in "gu"]
    ws.append(torch.randn(E, D, F, generator=gen) * 0.2)
    if op == "routed_experts":
        idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(T)])
        idx[0, 1], idx[-1, 0] = E, -1  # dropped slots
        weights = torch.rand(T, 2, generator=gen)
        call = lambda *t: cakeops.routed_experts(t[0], idx, t[1], *t[2:])  # noqa: E731
        kernel = lambda: moe_kernels.forward(x, idx, weights, *ws)  # noqa: E731
        tensors = (x, weights, *ws)
    else:
        logits = torch.randn(T, E, generator=gen)
        call = lambda *t: cakeops.moe_experts(*t, top_k=2)  # noqa: E731
        kernel = lambda: moe_kernel.forward(x, logits, *ws, 2, True, 1.0)  # noqa: E731
        tensors = (x, logits, *ws)
    host_reads = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__)
    with _Refusing(host_reads):  # the backend's kernel alone (the spec checks CPU ids' values)
        kernel()
    assert ran == [1]
    _check_against_reference(call, tensors, torch.randn(T, D, generator=gen))
    assert ran == [1, 1]


class _Refusing:
    """Makes the given tensor methods raise while active (a host read of a device value)."""

    def __init__(self, methods):
        self.methods = methods
        self.saved = {}

    def __enter__(self):
        for m in self.methods:
            self.saved[m.__name__] = m

            def refuse(*args, _name=m.__name__, **kwargs):
                raise AssertionError(f"Tensor.{_name} read a value on the host")

            setattr(torch.Tensor, m.__name__, refuse)

    def __exit__(self, *exc):
        for name, m in self.saved.items():
            setattr(torch.Tensor, name, m)


class _SubnormalReads(TorchDispatchMode):
    """Counts the float32 subnormal numbers the matrix products and solves read."""

    PRODUCTS = ("aten.bmm", "aten.mm", "aten.addmm", "aten.baddbmm", "aten.linalg_solve")

    def __init__(self):
        super().__init__()
        self.found: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.PRODUCTS):
            for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    a = t.abs()
                    n = int(((a > 0) & (a < torch.finfo(torch.float32).tiny)).sum())
                    if n:
                        self.found[str(func)] = self.found.get(str(func), 0) + n
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", ["gated_delta_rule", "kda", "causal_dot_product"])
def test_strong_gates_give_the_products_no_subnormal_operand(op):
    """Gates as strong as the models' (log gates down to -20 a step) make chunk factors and their
    products fall into float32's subnormal range, which x86 CPUs multiply tens of times slower
    (the gated delta rule's forward took 4x as long): the chunked forms take factors under
    ``exp(LOG_FACTOR_FLOOR)`` as 0, so no matrix product or solve reads a subnormal number."""
    from cakeops_torch import causal_dot_product as cdp
    from cakeops_torch import gated_delta_rule as gdr

    torch.manual_seed(0)
    N, H, Hv, L, D = 1, 2, 4, 256, 16
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s), dim=-1)  # noqa: E731
    q, k, v = unit(N, H, L, D), unit(N, H, L, D), torch.randn(N, Hv, L, D)
    g = -20 * torch.rand(N, Hv, L, D) if op == "kda" else -20 * torch.rand(N, Hv, L)
    with _SubnormalReads() as reads:
        if op == "causal_dot_product":
            q, k = torch.randn(N, Hv, L, D), torch.randn(N, Hv, L, D)
            out, _ = cdp.forward(q, k, v, log_gates=g)
            cdp.backward(torch.randn_like(out), out.new_empty(0), q, k, v, log_gates=g)
        else:
            beta = torch.rand(N, Hv, L)
            out, _ = gdr.forward(q, k, v, g, beta, 0.25)
            gdr.backward(torch.randn_like(out), out.new_empty(0), q, k, v, g, beta, 0.25)
    assert reads.found == {}


def test_gate_factors_drop_only_what_is_under_the_floor():
    from cakeops.helpers import LOG_FACTOR_FLOOR, drop_tiny_, gate_factors

    x = torch.tensor([0.0, -1.0, LOG_FACTOR_FLOOR + 0.5, LOG_FACTOR_FLOOR - 0.5, -torch.inf,
                      torch.nan])  # fmt: skip
    got = gate_factors(x)
    torch.testing.assert_close(got[:3], torch.exp(x[:3]), rtol=1e-6, atol=0)
    assert got[2] > 0
    assert got[3] == 0 and got[4] == 0 and torch.isnan(got[5])
    floor = torch.exp(torch.tensor(LOG_FACTOR_FLOOR))
    y = torch.tensor([1.0, -2 * floor, 0.5 * floor, -0.5 * floor, torch.nan])
    assert torch.equal(drop_tiny_(y.clone())[:4], torch.tensor([1.0, -2 * floor, 0.0, 0.0]))
    assert torch.isnan(drop_tiny_(y)[4])


def _counted_products(monkeypatch) -> list[int]:
    """A list that grows by one at each matrix product the torch experts make (``F.linear``,
    ``bmm``, ``baddbmm``, ``_grouped_mm``) while the test runs."""
    products: list[int] = []

    def counted(original):
        def product(*args, **kwargs):
            products.append(1)
            return original(*args, **kwargs)

        return product

    for module, name in ((moe_kernels.F, "linear"), (torch, "bmm"), (torch, "baddbmm"),
                         (torch, "_grouped_mm")):  # fmt: skip
        monkeypatch.setattr(module, name, counted(getattr(module, name)))
    return products


def _packed_experts(gen, E: int, D: int, F: int, T: int):
    """``(gate_up (E, 2F, D), w_down, x, ids, weights)``: small experts with a packed gate/up
    and ``T`` tokens' inputs, each token's two experts distinct."""
    gate_up = torch.randn(E, 2 * F, D, generator=gen) * 0.2
    w_down = torch.randn(E, D, F, generator=gen) * 0.2
    x = torch.randn(T, D, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(T)])
    return gate_up, w_down, x, idx, torch.rand(T, 2, generator=gen)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("T, path", [(2, "few-rows"), (24, "grouped"), (24, "padded")])
def test_routed_experts_packed_gate_up_in_one_product(monkeypatch, T, path):
    """Gate and up projections that are views of one packed tensor (Hugging Face's
    ``gate_up_proj``: its halves, or gpt-oss's interleaved rows) take one product for both (a
    small call's cost is its products' count): the result is the separate tensors' within the
    tolerance; separate tensors take two."""
    from cakeops.helpers import gate_up_pair

    gen, E, D, F = torch.Generator().manual_seed(0), 4, 16, 32
    gate_up, w_down, x, idx, weights = _packed_experts(gen, E, D, F, T)
    halves = gate_up[:, :F], gate_up[:, F:]
    interleaved = gate_up[:, 0::2], gate_up[:, 1::2]
    assert gate_up_pair(*halves) is not None and gate_up_pair(*interleaved) is not None
    assert gate_up_pair(*(t.contiguous() for t in halves)) is None
    products = _counted_products(monkeypatch)
    if path == "grouped":
        monkeypatch.setattr(moe_kernels, "PADDED_ROWS", 0)
    counts, outs = [], []
    with cakeops.use_backend("torch"):
        for w_gate, w_up in (halves, tuple(t.contiguous() for t in halves), interleaved):
            products.clear()
            outs.append(cakeops.routed_experts(x, idx, weights, w_gate, w_up, w_down))
            counts.append(len(products))
    assert counts[0] == counts[2] == 2 * counts[1] // 3 > 0, counts
    for out, (w_gate, w_up) in zip(outs, (halves, halves, interleaved), strict=True):
        want = cakeops.routed_experts(x.double(), idx, weights.double(), w_gate.double(),
                                      w_up.double(), w_down.double())  # fmt: skip
        assert cakeops.relative_error(out, want) <= cakeops.tolerance(torch.float32)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("packing", ["halves", "interleaved"])
@pytest.mark.parametrize("T, path", [(2, "few-rows"), (24, "padded"), (24, "sorted")])
def test_experts_of_any_form_take_one_product_for_packed_gate_and_up(monkeypatch, packing, T,
                                                                      path):  # fmt: skip
    """Experts of any form (here gpt-oss's: biases, a clamped SiLU with a slope, an up offset)
    whose gate and up weights and biases are views of one packed tensor each (Hugging Face's
    ``gate_up_proj`` and its bias: the halves, or gpt-oss's interleaved rows) take one product
    for both on every path: two products where separate tensors take three; the result is the
    reference's."""
    gen, E, D, F = torch.Generator().manual_seed(0), 4, 16, 32
    gate_up, w_down, x, idx, weights = _packed_experts(gen, E, D, F, T)
    gate_up_bias = torch.randn(E, 2 * F, generator=gen) * 0.2
    b_down = torch.randn(E, D, generator=gen) * 0.2

    def split(t):
        return (t[:, :F], t[:, F:]) if packing == "halves" else (t[:, 0::2], t[:, 1::2])

    packed = (*split(gate_up), *split(gate_up_bias))
    options = {"activation": "silu", "alpha": 1.702, "limit": 0.3, "up_offset": 1.0}

    def call(w_gate, w_up, b_gate, b_up, dtype=torch.float32):
        t = [v.to(dtype) for v in (x, weights, w_gate, w_up, w_down, b_gate, b_up, b_down)]
        return cakeops.routed_experts(t[0], idx, t[1], *t[2:5], b_gate=t[5], b_up=t[6],
                                      b_down=t[7], **options)  # fmt: skip

    products = _counted_products(monkeypatch)
    if path == "sorted":
        monkeypatch.setattr(moe_kernels, "PADDED_ROWS", 0)
    counts, outs = [], []
    with cakeops.use_backend("torch"):
        for tensors in (packed, tuple(t.contiguous() for t in packed)):
            products.clear()
            outs.append(call(*tensors))
            counts.append(len(products))
    assert counts[0] == 2 * counts[1] // 3 and counts[1] % 3 == 0 and counts[1] > 0, counts
    with cakeops.use_backend("reference"):
        want = call(*packed, dtype=torch.float64)
    for out in outs:
        assert cakeops.relative_error(out, want) <= cakeops.tolerance(torch.float32)


@pytest.mark.parametrize("cpu", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_norm_keeps_an_infinity_to_its_own_entry(cpu, dtype):
    """The decode-size norm in both of its forms, a CPU's (``eps`` added by one ``addcmul``)
    and every other device's (in-place ops): one infinite entry gives NaN there and zeros
    beside it in its group, one NaN a NaN group; the other groups are the float64 math's."""
    v = torch.randn(3, 32, dtype=dtype)
    v[1, 5], v[2, 20] = float("inf"), float("nan")
    got = kernels._scaled(v, kernels._rstd(v, 16, 1e-6, cpu), 16)
    v64 = v.double().unflatten(-1, (2, 16))
    want = (v64 / (v64.square().mean(-1, keepdim=True) + 1e-6).sqrt()).flatten(-2)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isnan(), torch.tensor([[False] * 32, [False] * 5 + [True] + [False] * 26,
                                                  [False] * 16 + [True] * 16]))  # fmt: skip
    finite = want.isfinite()
    torch.testing.assert_close(got[finite].double(), want[finite], rtol=1e-6, atol=0)


def test_index_tensor_is_the_list_as_int64():
    """``helpers.index_tensor`` (the experts' bookkeeping's host lists as tensors, through their
    bytes): the list's values, int64, for empty lists and values past int32 too."""
    from cakeops.helpers import index_tensor

    values = [0, -1, 5, 2**40, -(2**62), 7]
    got = index_tensor(values)
    assert got.dtype == torch.int64 and got.tolist() == values
    assert index_tensor([]).shape == (0,) and index_tensor([]).dtype == torch.int64
    assert index_tensor(values, "meta").device.type == "meta"
