"""Conformance of ``rmsnorm_silu_gate`` (docs/content/ops/rmsnorm_silu_gate.md) for the
backend under test: the checks only this op has (``test_every_op`` has the shared ones)."""

from __future__ import annotations

import pytest
import torch

import cakeops
from cakeops.reference import rmsnorm_silu_gate as ref
from cakeops.testing import (
    EMULATED,
    SavedTensors,
    assert_bad_input_raises,
    assert_matches,
    reference_outputs,
    same_tensor,
)

OP = "rmsnorm_silu_gate"

# (shape of x, group_size, norm_before_gate)
CASES = {
    "2d": ((4, 64), None, True),
    "2d-gate-first": ((4, 64), None, False),
    "grouped": ((3, 48), 16, True),
    "grouped-gate-first": ((3, 48), 16, False),
    "3d": ((2, 3, 40), None, True),
    "4d-grouped": ((2, 2, 3, 24), 8, False),
    "d1": ((5, 1), None, True),
    "d1-gate-first": ((5, 1), None, False),
    "one-row": ((1, 96), None, False),
    "odd-d": ((7, 100), 25, True),
    "large-d": ((2, 16384), None, True),
    "huge-d-gate-first": ((2, 65536), None, False),
}


def make_inputs(shape, dtype, device, weight_dtype=None, seed=0, x_scale=None):
    gen = torch.Generator().manual_seed(seed)
    if x_scale is None:
        # With one feature per group, n = x * r is +-1 up to eps / x^2 and the x gradient
        # (exactly eps * r^3 * ...) is ill-conditioned even in float64; keep x near sqrt(eps).
        x_scale = 1e-3 if shape[-1] == 1 else 1.0
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * x_scale
    z = torch.randn(shape, generator=gen, dtype=torch.float64) * 2
    w = torch.rand(shape[-1], generator=gen, dtype=torch.float64) + 0.5
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    return (
        x.to(device, dtype).requires_grad_(),
        z.to(device, dtype).requires_grad_(),
        w.to(device, weight_dtype or dtype).requires_grad_(),
        g.to(device, dtype),
    )


def run(x, z, w, g, group_size=None, norm_before_gate=True, eps=1e-6):
    y = cakeops.rmsnorm_silu_gate(
        x, z, w, eps, group_size=group_size, norm_before_gate=norm_before_gate
    )
    dx, dz, dw = torch.autograd.grad(y, (x, z, w), g)
    return y.detach(), dx, dz, dw


def check_against_reference(x, z, w, g, group_size, norm_before_gate, got, eps=1e-6):
    gs = group_size or x.shape[-1]
    ref_y, ref_grads = reference_outputs(
        ref.math, {"x": x, "z": z, "weight": w}, (eps, gs, norm_before_gate), g
    )
    y, dx, dz, dw = got
    assert_matches(y, ref_y, "y", x.dtype)
    assert_matches(dx, ref_grads["x"], "dx", x.dtype)
    assert_matches(dz, ref_grads["z"], "dz", z.dtype)
    assert_matches(dw, ref_grads["weight"], "dweight", w.dtype)


class TestRMSNormSiLUGate:
    op = OP

    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_reference(self, cakeops_backend, dtype, cakeops_device, case):
        shape, group_size, nbg = CASES[case]
        if EMULATED and shape[-1] > 16384 and dtype != torch.float32:
            # a minute a dtype in the simulator; the 16-bit roundings are the narrower cases'
            pytest.skip("under an emulator, rows over 16384 wide run in float32 only")
        x, z, w, g = make_inputs(shape, dtype, cakeops_device)
        got = run(x, z, w, g, group_size, nbg)
        check_against_reference(x, z, w, g, group_size, nbg, got)

    @pytest.mark.cakeops_dtypes(torch.float32, torch.float16, torch.bfloat16)
    @pytest.mark.parametrize("nbg", [True, False])
    def test_single_feature_groups_saturated(self, cakeops_backend, dtype, cakeops_device, nbg):
        # |x| >> sqrt(eps): the x gradient is eps * r^3 * (...), tiny next to each term of the
        # general formula, so computing it as a difference loses every digit. The float64
        # reference keeps ~1e-10 relative accuracy here: enough to judge 32- and 16-bit results.
        x, z, w, g = make_inputs((6, 4), dtype, cakeops_device, x_scale=1.0)
        got = run(x, z, w, g, 1, nbg)
        check_against_reference(x, z, w, g, 1, nbg, got)

    @pytest.mark.cakeops_dtypes(torch.float16, torch.bfloat16)
    @pytest.mark.parametrize("nbg", [True, False])
    def test_float32_master_weight(self, cakeops_backend, dtype, cakeops_device, nbg):
        x, z, w, g = make_inputs((6, 80), dtype, cakeops_device, weight_dtype=torch.float32)
        got = run(x, z, w, g, None, nbg)
        assert got[0].dtype == dtype and got[3].dtype == torch.float32
        check_against_reference(x, z, w, g, None, nbg, got)

    @pytest.mark.cakeops_dtypes(torch.float64)
    @pytest.mark.parametrize("group_size,nbg", [(None, True), (None, False), (4, True), (4, False)])
    def test_gradcheck(self, cakeops_backend, dtype, cakeops_device, group_size, nbg):
        x, z, w, _ = make_inputs((3, 8), dtype, cakeops_device)

        def f(x, z, w):
            return cakeops.rmsnorm_silu_gate(
                x, z, w, 1e-6, group_size=group_size, norm_before_gate=nbg
            )

        assert torch.autograd.gradcheck(f, (x, z, w))

    def test_saves_strided_input_without_copy(self, cakeops_backend, cakeops_device):
        packed = torch.randn(4, 64, device=cakeops_device)
        x, z = packed[:, :32].requires_grad_(), packed[:, 32:]
        w = torch.ones(32, device=cakeops_device)
        with SavedTensors() as saved:
            cakeops.rmsnorm_silu_gate(x.detach().requires_grad_(), z, w)
        assert any(same_tensor(t, z) for t in saved.packed)

    @pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16)])
    def test_empty(self, cakeops_backend, dtype, cakeops_device, shape):
        x, z, w, g = make_inputs(shape, dtype, cakeops_device)
        y, dx, dz, dw = run(x, z, w, g)
        assert y.shape == x.shape and dx.shape == x.shape and dz.shape == z.shape
        assert torch.equal(dw, torch.zeros_like(w))

    @pytest.mark.parametrize("nbg", [True, False])
    def test_strided_inputs(self, cakeops_backend, dtype, cakeops_device, nbg):
        # z is a slice of a packed projection (rows strided, last dim contiguous); x is a
        # transposed view (nothing contiguous).
        D = 40
        proj = torch.randn(6, 3 * D, dtype=torch.float64).to(cakeops_device, dtype)
        z = proj[:, D : 2 * D].requires_grad_()
        x = torch.randn(D, 6, dtype=torch.float64).to(cakeops_device, dtype).t().requires_grad_()
        w = (torch.rand(D, dtype=torch.float64) + 0.5).to(cakeops_device, dtype).requires_grad_()
        g = torch.randn(6, D, dtype=torch.float64).to(cakeops_device, dtype)
        assert not z.is_contiguous() and not x.is_contiguous()
        got = run(x, z, w, g, 8, nbg)
        check_against_reference(x, z, w, g, 8, nbg, got)

    @pytest.mark.parametrize("nbg", [True, False])
    def test_large_finite_gates(self, cakeops_backend, dtype, cakeops_device, nbg):
        """Gates of +-10,000 (silu saturates to z and to -0): finite results as the
        reference's, where a naive ``1 / (1 + exp(-z))`` overflows (an error in numba's
        simulator, inf on a GPU)."""
        x, z, w, g = make_inputs((4, 32), dtype, cakeops_device)
        with torch.no_grad():
            z[:, ::2] = 1e4
            z[:, 1::2] = -1e4
        got = run(x, z, w, g, 16, nbg)
        check_against_reference(x, z, w, g, 16, nbg, got)

    @pytest.mark.parametrize("nbg", [True, False])
    def test_nan_propagates(self, cakeops_backend, dtype, cakeops_device, nbg):
        """NaN in x, Inf in z: the output and every gradient are non-finite exactly where the
        float64 reference's are; the rows without them are untouched."""
        x, z, w, g = make_inputs((4, 32), dtype, cakeops_device)
        with torch.no_grad():
            x[1, 3] = float("nan")
            z[2, 5] = float("inf")
        got = run(x, z, w, g, 16, nbg)
        ref_y, ref_grads = reference_outputs(
            ref.math, {"x": x, "z": z, "weight": w}, (1e-6, 16, nbg), g
        )
        for name, t, want in zip(("y", "dx", "dz", "dweight"), got, (ref_y, *ref_grads.values()),
                                 strict=True):  # fmt: skip
            assert torch.equal(torch.isfinite(t), torch.isfinite(want)), name
        y = got[0]
        assert torch.isnan(y[1, :16]).all() and torch.isfinite(y[1, 16:]).all()  # group of x[1, 3]
        assert torch.isfinite(y[[0, 3]]).all() and torch.isfinite(got[1][[0, 3]]).all()


def _bad_inputs(device):
    x = torch.randn(2, 8, device=device)
    w = torch.ones(8, device=device)
    return {
        # name: (args, kwargs, error type, argument named in the message)
        "x-not-tensor": ((x.tolist(), x, w), {}, TypeError, "x"),
        "x-scalar": ((x[0, 0], x[0, 0], w[:1].reshape(())), {}, ValueError, "x"),
        "z-shape": ((x, x[:, :4], w), {}, ValueError, "z"),
        "z-dtype": ((x, x.double(), w), {}, TypeError, "z"),
        "weight-shape": ((x, x, w[:4]), {}, ValueError, "weight"),
        "weight-2d": ((x, x, w.reshape(2, 4)), {}, ValueError, "weight"),
        "weight-dtype": ((x, x, w.half()), {}, TypeError, "weight"),
        "int-dtype": ((x.long(), x.long(), w.long()), {}, TypeError, "x"),
        "group-not-divisor": ((x, x, w), {"group_size": 3}, ValueError, "group_size"),
        "group-zero": ((x, x, w), {"group_size": 0}, ValueError, "group_size"),
        "group-float": ((x, x, w), {"group_size": 4.0}, TypeError, "group_size"),
        "eps-zero": ((x, x, w, 0.0), {}, ValueError, "eps"),
        "eps-negative": ((x, x, w, -1e-6), {}, ValueError, "eps"),
        # a float32 subnormal, or 0 where a GPU flushes those: a zero row's output was NaN
        "eps-subnormal": ((x, x, w, 1e-40), {}, ValueError, "eps"),
        "eps-nan": ((x, x, w, float("nan")), {}, ValueError, "eps"),
        "eps-inf": ((x, x, w, float("inf")), {}, ValueError, "eps"),
        "eps-str": ((x, x, w, "1e-6"), {}, TypeError, "eps"),
        "gate-flag": ((x, x, w), {"norm_before_gate": 1}, TypeError, "norm_before_gate"),
        "mixed-devices": ((x, x, torch.ones(8, device="meta")), {}, ValueError, "weight"),
    }


BAD = list(_bad_inputs("cpu"))


class TestRMSNormSiLUGateBadInput:
    op = OP

    @pytest.mark.parametrize("case", BAD)
    def test_bad_input_raises(self, cakeops_backend, cakeops_device, case):
        args, kwargs, error, argument = _bad_inputs(cakeops_device)[case]
        assert_bad_input_raises(
            OP, lambda: cakeops.rmsnorm_silu_gate(*args, **kwargs), error, argument
        )

    def test_direct_op_call_is_validated(self, cakeops_backend, cakeops_device):
        x = torch.randn(2, 8, device=cakeops_device)
        with pytest.raises(ValueError, match="argument 'group_size'"):
            torch.ops.cakeops.rmsnorm_silu_gate(
                x, x, torch.ones(8, device=cakeops_device), 1e-6, 3, True
            )
