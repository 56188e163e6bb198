"""Spec of ``causal_dot_product``: causal linear attention, unnormalised and unscaled.

``out[n,h,i] = sum_{j<=i} (q[n,h,i] . k[n,h,j]) v[n,h,j]``, as fast-transformers'
``CausalDotProduct`` computes it; feature maps and normalisation stay with the caller.

Backends implement :class:`Kernels` (arguments validated, no dimension zero, ``g`` contiguous,
``(N, H, L, M)``). Saved-tensor contract: exactly ``q``, ``k``, ``v``; the running states are
recomputed. :func:`cakeops.helpers.backward_by_scans` builds the backward from one causal scan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from cakeops import _spec, opspec
from cakeops.opspec import OpInputs, OpSpec, moved_to_helpers

OP = "causal_dot_product"


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs(OpInputs):
    """The arguments, in order: ``q``, ``k`` ``(N, H, L, E)``, ``v`` ``(N, H, L, M)``."""

    op = OP
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


#: What a backend's ``causal_dot_product`` kernel module defines: ``forward(q, k, v) -> out`` and
#: ``backward(g, q, k, v) -> (dq, dk, dv)``.
Kernels = opspec.Kernels[
    Callable[[Tensor, Tensor, Tensor], Tensor],
    Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]],
]


def check(a: Inputs) -> Inputs:
    """The op's own checks (after the type checks)."""
    for name, t in a.tensors.items():
        if t.dim() != 4:
            raise ValueError(
                f"{OP}: argument '{name}' expected 4 dimensions (N, H, L, "
                f"{'M' if name == 'v' else 'E'}), got shape {tuple(t.shape)}"
            )
    q, k, v = a.q, a.k, a.v
    _spec.check_float_dtype(OP, "q", q)
    _spec.check_dtype_like(OP, "k", k, "q", q)
    _spec.check_dtype_like(OP, "v", v, "q", q)
    _spec.check_same_device(OP, a.tensors)
    if k.shape != q.shape:
        raise ValueError(
            f"{OP}: argument 'k' expected shape {tuple(q.shape)} (the shape of q: same N, H, L "
            f"and E), got {tuple(k.shape)}"
        )
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"{OP}: argument 'v' expected shape ({', '.join(map(str, q.shape[:3]))}, M) (the "
            f"N, H, L of q), got {tuple(v.shape)}"
        )
    return a


def example(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Inputs:
    """Small valid inputs, for ``cakeops info`` and smoke tests."""
    q = torch.randn(1, 2, 40, 8, device=device, dtype=dtype) * 8**-0.5
    v = torch.randn(1, 2, 40, 6, device=device, dtype=dtype)
    return Inputs(q, torch.randn_like(q), v)


SPEC = OpSpec(
    inputs=Inputs,
    check=check,
    output=lambda a: ((*a.q.shape[:3], a.v.shape[3]), a.q.dtype),
    # E = 0: every dot product is 0
    no_work=lambda a: a.q.numel() == 0 or a.v.numel() == 0,
    example=example,
)


def causal_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal linear attention: ``out_i = sum_{j<=i} (q_i . k_j) v_j``.

    ``q``, ``k`` are ``(N, H, L, E)``, ``v`` is ``(N, H, L, M)``; returns ``(N, H, L, M)`` in
    ``q.dtype`` (float32 accumulation for 16-bit inputs). Saves only ``q``, ``k``, ``v``.
    """
    return SPEC(q=q, k=k, v=v)


class CausalDotProduct:
    """Drop-in for ``fast_transformers.causal_product.CausalDotProduct``: ``.apply(q, k, v)``."""

    @staticmethod
    def apply(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return causal_dot_product(queries, keys, values)


__getattr__ = moved_to_helpers(__name__)  # route, combine, ...: now in cakeops.helpers
