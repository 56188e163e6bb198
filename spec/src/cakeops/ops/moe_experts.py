"""Spec of ``moe_experts``: the routed SwiGLU expert branch of an MoE layer, dropless.

Routing (float32 always): ``p = softmax(router_logits)`` over all E experts, the ``top_k`` largest
(ties to the lower expert id), ``w = scale * r / sum(r)`` with ``renormalize`` else ``scale * r``.
Expert ``e`` on a row: ``y = (silu(x W_gate[e]^T) * (x W_up[e]^T)) W_down[e]^T``; the output is
``out_t = sum_s w_ts y_(t,s)``: the routing weight is applied once, in the combine.

Kernel signature every backend implements (arguments validated, ``T > 0``)::

    forward(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale) -> out
    backward(g, x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale)
        -> (dx, dlogits, dw_gate, dw_up, dw_down)

Saved-tensor contract: exactly the five inputs; routing, activations and expert outputs are
recomputed in the backward.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

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

OP = "moe_experts"
SAVED = ("x", "router_logits", "w_gate", "w_up", "w_down")
DTYPES = _spec.FLOAT_DTYPES
WEIGHTS = ("w_gate", "w_up", "w_down")


def check_types(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale) -> float:
    """Check the Python types of the arguments; return ``scale`` as a float."""
    for name, value in zip(SAVED, (x, router_logits, w_gate, w_up, w_down), strict=True):
        _spec.check_tensor(OP, name, value)
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"{OP}: argument 'top_k' expected an int, got {_spec.describe(top_k)}")
    if not isinstance(renormalize, bool):
        got = _spec.describe(renormalize)
        raise TypeError(f"{OP}: argument 'renormalize' expected a bool, got {got}")
    return _spec.check_number(OP, "scale", scale)


def validate(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale) -> None:
    """Check every argument (raises ``TypeError``/``ValueError`` naming the argument)."""
    scale = check_types(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale)
    if not math.isfinite(scale):
        raise ValueError(f"{OP}: argument 'scale' expected a finite number, got {scale!r}")
    if x.dim() != 2:
        raise ValueError(
            f"{OP}: argument 'x' expected 2 dimensions (T, D), got shape {tuple(x.shape)}"
        )
    _spec.check_float_dtype(OP, "x", x)
    _spec.check_float_dtype(OP, "router_logits", router_logits)
    for name, w in zip(WEIGHTS, (w_gate, w_up, w_down), strict=True):
        if w.dtype not in (x.dtype, torch.float32):
            raise TypeError(
                f"{OP}: argument '{name}' expected dtype {_spec.dtype_name(x.dtype)} (the dtype of "
                f"x) or float32 (master weights), got {_spec.dtype_name(w.dtype)}"
            )
    _spec.check_dtype_like(OP, "w_up", w_up, "w_gate", w_gate)
    _spec.check_dtype_like(OP, "w_down", w_down, "w_gate", w_gate)
    _spec.check_same_device(
        OP, dict(zip(SAVED, (x, router_logits, w_gate, w_up, w_down), strict=True))
    )
    T, D = x.shape
    if router_logits.dim() != 2 or router_logits.shape[0] != T:
        raise ValueError(
            f"{OP}: argument 'router_logits' expected shape ({T}, E) (T of x), "
            f"got {tuple(router_logits.shape)}"
        )
    E = router_logits.shape[1]
    if E < 1:
        raise ValueError(f"{OP}: argument 'router_logits' expected at least one expert, got E=0")
    if w_gate.dim() != 3 or w_gate.shape[0] != E or w_gate.shape[2] != D:
        raise ValueError(
            f"{OP}: argument 'w_gate' expected shape ({E}, F, {D}) (E of router_logits, D of x), "
            f"got {tuple(w_gate.shape)}"
        )
    F = w_gate.shape[1]
    if w_up.shape != w_gate.shape:
        raise ValueError(
            f"{OP}: argument 'w_up' expected shape {tuple(w_gate.shape)} (the shape of w_gate), "
            f"got {tuple(w_up.shape)}"
        )
    if w_down.shape != (E, D, F):
        raise ValueError(
            f"{OP}: argument 'w_down' expected shape ({E}, {D}, {F}), got {tuple(w_down.shape)}"
        )
    if not 1 <= top_k <= E:
        raise ValueError(f"{OP}: argument 'top_k' expected an int in 1..{E}, got {top_k}")


def _inputs(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale) -> dict[str, Any]:
    return {
        "x": x,
        "router_logits": router_logits,
        "w_gate": w_gate,
        "w_up": w_up,
        "w_down": w_down,
        "top_k": top_k,
        "renormalize": renormalize,
        "scale": scale,
    }


def bind(x, router_logits, w_gate, w_up, w_down, *, top_k, renormalize=True, scale=1.0):
    """Validate a call's arguments and return them as the inputs a backend is asked about."""
    validate(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale)
    return _inputs(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, float(scale))


def example_inputs(
    device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, shape=(8, 16, 24, 4)
) -> dict[str, Any]:
    """Small valid inputs (T, D, F, E), for ``cakeops info`` and smoke tests."""
    T, D, F, E = shape

    def rand(*s):
        return torch.randn(s, device=device, dtype=dtype) * 0.1

    return {
        "x": rand(T, D),
        "router_logits": torch.randn(T, E, device=device),
        "w_gate": rand(E, F, D),
        "w_up": rand(E, F, D),
        "w_down": rand(E, D, F),
        "top_k": 2,
    }


@torch.library.custom_op("cakeops::moe_experts", mutates_args=())
def _forward_op(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scale: float,
) -> torch.Tensor:
    args = (x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale)
    validate(*args)
    if x.shape[0] == 0:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    backend = pick(OP, _inputs(*args))
    return checked(OP, backend, "out", run_kernel(backend, OP, "forward", *args), x)


@_forward_op.register_fake
def _(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale):
    validate(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _empty_grads(x, router_logits, w_gate, w_up, w_down):
    return (
        torch.empty(x.shape, dtype=x.dtype, device=x.device),
        torch.empty(router_logits.shape, dtype=router_logits.dtype, device=x.device),
        *(torch.zeros(w.shape, dtype=w.dtype, device=w.device) for w in (w_gate, w_up, w_down)),
    )


@torch.library.custom_op("cakeops::moe_experts_backward", mutates_args=())
def _backward_op(
    g: torch.Tensor,
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``backend``: the preference in force at the forward ("" for the automatic choice)."""
    args = (x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale)
    validate(*args)
    _spec.check_tensor(OP, "grad_output", g)
    if g.shape != x.shape or g.dtype != x.dtype:
        raise ValueError(
            f"{OP}: argument 'grad_output' expected {_spec.dtype_name(x.dtype)} of shape "
            f"{tuple(x.shape)}, got {_spec.describe(g)}"
        )
    if x.shape[0] == 0:
        return _empty_grads(x, router_logits, w_gate, w_up, w_down)
    chosen = pick(OP, _inputs(*args), backend)
    grads = run_kernel(chosen, OP, "backward", g.contiguous(), *args)
    names = ("dx", "drouter_logits", "dw_gate", "dw_up", "dw_down")
    likes = (x, router_logits, w_gate, w_up, w_down)
    return tuple(
        checked(OP, chosen, name, grad, like)
        for name, grad, like in zip(names, grads, likes, strict=True)
    )


@_backward_op.register_fake
def _(g, x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale, backend):
    validate(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale)
    return _empty_grads(x, router_logits, w_gate, w_up, w_down)


def _setup_context(ctx, inputs, output) -> None:
    x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale = inputs
    ctx.save_for_backward(x, router_logits, w_gate, w_up, w_down)
    ctx.params = (top_k, renormalize, scale)
    ctx.backend = backward_preference(OP)


def _backward(ctx, grad):
    grads = apply(
        _BackwardFunction, _backward_op, grad, *ctx.saved_tensors, *ctx.params, ctx.backend
    )
    return (*grads, None, None, None)


_forward_op.register_autograd(_backward, setup_context=_setup_context)
_Function = autograd_function(OP, _setup_context, _backward)
_BackwardFunction = backward_function(OP)


def moe_experts(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    top_k: int,
    renormalize: bool = True,
    scale: float = 1.0,
) -> torch.Tensor:
    """The routed SwiGLU experts of an MoE layer: softmax top-k routing, dispatch, experts, combine.

    ``x (T, D)``, ``router_logits (T, E)``, ``w_gate`` and ``w_up (E, F, D)``, ``w_down (E, D, F)``
    (``nn.Linear`` layout) -> ``(T, D)`` in ``x.dtype``. Weights may be float32 while ``x`` is
    16-bit. Saves only the five inputs; gradients flow to all of them.
    """
    scale = check_types(x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale)
    _spec.check_no_forward_ad(
        OP, dict(zip(SAVED, (x, router_logits, w_gate, w_up, w_down), strict=True))
    )
    return apply(
        _Function, _forward_op, x, router_logits, w_gate, w_up, w_down, top_k, renormalize, scale
    )


# --------------------------------------------------------------------------------------------
# Routing helpers for backends: the spec owns the routing rules, so every backend shares them.


class Routing(NamedTuple):
    probs: torch.Tensor  # (T, E) softmax
    experts: torch.Tensor  # (T, k) selected experts, ties to the lower id
    r: torch.Tensor  # (T, k) probabilities of the selected experts
    weights: torch.Tensor  # (T, k) combine weights
    order: torch.Tensor  # (T * k,) flat (token, slot) indices sorted by expert
    token: torch.Tensor  # (T * k,) token of each sorted row
    offsets: torch.Tensor  # (E + 1,) int64: rows of expert e are order[offsets[e]:offsets[e + 1]]

    @property
    def bounds(self) -> list[int]:
        """``offsets`` on the host (a device synchronisation: for backends that loop there)."""
        return self.offsets.tolist()


def route(router_logits, top_k, renormalize, scale, dtype=torch.float32) -> Routing:
    """Experts chosen on the float32 softmax (ties to the lower id); probabilities and weights
    in ``dtype`` (float64 for float64 inputs)."""
    probs32 = torch.softmax(router_logits.float(), dim=-1)
    experts = torch.sort(probs32, dim=-1, descending=True, stable=True).indices[:, :top_k]
    probs = probs32 if dtype == torch.float32 else torch.softmax(router_logits.to(dtype), dim=-1)
    r = probs.gather(1, experts)
    weights = r / r.sum(-1, keepdim=True) if renormalize else r
    flat = experts.flatten()
    by_expert, order = torch.sort(flat, stable=True)
    # each expert's first sorted row (no bincount: its output size would wait for the device)
    ids = torch.arange(probs.shape[1] + 1, device=flat.device, dtype=flat.dtype)
    offsets = torch.searchsorted(by_expert, ids)
    return Routing(probs, experts, r, weights * scale, order, order // top_k, offsets)


def routing_backward(routing: Routing, dweights, renormalize, scale):
    """Logits gradient from ``dL/dw_ts``: through the renormalisation, the top-k gather and the
    softmax over all E experts."""
    r = routing.r.to(dweights.dtype)
    if renormalize:
        total = r.sum(-1, keepdim=True)
        # r / total is exactly 1 with one expert per token, so that gradient is exactly 0
        dr = scale * (dweights - (dweights * (r / total)).sum(-1, keepdim=True)) / total
    else:
        dr = scale * dweights
    p = routing.probs.to(dweights.dtype)
    if renormalize:
        # sum_e p_e dp_e = sum_s r_s dr_s is exactly 0 here (the weights do not change with a
        # common factor on r): the selected experts get r * dr and the others exact zeros,
        # whatever the other probabilities are (NaN included).
        return torch.zeros_like(p).scatter_(1, routing.experts, r * dr)
    dp = torch.zeros_like(p).scatter_(1, routing.experts, dr)
    return p * (dp - (p * dp).sum(-1, keepdim=True))


def row_weights(routing: Routing) -> torch.Tensor:
    """The combine weight ``w_ts`` of each sorted row, ``(T * k,)``."""
    return routing.weights.flatten()[routing.order]


def slot_sum(slots: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``(T * k, D)`` rows in ``(token, slot)`` order summed over each token's slots, in slot
    order (deterministic: no ``index_add_``)."""
    T, k = routing.weights.shape
    return slots.view(T, k, -1).sum(1)


def combine(y_sorted: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``out_t = sum_s w_ts y_(t,s)`` from expert outputs in sorted-row order, summed over each
    token's slots in slot order (deterministic: no ``index_add_``)."""
    slots = torch.empty_like(y_sorted)
    slots[routing.order] = y_sorted
    T, k = routing.weights.shape
    return (slots.view(T, k, -1) * routing.weights.to(slots.dtype).unsqueeze(-1)).sum(1)


def dispatch_backward(dx_sorted: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The input gradient from each sorted row's gradient: a token's copies summed in slot
    order, with no second routing-weight factor."""
    slots = torch.empty_like(dx_sorted)
    slots[routing.order] = dx_sorted
    return slot_sum(slots, routing)


class SwiGLUGrads(NamedTuple):
    h: torch.Tensor  # (rows, F) silu(gate) * up, the down projection's input
    dweights: torch.Tensor  # (T, k) dL/dw_ts = <y_ts, g_t>
    d_gate: torch.Tensor  # (rows, F) gradient at the gate pre-activation
    d_up: torch.Tensor  # (rows, F) gradient at the up pre-activation


def swiglu_backward(hg: torch.Tensor, hu: torch.Tensor, u: torch.Tensor, routing: Routing):
    """The SwiGLU's part of the backward, per sorted row, from the recomputed gate and up
    pre-activations ``hg``, ``hu`` and ``u = g_t W_down[e]`` (float32, consumed in place).

    ``<y, g> = <h W_down^T, g> = <h, u>``, so the expert output is never recomputed; the routing
    weight multiplies ``u`` once."""
    sig = torch.sigmoid(hg)
    gate = hg * sig
    h = gate * hu
    dweights = torch.empty(routing.order.numel(), dtype=u.dtype, device=u.device)
    dweights[routing.order] = (h * u).sum(-1)
    dh = u.mul_(row_weights(routing).to(u.dtype).unsqueeze(-1))
    d_up = dh * gate
    d_gate = dh.mul_(hu).mul_(sig.mul_(hg.mul_(1 - sig).add_(1)))  # dh * hu * silu'(hg)
    return SwiGLUGrads(h, dweights.view_as(routing.weights), d_gate, d_up)


def row_tiles(routing: Routing, block: int) -> tuple[torch.Tensor, ...]:
    """For grouped-GEMM kernels over the sorted rows: each row tile's expert and first row (tiles
    of ``block`` rows, never spanning two experts), and each expert's row range
    ``(tile_expert, tile_row, starts, ends)``, int64 on the routing's device.

    Built without waiting for the device: the tables have ``ceil(rows / block) + E`` entries, an
    upper bound on the tile count, and the tiles past the last real one start at row ``rows``
    (beyond every expert's end, so a kernel masks or skips them)."""
    offsets = routing.offsets
    E, rows = offsets.numel() - 1, routing.order.numel()
    starts, ends = offsets[:-1], offsets[1:]
    tiles = (ends - starts + block - 1) // block
    last = torch.cumsum(tiles, 0)
    index = torch.arange((rows + block - 1) // block + E, device=offsets.device)
    tile_expert = torch.searchsorted(last, index, right=True).clamp_(max=E - 1)
    within = index - (last - tiles)[tile_expert]
    tile_row = torch.where(within < tiles[tile_expert], starts[tile_expert] + within * block, rows)
    return tile_expert, tile_row, starts, ends
