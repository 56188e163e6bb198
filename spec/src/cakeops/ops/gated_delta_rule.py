"""Spec of ``gated_delta_rule``: the gated delta rule (Gated DeltaNet) and its per-channel-gate
form (Kimi Delta Attention, KDA), the sequence mixer of Qwen3-Next, Qwen3.5 and Kimi Linear.

Per value head, with a state ``S`` of shape ``(K, V)``::

    S <- exp(g_t) S                    (KDA: exp(g_t)[:, None] * S, a gate per key channel)
    u_t = beta_t (v_t - S^T k_t)
    S <- S + k_t u_t^T
    o_t = scale S^T q_t

Layout ``(N, H, L, D)`` like the other ops; strided views are accepted, so Hugging Face's
``(N, L, H, D)`` tensors come in as ``x.transpose(1, 2)`` without a copy. ``v`` may have
``Hv = G H`` heads for ``H`` key heads: value head ``h`` reads key head ``h // G`` (transformers'
``repeat_interleave``), with ``g``, ``beta`` and the state following the value heads.

Backends implement :class:`Kernels` (arguments validated, no dimension zero). Saved-tensor
contract: exactly the tensor inputs; the chunk states are recomputed in the backward.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from cakeops import _spec, opspec
from cakeops.opspec import NO_GRAD, OpInputs, OpSpec

OP = "gated_delta_rule"


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs(OpInputs):
    """The arguments, in order: ``q``, ``k`` ``(N, H, L, K)``, ``v`` ``(N, Hv, L, V)``, ``g``
    ``(N, Hv, L)`` or ``(N, Hv, L, K)`` (KDA), ``beta`` ``(N, Hv, L)``; keyword-only:
    ``scale``, ``initial_state`` ``(sequences, Hv, K, V)``, ``output_final_state``,
    ``cu_seqlens``, ``use_qk_l2norm``."""

    op = OP
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    _: dataclasses.KW_ONLY
    scale: float | None = None
    initial_state: torch.Tensor | None = None
    output_final_state: bool = False
    cu_seqlens: torch.Tensor | None = dataclasses.field(default=None, metadata=NO_GRAD)
    use_qk_l2norm: bool = False


#: What a backend's ``gated_delta_rule`` kernel module defines: ``forward(q, k, v, g, beta,
#: scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm) -> (out, final_state)``
#: (an empty tensor when not asked for; ``scale`` already resolved to a float) and
#: ``backward(g_out, g_final, ...same...) -> (dq, dk, dv, dg, dbeta, dinitial_state)`` (None for
#: an initial state not given; ``g_final`` empty when the final state has no gradient). Inputs
#: and upstream gradients may have any strides.
Kernels = opspec.Kernels[
    Callable[..., tuple[Tensor, Tensor]], Callable[..., tuple[Tensor | None, ...]]
]

#: The eps of ``use_qk_l2norm``: ``x / sqrt(sum(x^2) + eps)`` in float32 (fla's and
#: transformers' ``l2norm``).
L2NORM_EPS = 1e-6


def check(a: Inputs) -> Inputs:
    """The op's own checks (after the type checks); ``scale`` None becomes ``K**-0.5``."""
    for name, t, dims in (("q", a.q, "(N, H, L, K)"), ("k", a.k, "(N, H, L, K)"),
                          ("v", a.v, "(N, Hv, L, V)")):  # fmt: skip
        if t.dim() != 4:
            raise ValueError(f"{OP}: argument '{name}' expected 4 dimensions {dims}, got shape "
                             f"{tuple(t.shape)}")  # fmt: skip
    q, k, v = a.q, a.k, a.v
    _spec.check_float_dtype(OP, "q", q)
    _spec.check_dtype_like(OP, "k", k, "q", q)
    _spec.check_dtype_like(OP, "v", v, "q", q)
    _spec.check_same_device(OP, a.tensors)
    if k.shape != q.shape:
        raise ValueError(f"{OP}: argument 'k' expected shape {tuple(q.shape)} (the shape of q), "
                         f"got {tuple(k.shape)}")  # fmt: skip
    N, H, L, K = q.shape
    Hv, V = v.shape[1], v.shape[3]
    if v.shape[0] != N or v.shape[2] != L or H == 0 or Hv % H:
        raise ValueError(
            f"{OP}: argument 'v' expected shape ({N}, Hv, {L}, V) with Hv a multiple of the "
            f"{H} key heads (the N and L of q), got {tuple(v.shape)}"
        )
    for name, shapes in (("g", ((N, Hv, L), (N, Hv, L, K))), ("beta", ((N, Hv, L),))):
        t = a[name]
        _spec.check_float_dtype(OP, name, t)
        if tuple(t.shape) not in shapes:
            want = " or ".join(str(s) for s in shapes)
            raise ValueError(f"{OP}: argument '{name}' expected shape {want}, got "
                             f"{tuple(t.shape)}")  # fmt: skip
    _spec.check_log_multipliers(OP, "g", a.g)
    scale = a.scale
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"{OP}: argument 'scale' expected a finite number, got {scale!r}")
    _spec.check_states(OP, a, N, L, (Hv, K, V))
    if scale is None:
        return dataclasses.replace(a, scale=K**-0.5 if K else 1.0)
    return a


def check_data(a: Inputs) -> None:
    """The checks of :func:`check` that read values: log gates ``<= 0``, sorted offsets."""
    _spec.check_log_multipliers(OP, "g", a.g)
    if a.cu_seqlens is not None:
        _spec.check_cu_seqlens(OP, a.cu_seqlens, a.q.shape[0], a.q.shape[2])


def example(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Inputs:
    """Small valid inputs (two value heads per key head), for ``cakeops info`` and smoke
    tests."""
    q = torch.randn(1, 2, 8, 8, device=device, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn_like(q), dim=-1)
    v = torch.randn(1, 4, 8, 6, device=device, dtype=dtype)
    g = -torch.rand(1, 4, 8, device=device, dtype=dtype) * 0.5
    beta = torch.rand(1, 4, 8, device=device, dtype=dtype)
    return Inputs(q, k, v, g, beta)


def _final_state(a: Inputs):
    """The final state's shape and dtype when the call asks for it: float32 (float64 for
    float64 inputs), or the initial state's dtype."""
    if not a.output_final_state:
        return None
    N, _, _, K = a.q.shape
    Hv, V = a.v.shape[1], a.v.shape[3]
    sequences = N if a.cu_seqlens is None else a.cu_seqlens.numel() - 1
    dtype = a.initial_state.dtype if a.initial_state is not None else _spec.compute_dtype(a.q.dtype)
    return (sequences, Hv, K, V), dtype


SPEC = OpSpec(
    inputs=Inputs,
    check=check,
    check_data=check_data,
    output=lambda a: ((a.v.shape[0], a.v.shape[1], a.v.shape[2], a.v.shape[3]), a.q.dtype),
    no_work=_spec.state_no_work,
    example=example,
    leading=5,  # q, k, v, g, beta: cakeops::gated_delta_rule_defaults
    second=_final_state,
    second_flag="output_final_state",
    second_no_work=functools.partial(_spec.state_without_work, final_state=_final_state),
    contiguous_grads=False,  # the models' output is a transposed view: so is its gradient
)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
):
    """The gated delta rule (``g`` of shape ``(N, Hv, L)``) or KDA (``(N, Hv, L, K)``).

    ``S_t = exp(g_t) S_{t-1} + k_t u_t^T``, ``u_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t)``,
    ``o_t = scale S_t^T q_t``; ``scale`` None means ``K**-0.5``. Returns ``(N, Hv, L, V)`` in
    ``q.dtype``, and ``(out, final_state)`` with ``output_final_state``. ``use_qk_l2norm``
    normalises q and k inside the op (float32, eps 1e-6). Saves only its tensor inputs.
    """
    return SPEC.call(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm
    )
