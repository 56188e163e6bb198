"""The user-facing shapes of the op: function, Function.apply, nn.Module, the README example."""

import runpy
from pathlib import Path

import pytest
import torch

import cakeops

ROOT = Path(__file__).resolve().parents[2]


def test_function_apply_and_module_agree_with_the_op():
    x = torch.randn(4, 32, requires_grad=True)
    z = torch.randn(4, 32, requires_grad=True)
    norm = cakeops.nn.RMSNormSiLUGate(32, eps=1e-5, group_size=8, norm_before_gate=False)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    want = cakeops.rmsnorm_silu_gate(x, z, norm.weight, 1e-5, group_size=8, norm_before_gate=False)
    got_module = norm(x, z)
    got_apply = cakeops.RMSNormSiLUGateFunction.apply(x, z, norm.weight, 1e-5, 8, False)
    assert torch.equal(want, got_module) and torch.equal(want, got_apply)
    got_module.sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.shape == (32,)
    assert "group_size=8" in repr(norm)
    assert list(norm.state_dict()) == ["weight"]


def test_module_dtype_and_device_arguments():
    norm = cakeops.nn.RMSNormSiLUGate(16, dtype=torch.bfloat16, device="cpu")
    assert norm.weight.dtype == torch.bfloat16
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    assert norm(x, x).dtype == torch.bfloat16
    # checked as made in its dtype: float64 takes an eps below float32's smallest normal
    wide = cakeops.nn.RMSNormSiLUGate(8, eps=1e-300, dtype=torch.float64)
    x = torch.randn(2, 8, dtype=torch.float64)
    assert torch.isfinite(wide(x, x)).all()


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: cakeops.nn.RMSNormSiLUGate(-2), ValueError,
         "RMSNormSiLUGate: argument 'hidden_size' expected an int >= 0, got -2"),
        (lambda: cakeops.nn.RMSNormSiLUGate(10, group_size=3), ValueError,
         "rmsnorm_silu_gate: argument 'group_size' expected a positive divisor of D=10, got 3"),
        (lambda: cakeops.nn.RMSNormSiLUGate(8, eps=-1.0), ValueError, "argument 'eps'"),
        (lambda: cakeops.nn.MoEExperts(-1, 8, 4, 1), ValueError,
         "MoEExperts: argument 'num_experts' expected an int >= 0, got -1"),
        (lambda: cakeops.nn.MoEExperts(4, 8.0, 4, 1), TypeError,
         "MoEExperts: argument 'hidden_size' expected an int, got float 8.0"),
        (lambda: cakeops.nn.MoEExperts(4, 8, 4, 5), ValueError,
         "moe_experts: argument 'top_k' expected an int in 1..4, got 5"),
        (lambda: cakeops.nn.MoEExperts(4, 8, 4, 2, scale="x"), TypeError, "argument 'scale'"),
    ],
)  # fmt: skip
def test_modules_refuse_what_their_op_would_when_made(make, error, message):
    """A module's sizes and options are checked as it is made, with the op's own messages (a
    negative size was torch's error naming no argument; a bad option waited for the first
    forward)."""
    with pytest.raises(error) as refused:
        make()
    assert message in str(refused.value)


def test_readme_example_runs(capsys):
    runpy.run_path(str(ROOT / "docs" / "examples" / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    # a decode step's size (8 rows of 1024): numba's njit kernel where it is installed
    assert "rmsnorm_silu_gate: numba (chosen by priority)" in out
    assert "y (8, 1024) torch.bfloat16" in out


def test_readme_shows_the_example_verbatim():
    readme = (ROOT / "README.md").read_text()
    example = (ROOT / "docs" / "examples" / "quickstart.py").read_text()
    body = example.split('"""', 2)[2].strip()
    assert body in readme


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_gradient_keeps_the_weight_dtype(dtype):
    x = torch.randn(3, 8, dtype=dtype)
    w = torch.ones(8, dtype=torch.float32, requires_grad=True)
    cakeops.rmsnorm_silu_gate(x, x, w).float().sum().backward()
    assert w.grad.dtype == torch.float32


def test_causal_dot_product_drop_in_matches_fast_transformers_semantics():
    # fast_transformers.causal_product.CausalDotProduct.apply(queries, keys, values):
    # out[n, h, i] = sum_{j <= i} (q_i . k_j) v_j, (N, H, L, E) x (N, H, L, E) x (N, H, L, M).
    q, k = torch.randn(2, 3, 10, 4), torch.randn(2, 3, 10, 4)
    v = torch.randn(2, 3, 10, 5)
    qd, kd, vd = q.double(), k.double(), v.double()
    want = torch.stack(
        [
            torch.einsum("nhe,nhje,nhjm->nhm", qd[:, :, i], kd[:, :, : i + 1], vd[:, :, : i + 1])
            for i in range(10)
        ],
        dim=2,
    )
    got = cakeops.CausalDotProduct.apply(q, k, v)
    assert cakeops.relative_error(got, want) <= cakeops.tolerance(torch.float32)
    assert torch.equal(got, cakeops.causal_dot_product(q, k, v))


def test_torch_func_transforms_compose():
    """vmap of grad (per-sample gradients) equals a loop of autograd calls."""
    k, v = torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 3)

    def loss(q):
        return cakeops.causal_dot_product(q, k, v).square().sum()

    qs = torch.randn(3, 1, 2, 9, 4)
    # the ops have no batching rule: vmap runs them once per sample, and torch says so
    with pytest.warns(UserWarning, match="batching rule for cakeops::causal_dot_product"):
        per_sample = torch.func.vmap(torch.func.grad(loss))(qs)
    for q, got in zip(qs, per_sample, strict=True):
        (want,) = torch.autograd.grad(loss(q.requires_grad_()), q)
        torch.testing.assert_close(got, want)


def test_second_derivatives_are_a_clear_error():
    q = torch.randn(1, 2, 9, 4, requires_grad=True)
    (dq,) = torch.autograd.grad(cakeops.causal_dot_product(q, q, q).sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="second derivatives"):
        dq.sum().backward()


def test_public_functions_pass_their_arguments_by_name():
    """No public op function hands its arguments on as ``locals()``: Dynamo of torch 2.11 (the
    oldest torch the packages take) cannot trace that builtin, and ``torch.compile`` of the
    function failed there (found on the GPU run, which has torch 2.11), whereas this CI's newer
    torch traces it."""
    import ast
    import inspect

    from cakeops.ops import SPECS

    for name in SPECS:
        module = __import__(f"cakeops.ops.{name}", fromlist=[name])
        tree = ast.parse(inspect.getsource(module))
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        assert not [c for c in calls if getattr(c.func, "id", None) == "locals"], name


def test_a_norm_eps_below_float32s_range_is_refused_only_below_float64():
    """The kernels normalise float32, float16 and bfloat16 inputs in float32, where an eps below
    its smallest normal number is a subnormal or 0 (a zero row's output NaN, where the math's is
    0): refused for those; float64 inputs, computed in float64, take it."""
    x = torch.zeros(2, 8, dtype=torch.float64)
    out = cakeops.rmsnorm_silu_gate(x, x, torch.ones(8, dtype=torch.float64), eps=1e-300)
    assert out.eq(0).all()
    tiny = torch.finfo(torch.float32).tiny
    assert cakeops.rmsnorm_silu_gate(x.float(), x.float(), torch.ones(8), eps=tiny).eq(0).all()
    with pytest.raises(ValueError, match=r"argument 'eps' expected at least 1\.17549e-38"):
        cakeops.rmsnorm_silu_gate(x.bfloat16(), x.bfloat16(), torch.ones(8), eps=tiny / 2)
