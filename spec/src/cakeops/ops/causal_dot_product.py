"""Spec of ``causal_dot_product``: causal linear attention, unnormalised and unscaled.

``out[n,h,i] = sum_{j<=i} (q[n,h,i] . k[n,h,j]) v[n,h,j]``, as fast-transformers'
``CausalDotProduct`` computes it; feature maps and normalisation stay with the caller. ``q`` and
``k`` may have ``Hk`` heads for the ``H = G Hk`` heads of ``v``: value head ``h`` reads key head
``h // G`` (transformers' ``repeat_interleave``; Mamba2's B and C shared by head groups), with
the log multipliers and the states following the value heads.

Backends implement :class:`Kernels` (arguments validated, no dimension zero, ``g`` contiguous,
``(N, H, L, M)``). Saved-tensor contract: exactly ``q``, ``k``, ``v``; the running states are
recomputed. :func:`cakeops.helpers.backward_by_scans` builds the backward from one causal scan.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from cakeops import _spec, opspec
from cakeops.opspec import NO_GRAD, OpInputs, OpSpec, moved_to_helpers

OP = "causal_dot_product"


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs(OpInputs):
    """The arguments, in order: ``q``, ``k`` ``(N, Hk, L, E)``, ``v`` ``(N, H, L, M)`` (``Hk``
    divides ``H``); WIP
    (#27) keyword-only: ``scale``, ``log_decay (H,)``, ``log_gates (N, H, L)``,
    ``initial_state``, ``output_final_state``, ``cu_seqlens``."""

    op = OP
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    _: dataclasses.KW_ONLY
    scale: float | None = None
    log_decay: torch.Tensor | None = None
    log_gates: torch.Tensor | None = None
    initial_state: torch.Tensor | None = None
    output_final_state: bool = False
    cu_seqlens: torch.Tensor | None = dataclasses.field(default=None, metadata=NO_GRAD)


#: What a backend's ``causal_dot_product`` kernel module defines: ``forward(q, k, v, scale,
#: log_decay, log_gates, initial_state, output_final_state, cu_seqlens) -> (out, final_state)``
#: (an empty tensor when not asked for) and ``backward(g, g_final, ...same...) -> (dq, dk, dv,
#: dlog_decay, dlog_gates, dinitial_state)`` (None for an option not given; ``g_final`` empty
#: when the final state has no gradient: not asked for, or asked for and no gradient reached it).
Kernels = opspec.Kernels[
    Callable[..., tuple[Tensor, Tensor]], Callable[..., tuple[Tensor | None, ...]]
]


def default_options(a) -> bool:
    """Whether a call leaves every option at its default (today's op)."""
    return (a.scale is None and a.log_decay is None and a.log_gates is None
            and a.initial_state is None and not a.output_final_state
            and a.cu_seqlens is None)  # fmt: skip


def check(a: Inputs) -> Inputs:
    """The op's own checks (after the type checks)."""
    for name, t in (("q", a.q), ("k", a.k), ("v", a.v)):
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
    N, Hk, L = q.shape[:3]
    H = v.shape[1]
    if v.shape[0] != N or v.shape[2] != L or (H % Hk if Hk else H):
        raise ValueError(
            f"{OP}: argument 'v' expected shape ({N}, H, {L}, M) with H a multiple of the {Hk} "
            f"heads of q (the N and L of q; value head h reads key head h // (H / {Hk})), got "
            f"{tuple(v.shape)}"
        )
    if not default_options(a):
        _check_options(a)
    return a


def _check_options(a: Inputs) -> None:
    """WIP (#27): the options' shapes, dtypes and values."""
    N, _, L, E = a.q.shape
    H, M = a.v.shape[1], a.v.shape[3]
    if a.scale is not None and not math.isfinite(a.scale):
        raise ValueError(f"{OP}: argument 'scale' expected a finite number, got {a.scale!r}")
    sequences = N
    if a.cu_seqlens is not None:
        sequences = _spec.check_cu_seqlens(OP, a.cu_seqlens, N, L)
    for name, shape in (("log_decay", (H,)), ("log_gates", (N, H, L)),
                        ("initial_state", (sequences, H, E, M))):  # fmt: skip
        t = a[name]
        if t is None:
            continue
        _spec.check_float_dtype(OP, name, t)
        if tuple(t.shape) != shape:
            raise ValueError(f"{OP}: argument '{name}' expected shape {shape}, got "
                             f"{tuple(t.shape)}")  # fmt: skip
        if name != "initial_state":
            _spec.check_log_multipliers(OP, name, t)


def check_data(a: Inputs) -> None:
    """The checks of :func:`check` that read values: sorted offsets, log multipliers ``<= 0``."""
    if a.cu_seqlens is not None:
        _spec.check_cu_seqlens(OP, a.cu_seqlens, a.q.shape[0], a.q.shape[2])
    if a.log_decay is not None:
        _spec.check_log_multipliers(OP, "log_decay", a.log_decay)
    if a.log_gates is not None:
        _spec.check_log_multipliers(OP, "log_gates", a.log_gates)


def example(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Inputs:
    """Small valid inputs, for ``cakeops info`` and smoke tests."""
    q = torch.randn(1, 2, 40, 8, device=device, dtype=dtype) * 8**-0.5
    v = torch.randn(1, 2, 40, 6, device=device, dtype=dtype)
    return Inputs(q, torch.randn_like(q), v)


def _final_state(a: Inputs):
    """The final state's shape and dtype when the call asks for it."""
    if not a.output_final_state:
        return None
    N, E, H = a.q.shape[0], a.q.shape[3], a.v.shape[1]
    sequences = N if a.cu_seqlens is None else a.cu_seqlens.numel() - 1
    dtype = a.initial_state.dtype if a.initial_state is not None else _spec.compute_dtype(a.q.dtype)
    return (sequences, H, E, a.v.shape[3]), dtype


SPEC = OpSpec(
    inputs=Inputs,
    check=check,
    check_data=check_data,
    output=lambda a: (tuple(a.v.shape), a.q.dtype),
    no_work=_spec.state_no_work,
    example=example,
    leading=3,  # q, k, v: fast-transformers' op, cakeops::causal_dot_product_defaults
    second=_final_state,
    second_flag="output_final_state",
    second_no_work=functools.partial(_spec.state_without_work, final_state=_final_state),
)


def causal_dot_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    log_decay: torch.Tensor | None = None,
    log_gates: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Causal linear attention: ``out_i = sum_{j<=i} (q_i . k_j) v_j``.

    ``q``, ``k`` are ``(N, H, L, E)`` (or ``(N, Hk, L, E)``, value head ``h`` reading key head
    ``h // (H / Hk)``), ``v`` is ``(N, H, L, M)``; returns ``(N, H, L, M)`` in
    ``q.dtype`` (float32 accumulation for 16-bit inputs). Saves only its tensor inputs. WIP
    (#27): with the options, ``S_t = exp(log_decay + log_gates_t) S_{t-1} + k_t v_t^T`` and
    ``out_t = scale q_t^T S_t``; ``(out, final_state)`` with ``output_final_state``.
    """
    return SPEC.call(
        q, k, v, scale, log_decay, log_gates, initial_state, output_final_state, cu_seqlens
    )


class CausalDotProduct:
    """Drop-in for ``fast_transformers.causal_product.CausalDotProduct``: ``.apply(q, k, v)``."""

    @staticmethod
    def apply(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return causal_dot_product(queries, keys, values)


__getattr__ = moved_to_helpers(__name__)  # route, combine, ...: now in cakeops.helpers
