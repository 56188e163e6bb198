"""Spec of ``routed_experts``: the experts and combine of an MoE layer, for a routing computed
elsewhere (by the model: softmax top-k, sigmoid with expert bias, grouped top-k, ...).

``out_t = sum_s w_ts y_(t, i_ts)`` with ``i = top_k_index``, ``w = top_k_weights`` and expert
``e`` on a row ``x``::

    gate = x W_gate[e]^T + b_gate[e]        up = x W_up[e]^T + b_up[e]
    with limit L:  gate = min(gate, L),  up = clamp(up, -L, L)
    h = act(gate) * (up + up_offset)        (no W_gate: h = act(up))
    y = h W_down[e]^T + b_down[e]

with ``act`` one of :data:`ACTIVATIONS` (``silu`` is ``g * sigmoid(alpha * g)``). The defaults
(SiLU, ``alpha`` 1, no limit, no offset, no biases) are the SwiGLU experts of Mixtral, Qwen and
DeepSeek; GPT-OSS is ``alpha=1.702, limit=7, up_offset=1`` with biases. Gradients flow to ``x``,
``top_k_weights``, the weights and the biases; ``top_k_index`` has none. Ids ``>= E`` and ``-1`` are
dropped slots (transformers' expert parallelism sends ids past the local experts for experts on
other ranks, DeepEP's dispatch ``-1`` for "not on this rank"): they add nothing and get zero
gradients. Ids below ``-1`` are an error.

Weights are read through their strides: ``w_gate`` and ``w_up`` may be views of one packed
``(E, 2F, D)`` tensor (``gate_up_proj[:, :F]``), of an interleaved one (``[:, ::2]``), or
transposed views of an ``(E, D, 2F)`` one (``.transpose(1, 2)``): no copy.

Backends implement :class:`Kernels` (arguments validated, ``T > 0``). Saved-tensor contract:
exactly the tensor inputs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from cakeops import _spec, opspec
from cakeops.opspec import NO_GRAD, OpInputs, OpSpec

OP = "routed_experts"
INDEX_DTYPES = (torch.int32, torch.int64)
#: The activations ``act`` the experts take (``silu`` with its slope ``alpha``).
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")
_WEIGHTS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")
#: The keyword-only arguments both expert ops share, in order, after their own.
EXPERT_OPTIONS = ("b_gate", "b_up", "b_down", "activation", "alpha", "limit", "up_offset")


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs(OpInputs):
    """The arguments, in order: ``x (T, D)``, ``top_k_index (T, k)`` (int64 or int32 expert
    ids), ``top_k_weights (T, k)``, ``w_gate`` (or None) and ``w_up (E, F, D)``, ``w_down
    (E, D, F)``; keyword-only: the biases ``b_gate``, ``b_up (E, F)``, ``b_down (E, D)`` and the
    activation's options."""

    op = OP
    x: torch.Tensor
    top_k_index: torch.Tensor = dataclasses.field(metadata=NO_GRAD)
    top_k_weights: torch.Tensor
    w_gate: torch.Tensor | None
    w_up: torch.Tensor
    w_down: torch.Tensor
    _: dataclasses.KW_ONLY
    b_gate: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    activation: str = "silu"
    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0


#: What a backend's ``routed_experts`` kernel module defines: ``forward(x, top_k_index,
#: top_k_weights, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, alpha, limit,
#: up_offset) -> out`` and ``backward(g, ...same...) -> (dx, dtop_k_weights, dw_gate, dw_up,
#: dw_down, db_gate, db_up, db_down)`` (None for a tensor not given).
Kernels = opspec.Kernels[Callable[..., Tensor], Callable[..., tuple[Tensor | None, ...]]]


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
    """The dtypes and shapes of ``a.w_gate`` (or None), ``a.w_up`` ``(E, F, D)``, ``a.w_down``
    ``(E, D, F)`` and the biases against ``a.x`` (``E`` given, or read from ``w_up``:
    ``where_e`` says where it comes from), then the activation's options; returns ``(E, F)``.
    Shared with ``moe_experts``."""
    x, w_up = a.x, a.w_up
    given = [(n, w) for n in _WEIGHTS if (w := getattr(a, n)) is not None]
    for name, w in given:
        if w.dtype not in (x.dtype, torch.float32):
            raise TypeError(
                f"{op}: argument '{name}' expected dtype {_spec.dtype_name(x.dtype)} (the dtype of "
                f"x) or float32 (master weights), got {_spec.dtype_name(w.dtype)}"
            )
    for name, w in given:
        if w.dtype != w_up.dtype:
            _spec.check_dtype_like(op, name, w, "w_up", w_up)
    # E and F from the first projection: the gate's, or the up's without a gate
    first = "w_up" if a.w_gate is None else "w_gate"
    w = getattr(a, first)
    D = x.shape[1]
    ok = w.dim() == 3 and w.shape[2] == D and w.shape[0] == (E or w.shape[0])
    if not ok or w.shape[0] < 1:
        raise ValueError(
            f"{op}: argument '{first}' expected shape ({E or 'E'}, F, {D}) ({where_e}, D of x), "
            f"got {tuple(w.shape)}"
        )
    E, F = w.shape[:2]
    expected = {"w_gate": (E, F, D), "w_up": (E, F, D), "w_down": (E, D, F), "b_gate": (E, F),
                "b_up": (E, F), "b_down": (E, D)}  # fmt: skip
    for name, w in given:
        if w.shape != expected[name]:
            raise ValueError(
                f"{op}: argument '{name}' expected shape {expected[name]} (E, F of {first}, D "
                f"of x), got {tuple(w.shape)}"
            )
    _check_activation(op, a)
    return E, F


def _check_activation(op: str, a: OpInputs) -> None:
    """The activation's options: a known name, ``alpha`` for SiLU only, a positive ``limit``,
    and the gate's options only with a gate."""
    default = a.activation == "silu" and a.alpha == 1.0 and a.limit is None and a.up_offset == 0
    if default and (a.w_gate is not None or a.b_gate is None):
        return  # the common case, checked in a few comparisons
    if a.activation not in ACTIVATIONS:
        raise ValueError(
            f"{op}: argument 'activation' expected one of {', '.join(ACTIVATIONS)}, "
            f"got {a.activation!r}"
        )
    for name in ("alpha", "limit", "up_offset"):
        value = a[name]
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{op}: argument '{name}' expected a finite number, got {value!r}")
    if a.alpha <= 0 or (a.alpha != 1.0 and a.activation != "silu"):
        raise ValueError(
            f"{op}: argument 'alpha' expected a positive slope with activation 'silu' (1.0 "
            f"otherwise), got {a.alpha!r} with {a.activation!r}"
        )
    if a.limit is not None and a.limit <= 0:
        raise ValueError(f"{op}: argument 'limit' expected a positive number, got {a.limit!r}")
    if a.w_gate is None:
        given = [n for n in ("b_gate", "limit") if a[n] is not None]
        given += ["up_offset"] if a.up_offset != 0.0 else []
        if given:
            default = "0.0" if given[0] == "up_offset" else "None"
            raise ValueError(
                f"{op}: argument '{given[0]}' expected {default} for experts without a gate "
                f"(w_gate is None; it applies to the gate), got {_spec.describe(a[given[0]])}"
            )


def example_weights(E: int, F: int, D: int, device, dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Small random ``w_gate``, ``w_up``, ``w_down`` for example inputs."""
    return tuple(
        torch.randn(s, device=device, dtype=dtype) * 0.1 for s in ((E, F, D), (E, F, D), (E, D, F))
    )  # type: ignore[return-value]


def _check_ids(index: Tensor, E: int) -> None:
    """Ids below -1 are an error (ids ``>= E`` and ``-1`` are dropped slots)."""
    if index.numel() == 0 or index.device.type == "meta":
        return
    if type(index) is not torch.Tensor and is_fake(index):  # (a plain tensor is never fake)
        return
    message = (
        f"{OP}: argument 'top_k_index' expected expert ids 0..{E - 1}, or -1 or >= {E} for a "
        f"dropped slot"
    )
    if index.device.type == "cpu":
        if index.min().item() < -1:  # one reduction: a decode step's few ids
            first = index[index < -1][0].item()
            raise ValueError(f"{message}, got {first}")
    else:
        torch._assert_async(~(index < -1).any(), message)


def check_data(a: Inputs) -> None:
    """The check of :func:`check` that reads values: expert ids ``>= -1``."""
    _check_ids(a.top_k_index, a.w_down.shape[0])


def example(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Inputs:
    """Small valid inputs (T, D, F, E, k = 8, 16, 24, 4, 2), for ``cakeops info`` and smoke
    tests: each token's two experts distinct, weights like a renormalised softmax."""
    T, D, F, E, k = 8, 16, 24, 4, 2

    index = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(device)
    weights = torch.softmax(torch.randn(T, k, device=device), dim=-1).to(dtype)
    x = torch.randn(T, D, device=device, dtype=dtype)
    return Inputs(x, index, weights, *example_weights(E, F, D, device, dtype))


def ungated(a: OpInputs) -> bool:
    """Whether the experts have no gate (``h = act(x W_up^T + b_up)``)."""
    return a.w_gate is None


SPEC = OpSpec(
    inputs=Inputs,
    check=check,
    check_data=check_data,
    example=example,
    # output like x; no work without rows, hidden features or slots
    no_work=lambda a: a.x.numel() == 0 or a.top_k_index.shape[1] == 0,
    leading=6,  # the default experts: cakeops::routed_experts_defaults, the six tensors
)


def routed_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.0,
    limit: float | None = None,
    up_offset: float = 0.0,
) -> torch.Tensor:
    """The experts and combine for a given routing: ``out_t = sum_s w_ts y_(t, i_ts)``.

    ``x (T, D)``, ``top_k_index`` and ``top_k_weights (T, k)`` (ids ``>= E``: dropped slots),
    ``w_gate`` (None: no gate) and ``w_up (E, F, D)`` (views of packed, interleaved or
    transposed tensors work, without a copy), ``w_down (E, D, F)``; optional biases ``b_gate``,
    ``b_up (E, F)``, ``b_down (E, D)``; ``h = act(min(gate, limit)) * (clamp(up, ±limit) +
    up_offset)`` with ``act`` in :data:`ACTIVATIONS` (``silu``: ``g * sigmoid(alpha g)``) ->
    ``(T, D)`` in ``x.dtype``. Saves only its inputs; gradients for all but ``top_k_index``.
    """
    return SPEC.call(x, top_k_index, top_k_weights, w_gate, w_up, w_down, b_gate, b_up, b_down,
                     activation, alpha, limit, up_offset)  # fmt: skip
