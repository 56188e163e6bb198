"""Spec of ``rmsnorm_silu_gate``: gated RMSNorm (Qwen3-Next, Mamba2).

Variant A (``norm_before_gate=True``): ``y = x * r(x) * weight * silu(z)``;
variant B (``norm_before_gate=False``): ``y = v * r(v) * weight`` with ``v = x * silu(z)``;
``r(u) = rsqrt(mean(u^2) + eps)`` over each group of ``group_size`` consecutive features.

Kernel signature every backend implements (arguments already validated, ``x`` non-empty,
``group_size`` resolved to an int dividing D, ``g`` contiguous with ``x``'s shape)::

    forward(x, z, weight, eps, group_size, norm_before_gate) -> y            # y: x.dtype
    backward(g, x, z, weight, eps, group_size, norm_before_gate) -> (dx, dz, dweight)

Saved-tensor contract: exactly ``x``, ``z``, ``weight``; everything else is recomputed.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cakeops import _spec
from cakeops.ops._glue import (
    apply,
    autograd_function,
    backward_function,
    backward_preference,
    checked,
    pick,
    run_kernel,
)

OP = "rmsnorm_silu_gate"
SAVED = ("x", "z", "weight")
DTYPES = _spec.FLOAT_DTYPES


def check_types(x, z, weight, eps, group_size, norm_before_gate) -> float:
    """Check the Python types of the arguments (cheap); return ``eps`` as a float."""
    for name, value in (("x", x), ("z", z), ("weight", weight)):
        _spec.check_tensor(OP, name, value)
    if not isinstance(norm_before_gate, bool):
        got = _spec.describe(norm_before_gate)
        raise TypeError(f"{OP}: argument 'norm_before_gate' expected a bool, got {got}")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)):
        raise TypeError(
            f"{OP}: argument 'group_size' expected an int or None, got {_spec.describe(group_size)}"
        )
    return _spec.check_number(OP, "eps", eps)


def validate(x, z, weight, eps, group_size, norm_before_gate) -> int:
    """Check every argument; return the resolved group size."""
    eps = check_types(x, z, weight, eps, group_size, norm_before_gate)
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"{OP}: argument 'eps' expected a finite number > 0, got {eps!r}")
    if x.dim() < 1:
        raise ValueError(f"{OP}: argument 'x' expected at least 1 dimension (..., D), got a scalar")
    _spec.check_float_dtype(OP, "x", x)
    _spec.check_dtype_like(OP, "z", z, "x", x)
    if weight.dtype not in (x.dtype, torch.float32):
        raise TypeError(
            f"{OP}: argument 'weight' expected dtype {_spec.dtype_name(x.dtype)} (the dtype of x) "
            f"or float32, got {_spec.dtype_name(weight.dtype)}"
        )
    _spec.check_same_device(OP, {"x": x, "z": z, "weight": weight})
    if z.shape != x.shape:
        raise ValueError(
            f"{OP}: argument 'z' expected shape {tuple(x.shape)} (the shape of x), "
            f"got {tuple(z.shape)}"
        )
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(
            f"{OP}: argument 'weight' expected shape ({D},), got {tuple(weight.shape)}"
        )
    if group_size is None:
        return D
    if group_size < 1 or D % group_size != 0:
        raise ValueError(
            f"{OP}: argument 'group_size' expected a positive divisor of D={D}, got {group_size}"
        )
    return group_size


def example_inputs(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, shape=(4, 64)
) -> dict[str, Any]:
    """Small valid inputs, for ``cakeops info`` and smoke tests."""
    x = torch.randn(shape, device=device, dtype=dtype)
    return {
        "x": x,
        "z": torch.randn_like(x),
        "weight": torch.rand(shape[-1], device=device, dtype=dtype) + 0.5,
        "eps": 1e-6,
        "group_size": shape[-1],
        "norm_before_gate": True,
    }


def _inputs(x, z, weight, eps, group_size, norm_before_gate) -> dict[str, Any]:
    return {
        "x": x,
        "z": z,
        "weight": weight,
        "eps": eps,
        "group_size": group_size,
        "norm_before_gate": norm_before_gate,
    }


def bind(x, z, weight, eps=1e-6, *, group_size=None, norm_before_gate=True) -> dict[str, Any]:
    """Validate a call's arguments and return them as the inputs a backend is asked about."""
    group_size = validate(x, z, weight, eps, group_size, norm_before_gate)
    return _inputs(x, z, weight, float(eps), group_size, norm_before_gate)


@torch.library.custom_op("cakeops::rmsnorm_silu_gate", mutates_args=())
def _forward_op(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int | None,
    norm_before_gate: bool,
) -> torch.Tensor:
    group_size = validate(x, z, weight, eps, group_size, norm_before_gate)
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    inputs = _inputs(x, z, weight, eps, group_size, norm_before_gate)
    backend = pick(OP, inputs)
    y = run_kernel(backend, OP, "forward", x, z, weight, eps, group_size, norm_before_gate)
    return checked(OP, backend, "y", y, x)


@_forward_op.register_fake
def _(x, z, weight, eps, group_size, norm_before_gate):
    validate(x, z, weight, eps, group_size, norm_before_gate)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("cakeops::rmsnorm_silu_gate_backward", mutates_args=())
def _backward_op(
    g: torch.Tensor,
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int | None,
    norm_before_gate: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``backend``: the preference in force at the forward ("" for the automatic choice)."""
    group_size = validate(x, z, weight, eps, group_size, norm_before_gate)
    _spec.check_tensor(OP, "grad_output", g)
    if g.shape != x.shape or g.dtype != x.dtype:
        raise ValueError(
            f"{OP}: argument 'grad_output' expected {_spec.dtype_name(x.dtype)} of shape "
            f"{tuple(x.shape)}, got {_spec.describe(g)}"
        )
    if x.numel() == 0:
        return (
            torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(z.shape, dtype=z.dtype, device=z.device),
            torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device),
        )
    inputs = _inputs(x, z, weight, eps, group_size, norm_before_gate)
    chosen = pick(OP, inputs, backend)
    dx, dz, dweight = run_kernel(
        chosen, OP, "backward", g.contiguous(), x, z, weight, eps, group_size, norm_before_gate
    )
    return (
        checked(OP, chosen, "dx", dx, x),
        checked(OP, chosen, "dz", dz, z),
        checked(OP, chosen, "dweight", dweight, weight),
    )


@_backward_op.register_fake
def _(g, x, z, weight, eps, group_size, norm_before_gate, backend):
    validate(x, z, weight, eps, group_size, norm_before_gate)
    return (
        torch.empty(x.shape, dtype=x.dtype, device=x.device),
        torch.empty(z.shape, dtype=z.dtype, device=z.device),
        torch.empty(weight.shape, dtype=weight.dtype, device=weight.device),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, z, weight, eps, group_size, norm_before_gate = inputs
    ctx.save_for_backward(x, z, weight)
    ctx.params = (eps, group_size, norm_before_gate)
    ctx.backend = backward_preference(OP)


def _backward(ctx, grad):
    x, z, weight = ctx.saved_tensors
    dx, dz, dweight = apply(
        _BackwardFunction, _backward_op, grad, x, z, weight, *ctx.params, ctx.backend
    )
    return dx, dz, dweight, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)
_Function = autograd_function(OP, _setup_context, _backward)
_BackwardFunction = backward_function(OP)


def rmsnorm_silu_gate(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    group_size: int | None = None,
    norm_before_gate: bool = True,
) -> torch.Tensor:
    """Gated RMSNorm: ``rmsnorm(x) * weight * silu(z)`` (or ``rmsnorm(x * silu(z)) * weight``).

    ``x`` and ``z`` are ``(..., D)``, ``weight`` is ``(D,)``; the RMS is taken over groups of
    ``group_size`` features (default D). Computes in float32 (float64 for float64 inputs) and
    returns ``x.dtype``. Saves only ``x``, ``z`` and ``weight`` for the backward.
    """
    eps = check_types(x, z, weight, eps, group_size, norm_before_gate)
    _spec.check_no_forward_ad(OP, {"x": x, "z": z, "weight": weight})
    return apply(_Function, _forward_op, x, z, weight, eps, group_size, norm_before_gate)


class RMSNormSiLUGateFunction:
    """The autograd-Function shape: ``RMSNormSiLUGateFunction.apply(x, z, weight, eps)``."""

    @staticmethod
    def apply(
        x: torch.Tensor,
        z: torch.Tensor,
        weight: torch.Tensor,
        eps: float = 1e-6,
        group_size: int | None = None,
        norm_before_gate: bool = True,
    ) -> torch.Tensor:
        return rmsnorm_silu_gate(
            x, z, weight, eps, group_size=group_size, norm_before_gate=norm_before_gate
        )
