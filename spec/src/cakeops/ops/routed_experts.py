"""Spec of ``routed_experts``: the SwiGLU experts and combine of an MoE layer, for a routing
computed elsewhere (by the model: softmax top-k, sigmoid with expert bias, grouped top-k, ...).

``out_t = sum_s w_ts y_(t, i_ts)`` with ``i = top_k_index``, ``w = top_k_weights`` and expert
``e`` on a row ``y = (silu(x W_gate[e]^T) * (x W_up[e]^T)) W_down[e]^T``: exactly the expert
math of ``moe_experts``, with the experts the caller chose (ties are the caller's). Gradients
flow to ``x``, ``top_k_weights`` and the three weights; ``top_k_index`` has none.

``w_gate`` and ``w_up`` may be views of one packed ``(E, 2F, D)`` tensor (Hugging Face's
``gate_up_proj[:, :F]`` and ``[:, F:]``): kernels read them through their strides, no copy.

Backends implement :class:`Kernels` (arguments validated, ``T > 0``). Saved-tensor contract:
exactly the six inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from cakeops import _spec, opspec
from cakeops.opspec import NO_GRAD, OpInputs, OpSpec

OP = "routed_experts"
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs(OpInputs):
    """The arguments, in order: ``x (T, D)``, ``top_k_index (T, k)`` (int64 or int32 expert
    ids), ``top_k_weights (T, k)``, ``w_gate`` and ``w_up (E, F, D)``, ``w_down (E, D, F)``."""

    op = OP
    x: torch.Tensor
    top_k_index: torch.Tensor = dataclasses.field(metadata=NO_GRAD)
    top_k_weights: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


#: What a backend's ``routed_experts`` kernel module defines: ``forward(x, top_k_index,
#: top_k_weights, w_gate, w_up, w_down) -> out`` and ``backward(g, ...same...) -> (dx,
#: dtop_k_weights, dw_gate, dw_up, dw_down)``.
Kernels = opspec.Kernels[
    Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor],
    Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, ...]],
]


def check(a: Inputs) -> Inputs:
    """The op's own checks (after the type checks). Expert ids are checked against ``E``: on
    the CPU at once, on a GPU by an asynchronous device assertion (no synchronisation)."""
    x, index, weights = a.x, a.top_k_index, a.top_k_weights
    if x.dim() != 2:
        raise ValueError(
            f"{OP}: argument 'x' expected 2 dimensions (T, D), got shape {tuple(x.shape)}"
        )
    _spec.check_float_dtype(OP, "x", x)
    if index.dtype not in INDEX_DTYPES:
        raise TypeError(
            f"{OP}: argument 'top_k_index' expected dtype int64 or int32, "
            f"got {_spec.dtype_name(index.dtype)}"
        )
    T = x.shape[0]
    if index.dim() != 2 or index.shape[0] != T:
        raise ValueError(
            f"{OP}: argument 'top_k_index' expected shape ({T}, k) (T of x), "
            f"got {tuple(index.shape)}"
        )
    _spec.check_float_dtype(OP, "top_k_weights", weights)
    if weights.shape != index.shape:
        raise ValueError(
            f"{OP}: argument 'top_k_weights' expected shape {tuple(index.shape)} (the shape of "
            f"top_k_index), got {tuple(weights.shape)}"
        )
    _spec.check_same_device(OP, a.tensors)
    E, _ = check_weights(OP, a, None, "E >= 1")
    _check_ids(index, E)
    return a


def check_weights(op: str, a: OpInputs, E: int | None, where_e: str) -> tuple[int, int]:
    """The dtypes and shapes of ``a.w_gate``, ``a.w_up`` ``(E, F, D)`` and ``a.w_down``
    ``(E, D, F)`` against ``a.x`` (``E`` given, or read from ``w_gate``: ``where_e`` says where it
    comes from); returns ``(E, F)``. Shared with ``moe_experts``."""
    x, w_gate, w_up, w_down = a.x, a.w_gate, a.w_up, a.w_down
    for name in ("w_gate", "w_up", "w_down"):
        w = a[name]
        if w.dtype not in (x.dtype, torch.float32):
            raise TypeError(
                f"{op}: argument '{name}' expected dtype {_spec.dtype_name(x.dtype)} (the dtype of "
                f"x) or float32 (master weights), got {_spec.dtype_name(w.dtype)}"
            )
    _spec.check_dtype_like(op, "w_up", w_up, "w_gate", w_gate)
    _spec.check_dtype_like(op, "w_down", w_down, "w_gate", w_gate)
    D = x.shape[1]
    ok = w_gate.dim() == 3 and w_gate.shape[2] == D and w_gate.shape[0] == (E or w_gate.shape[0])
    if not ok or w_gate.shape[0] < 1:
        raise ValueError(
            f"{op}: argument 'w_gate' expected shape ({E or 'E'}, F, {D}) ({where_e}, D of x), "
            f"got {tuple(w_gate.shape)}"
        )
    E, F = w_gate.shape[:2]
    if w_up.shape != w_gate.shape:
        raise ValueError(
            f"{op}: argument 'w_up' expected shape {tuple(w_gate.shape)} (the shape of "
            f"w_gate), got {tuple(w_up.shape)}"
        )
    if w_down.shape != (E, D, F):
        raise ValueError(
            f"{op}: argument 'w_down' expected shape ({E}, {D}, {F}), got {tuple(w_down.shape)}"
        )
    return E, F


def example_weights(E: int, F: int, D: int, device, dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Small random ``w_gate``, ``w_up``, ``w_down`` for example inputs."""
    return tuple(
        torch.randn(s, device=device, dtype=dtype) * 0.1 for s in ((E, F, D), (E, F, D), (E, D, F))
    )  # type: ignore[return-value]


def _check_ids(index: Tensor, E: int) -> None:
    if index.numel() == 0 or is_fake(index) or index.device.type == "meta":
        return
    bad = (index < 0) | (index >= E)
    message = f"{OP}: argument 'top_k_index' expected expert ids in 0..{E - 1}"
    if index.device.type == "cpu":
        if bad.any():
            first = index[bad][0].item()
            raise ValueError(f"{message}, got {first}")
    else:
        torch._assert_async(~bad.any(), message)


def example(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Inputs:
    """Small valid inputs (T, D, F, E, k = 8, 16, 24, 4, 2), for ``cakeops info`` and smoke
    tests: each token's two experts distinct, weights like a renormalised softmax."""
    T, D, F, E, k = 8, 16, 24, 4, 2

    index = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(device)
    weights = torch.softmax(torch.randn(T, k, device=device), dim=-1).to(dtype)
    x = torch.randn(T, D, device=device, dtype=dtype)
    return Inputs(x, index, weights, *example_weights(E, F, D, device, dtype))


SPEC = OpSpec(
    inputs=Inputs,
    check=check,
    example=example,
    # output like x; no work without rows, hidden features or slots
    no_work=lambda a: a.x.numel() == 0 or a.top_k_index.shape[1] == 0,
)


def routed_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """The SwiGLU experts and combine for a given routing: ``out_t = sum_s w_ts y_(t, i_ts)``.

    ``x (T, D)``, ``top_k_index`` and ``top_k_weights (T, k)``, ``w_gate`` and ``w_up (E, F, D)``
    (views of a packed ``(E, 2F, D)`` tensor work, without a copy), ``w_down (E, D, F)`` ->
    ``(T, D)`` in ``x.dtype``. Saves only its inputs; gradients for all but ``top_k_index``.
    """
    return SPEC(**locals())
