"""Spec of ``moe_experts``: the routed expert branch of an MoE layer, dropless.

Routing (float32 always): ``p = softmax(router_logits)`` over all E experts, the ``top_k`` largest
(ties to the lower expert id), ``w = scale * r / sum(r)`` with ``renormalize`` else ``scale * r``.
Expert ``e`` on a row: by default ``y = (silu(x W_gate[e]^T) * (x W_up[e]^T)) W_down[e]^T``, and
with the options of ``routed_experts`` (biases, activation, ``alpha``, ``limit``,
``up_offset``, no gate) exactly its experts; the output is ``out_t = sum_s w_ts y_(t,s)``: the
routing weight is applied once, in the combine.

Backends implement :class:`Kernels` (arguments validated, ``T > 0``); the routing rules and
the pieces several backends share are in :mod:`cakeops.helpers`. Saved-tensor contract: exactly
the five tensor inputs; routing, activations and expert outputs are recomputed in the backward.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor

from cakeops import _spec, opspec
from cakeops.ops.routed_experts import check_weights, example_weights
from cakeops.opspec import OpInputs, OpSpec, moved_to_helpers

OP = "moe_experts"


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs(OpInputs):
    """The arguments, in order: ``x (T, D)``, ``router_logits (T, E)``, ``w_gate`` and
    ``w_up (E, F, D)``, ``w_down (E, D, F)``; ``top_k`` and the rest keyword-only."""

    op = OP
    x: torch.Tensor
    router_logits: torch.Tensor
    w_gate: torch.Tensor | None
    w_up: torch.Tensor
    w_down: torch.Tensor
    _: dataclasses.KW_ONLY
    top_k: int
    renormalize: bool = True
    scale: float = 1.0
    b_gate: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    activation: str = "silu"
    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0


#: What a backend's ``moe_experts`` kernel module defines: ``forward(x, router_logits, w_gate,
#: w_up, w_down, top_k, renormalize, scale, b_gate, b_up, b_down, activation, alpha, limit,
#: up_offset) -> out`` and ``backward(g, ...same...) -> (dx, drouter_logits, dw_gate, dw_up,
#: dw_down, db_gate, db_up, db_down)`` (None for a tensor not given).
Kernels = opspec.Kernels[Callable[..., Tensor], Callable[..., tuple[Tensor | None, ...]]]


def check(a: Inputs) -> Inputs:
    """The op's own checks (after the type checks)."""
    if not math.isfinite(a.scale):
        raise ValueError(f"{OP}: argument 'scale' expected a finite number, got {a.scale!r}")
    x, router_logits, top_k = a.x, a.router_logits, a.top_k
    if x.dim() != 2:
        raise ValueError(
            f"{OP}: argument 'x' expected 2 dimensions (T, D), got shape {tuple(x.shape)}"
        )
    _spec.check_float_dtype(OP, "x", x)
    _spec.check_float_dtype(OP, "router_logits", router_logits)
    _spec.check_same_device(OP, a.tensors)
    T = x.shape[0]
    if router_logits.dim() != 2 or router_logits.shape[0] != T:
        raise ValueError(
            f"{OP}: argument 'router_logits' expected shape ({T}, E) (T of x), "
            f"got {tuple(router_logits.shape)}"
        )
    E = router_logits.shape[1]
    if E < 1:
        raise ValueError(f"{OP}: argument 'router_logits' expected at least one expert, got E=0")
    check_weights(OP, a, E, "E of router_logits")
    if not 1 <= top_k <= E:
        raise ValueError(f"{OP}: argument 'top_k' expected an int in 1..{E}, got {top_k}")
    return a


def example(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Inputs:
    """Small valid inputs (T, D, F, E = 8, 16, 24, 4), for ``cakeops info`` and smoke tests."""
    T, D, F, E = 8, 16, 24, 4

    logits = torch.randn(T, E, device=device)
    x = torch.randn(T, D, device=device, dtype=dtype) * 0.1
    return Inputs(x, logits, *example_weights(E, F, D, device, dtype), top_k=2)


# output like x, no work if x empty; the default experts: cakeops::moe_experts_defaults
SPEC = OpSpec(inputs=Inputs, check=check, example=example, leading=8)


def moe_experts(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    top_k: int,
    renormalize: bool = True,
    scale: float = 1.0,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.0,
    limit: float | None = None,
    up_offset: float = 0.0,
) -> torch.Tensor:
    """The routed experts of an MoE layer: softmax top-k routing, dispatch, experts, combine.

    ``x (T, D)``, ``router_logits (T, E)``, ``w_gate`` (None: no gate) and ``w_up (E, F, D)``,
    ``w_down (E, D, F)`` (``nn.Linear`` layout) -> ``(T, D)`` in ``x.dtype``. Weights may be
    float32 while ``x`` is 16-bit. The biases and the activation's options are those of
    :func:`cakeops.routed_experts`. Saves only its tensor inputs; gradients flow to all of them.
    """
    return SPEC.call(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale, b_gate,
                     b_up, b_down, activation, alpha, limit, up_offset)  # fmt: skip


__getattr__ = moved_to_helpers(__name__)  # route, combine, ...: now in cakeops.helpers
