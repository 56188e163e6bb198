"""Spec of ``rmsnorm_silu_gate``: gated RMSNorm (Qwen3-Next, Mamba2).

Variant A (``norm_before_gate=True``): ``y = x * r(x) * weight * silu(z)``;
variant B (``norm_before_gate=False``): ``y = v * r(v) * weight`` with ``v = x * silu(z)``;
``r(u) = rsqrt(mean(u^2) + eps)`` over each group of ``group_size`` consecutive features.

Backends implement :class:`Kernels` (arguments validated, ``x`` non-empty, ``group_size``
resolved to an int dividing D, ``g`` contiguous with ``x``'s shape). Saved-tensor contract:
exactly ``x``, ``z``, ``weight``; everything else is recomputed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor

from cakeops import _spec, opspec
from cakeops.opspec import OpInputs, OpSpec

OP = "rmsnorm_silu_gate"


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs(OpInputs):
    """The arguments, in order: the public signature, the custom-op schema and what backends get
    (``group_size`` resolved to an int once checked)."""

    op = OP
    x: torch.Tensor
    z: torch.Tensor
    weight: torch.Tensor
    eps: float = 1e-6
    _: dataclasses.KW_ONLY
    group_size: int | None = None
    norm_before_gate: bool = True


#: What a backend's ``rmsnorm_silu_gate`` kernel module defines: ``forward(x, z, weight, eps,
#: group_size, norm_before_gate) -> y`` and ``backward(g, ...same...) -> (dx, dz, dweight)``.
Kernels = opspec.Kernels[
    Callable[[Tensor, Tensor, Tensor, float, int, bool], Tensor],
    Callable[[Tensor, Tensor, Tensor, Tensor, float, int, bool], tuple[Tensor, ...]],
]


def check(a: Inputs) -> Inputs:
    """The op's own checks (after the type checks); returns the inputs with the group size
    resolved."""
    if not (math.isfinite(a.eps) and a.eps > 0):
        raise ValueError(f"{OP}: argument 'eps' expected a finite number > 0, got {a.eps!r}")
    if a.x.dim() < 1:
        raise ValueError(f"{OP}: argument 'x' expected at least 1 dimension (..., D), got a scalar")
    _spec.check_float_dtype(OP, "x", a.x)
    tiny = torch.finfo(torch.float32).tiny
    if a.x.dtype != torch.float64 and a.eps < tiny:
        # below it eps is a float32 subnormal, or 0 where a GPU flushes those: a zero row's
        # rsqrt(0 + eps) is then inf, and its output NaN where the math's is 0
        raise ValueError(
            f"{OP}: argument 'eps' expected at least {tiny:.6g} (float32's smallest normal "
            f"number: {_spec.dtype_name(a.x.dtype)} inputs are normalised in float32), "
            f"got {a.eps!r}"
        )
    _spec.check_dtype_like(OP, "z", a.z, "x", a.x)
    if a.weight.dtype not in (a.x.dtype, torch.float32):
        raise TypeError(
            f"{OP}: argument 'weight' expected dtype {_spec.dtype_name(a.x.dtype)} (the dtype of "
            f"x) or float32, got {_spec.dtype_name(a.weight.dtype)}"
        )
    _spec.check_same_device(OP, a.tensors)
    if a.z.shape != a.x.shape:
        raise ValueError(
            f"{OP}: argument 'z' expected shape {tuple(a.x.shape)} (the shape of x), "
            f"got {tuple(a.z.shape)}"
        )
    D = a.x.shape[-1]
    if a.weight.shape != (D,):
        raise ValueError(
            f"{OP}: argument 'weight' expected shape ({D},), got {tuple(a.weight.shape)}"
        )
    if a.group_size is None:
        return dataclasses.replace(a, group_size=D)
    if a.group_size < 1 or D % a.group_size != 0:
        raise ValueError(
            f"{OP}: argument 'group_size' expected a positive divisor of D={D}, got {a.group_size}"
        )
    return a


def example(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Inputs:
    """Small valid inputs, for ``cakeops info`` and smoke tests."""
    x = torch.randn(4, 64, device=device, dtype=dtype)
    weight = torch.rand(64, device=device, dtype=dtype) + 0.5
    return Inputs(x, torch.randn_like(x), weight)


SPEC = OpSpec(inputs=Inputs, check=check, example=example)  # output like x, no work if x empty


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
    return SPEC.call(x, z, weight, eps, group_size, norm_before_gate)


class RMSNormSiLUGateFunction:
    """The autograd-Function shape: ``RMSNormSiLUGateFunction.apply(x, z, weight, eps)``, and
    ``group_size``, ``norm_before_gate`` after them, positional too."""

    apply = staticmethod(SPEC.positional)
