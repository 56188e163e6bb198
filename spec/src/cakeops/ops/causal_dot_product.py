"""Spec of ``causal_dot_product``: causal linear attention, unnormalised and unscaled.

``out[n,h,i] = sum_{j<=i} (q[n,h,i] . k[n,h,j]) v[n,h,j]``, as fast-transformers'
``CausalDotProduct`` computes it; feature maps and normalisation stay with the caller.

Kernel signature every backend implements (arguments already validated, no dimension zero)::

    forward(q, k, v) -> out                      # (N, H, L, M), q.dtype
    backward(g, q, k, v) -> (dq, dk, dv)         # g contiguous, (N, H, L, M)

Saved-tensor contract: exactly ``q``, ``k``, ``v``; the running states are recomputed.
"""

from __future__ import annotations

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

OP = "causal_dot_product"
SAVED = ("q", "k", "v")
DTYPES = _spec.FLOAT_DTYPES


def check_types(q, k, v) -> None:
    for name, value in (("q", q), ("k", k), ("v", v)):
        _spec.check_tensor(OP, name, value)


def validate(q, k, v) -> None:
    """Check every argument (raises ``TypeError``/``ValueError`` naming the argument)."""
    check_types(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{OP}: argument '{name}' expected 4 dimensions (N, H, L, "
                f"{'M' if name == 'v' else 'E'}), got shape {tuple(t.shape)}"
            )
    _spec.check_float_dtype(OP, "q", q)
    _spec.check_dtype_like(OP, "k", k, "q", q)
    _spec.check_dtype_like(OP, "v", v, "q", q)
    _spec.check_same_device(OP, {"q": q, "k": k, "v": v})
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


def bind(q, k, v) -> dict[str, Any]:
    """Validate a call's arguments and return them as the inputs a backend is asked about."""
    validate(q, k, v)
    return {"q": q, "k": k, "v": v}


def example_inputs(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, shape=(1, 2, 16, 8)
) -> dict[str, Any]:
    """Small valid inputs, for ``cakeops info`` and smoke tests."""
    q = torch.randn(shape, device=device, dtype=dtype)
    return {"q": q, "k": torch.randn_like(q), "v": torch.randn_like(q)}


def _out_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty((*q.shape[:3], v.shape[3]), dtype=q.dtype, device=q.device)


@torch.library.custom_op("cakeops::causal_dot_product", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    validate(q, k, v)
    out = _out_like(q, v)
    if out.numel() == 0 or q.shape[3] == 0:
        return out.zero_()
    backend = pick(OP, {"q": q, "k": k, "v": v})
    return checked(OP, backend, "out", run_kernel(backend, OP, "forward", q, k, v), out)


@_forward_op.register_fake
def _(q, k, v):
    validate(q, k, v)
    return _out_like(q, v)


@torch.library.custom_op("cakeops::causal_dot_product_backward", mutates_args=())
def _backward_op(
    g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``backend``: the preference in force at the forward ("" for the automatic choice)."""
    validate(q, k, v)
    _spec.check_tensor(OP, "grad_output", g)
    out = _out_like(q, v)
    if g.shape != out.shape or g.dtype != out.dtype:
        raise ValueError(
            f"{OP}: argument 'grad_output' expected {_spec.dtype_name(q.dtype)} of shape "
            f"{tuple(out.shape)}, got {_spec.describe(g)}"
        )
    if out.numel() == 0 or q.shape[3] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    chosen = pick(OP, {"q": q, "k": k, "v": v}, backend)
    dq, dk, dv = run_kernel(chosen, OP, "backward", g.contiguous(), q, k, v)
    return (
        checked(OP, chosen, "dq", dq, q),
        checked(OP, chosen, "dk", dk, k),
        checked(OP, chosen, "dv", dv, v),
    )


@_backward_op.register_fake
def _(g, q, k, v, backend):
    validate(q, k, v)
    return (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
        torch.empty(v.shape, dtype=v.dtype, device=v.device),
    )


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)
    ctx.backend = backward_preference(OP)


def _backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    return apply(_BackwardFunction, _backward_op, grad, q, k, v, ctx.backend)


_forward_op.register_autograd(_backward, setup_context=_setup_context)
_Function = autograd_function(OP, _setup_context, _backward)
_BackwardFunction = backward_function(OP)


def causal_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal linear attention: ``out_i = sum_{j<=i} (q_i . k_j) v_j``.

    ``q``, ``k`` are ``(N, H, L, E)``, ``v`` is ``(N, H, L, M)``; returns ``(N, H, L, M)`` in
    ``q.dtype`` (float32 accumulation for 16-bit inputs). Saves only ``q``, ``k``, ``v``.
    """
    check_types(q, k, v)
    _spec.check_no_forward_ad(OP, {"q": q, "k": k, "v": v})
    return apply(_Function, _forward_op, q, k, v)


class CausalDotProduct:
    """Drop-in for ``fast_transformers.causal_product.CausalDotProduct``: ``.apply(q, k, v)``."""

    @staticmethod
    def apply(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return causal_dot_product(queries, keys, values)


# --------------------------------------------------------------------------------------------
# A helper for backends whose kernel is one causal scan.


def backward_by_scans(scan, g, q, k, v):
    """``(dq, dk, dv)`` as three runs of a causal scan ``scan(a, b, c, reverse)``, which computes
    ``out_i = sum_{j <= i} (a_i . b_j) c_j`` (``j >= i`` with ``reverse``): ``dq = (g, v, k)``
    forward in time, ``dk = (v, g, q)`` and ``dv = (k, q, g)`` in reverse."""
    dq = scan(g, v, k, False)  # dq_i = sum_{j<=i} (g_i . v_j) k_j
    dk = scan(v, g, q, True)  # dk_j = sum_{i>=j} (v_j . g_i) q_i
    dv = scan(k, q, g, True)  # dv_j = sum_{i>=j} (k_j . q_i) g_i
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
