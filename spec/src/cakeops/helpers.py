"""Helpers for backend authors: each piece of math the spec owns that several backends need,
written once here (the conformance guide names this module).

- ``moe_experts``: the routing rules (:func:`route`, :class:`Routing`), their backward
  (:func:`routing_backward`), sorted-row bookkeeping (:func:`row_weights`, :func:`row_tiles`),
  the combine and the dispatch backward (:func:`combine`, :func:`weighted_slot_sum`,
  :func:`slot_sum`, :func:`dispatch_backward`) and the SwiGLU backward (:func:`swiglu_backward`);
- ``causal_dot_product``: the backward as three causal scans (:func:`backward_by_scans`);
- every op: :func:`cast_grads` (each gradient in its input's dtype) and
  :func:`cakeops.compute_dtype` (the precision to compute in).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cakeops._spec import compute_dtype

__all__ = [
    "Routing",
    "SwiGLUGrads",
    "backward_by_scans",
    "cast_grads",
    "combine",
    "compute_dtype",
    "dispatch_backward",
    "given_routing",
    "route",
    "routing_backward",
    "row_tiles",
    "row_weights",
    "slot_sum",
    "swiglu_backward",
    "swiglu_rows",
    "weighted_slot_sum",
]


def cast_grads(grads, inputs) -> tuple[torch.Tensor, ...]:
    """Each gradient in the dtype of the input it belongs to (a no-op where it already is)."""
    return tuple(g.to(t.dtype) for g, t in zip(grads, inputs, strict=True))


# --------------------------------------------------------------------------------------------
# causal_dot_product


def backward_by_scans(scan, g, q, k, v):
    """``(dq, dk, dv)`` as three runs of a causal scan ``scan(a, b, c, reverse)``, which computes
    ``out_i = sum_{j <= i} (a_i . b_j) c_j`` (``j >= i`` with ``reverse``): ``dq = (g, v, k)``
    forward in time, ``dk = (v, g, q)`` and ``dv = (k, q, g)`` in reverse."""
    dq = scan(g, v, k, False)  # dq_i = sum_{j<=i} (g_i . v_j) k_j
    dk = scan(v, g, q, True)  # dk_j = sum_{i>=j} (v_j . g_i) q_i
    dv = scan(k, q, g, True)  # dv_j = sum_{i>=j} (k_j . q_i) g_i
    return cast_grads((dq, dk, dv), (q, k, v))


# --------------------------------------------------------------------------------------------
# moe_experts: the spec owns the routing rules, so every backend shares them.


class Routing(NamedTuple):
    probs: torch.Tensor  # (T, E) softmax (None for a routing given by the caller)
    experts: torch.Tensor  # (T, k) selected experts, ties to the lower id
    r: torch.Tensor  # (T, k) probabilities of the selected experts (None when given)
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
    return given_routing(experts, weights * scale, probs.shape[1])._replace(probs=probs, r=r)


def given_routing(experts: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Routing:
    """The :class:`Routing` of experts and combine weights chosen elsewhere (``routed_experts``):
    rows sorted by expert, stable (no ``probs`` or ``r``: their backward is the caller's)."""
    flat = experts.flatten()
    by_expert, order = torch.sort(flat, stable=True)
    # each expert's first sorted row (no bincount: its output size would wait for the device)
    ids = torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype)
    offsets = torch.searchsorted(by_expert, ids)
    top_k = max(1, experts.shape[1])
    return Routing(None, experts, None, weights, order, order // top_k, offsets)  # type: ignore[arg-type]


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


def weighted_slot_sum(slots: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``out_t = sum_s w_ts slots_(t,s)`` from ``(T * k, D)`` rows in ``(token, slot)`` order,
    summed over each token's slots in slot order (deterministic: no ``index_add_``), with no
    ``(T, k, D)`` product."""
    T, k = routing.weights.shape  # k >= 1: the ops' no_work takes k = 0
    by_slot = slots.view(T, k, -1)
    w = routing.weights.to(slots.dtype).unsqueeze(-1)
    out = by_slot[:, 0] * w[:, 0]
    for j in range(1, k):
        out.addcmul_(by_slot[:, j], w[:, j])
    return out


def combine(y_sorted: torch.Tensor, routing: Routing) -> torch.Tensor:
    """:func:`weighted_slot_sum` of expert outputs given in sorted-row order."""
    slots = torch.empty_like(y_sorted)
    slots[routing.order] = y_sorted
    return weighted_slot_sum(slots, routing)


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


def swiglu_rows(hg: torch.Tensor, hu: torch.Tensor, u: torch.Tensor, w: torch.Tensor):
    """The SwiGLU's part of the backward for a block of rows with combine weights ``w``
    ``(rows, 1)``, from the recomputed gate and up pre-activations ``hg``, ``hu`` and
    ``u = g_t W_down[e]`` (float32, consumed in place): ``(h, <h, u> per row, d_gate, d_up)``.

    ``<y, g> = <h W_down^T, g> = <h, u>``, so the expert output is never recomputed; the routing
    weight multiplies ``u`` once."""
    sig = torch.sigmoid(hg)
    gate = hg * sig
    h = gate * hu
    dot = (h * u).sum(-1)
    dh = u.mul_(w)
    d_up = dh * gate
    d_gate = dh.mul_(hu).mul_(sig.mul_(hg.mul_(1 - sig).add_(1)))  # dh * hu * silu'(hg)
    return h, dot, d_gate, d_up


def swiglu_backward(hg: torch.Tensor, hu: torch.Tensor, u: torch.Tensor, routing: Routing):
    """:func:`swiglu_rows` over every sorted row, with ``dL/dw_ts`` put in ``(T, k)`` order."""
    w = row_weights(routing).to(u.dtype).unsqueeze(-1)
    h, dot, d_gate, d_up = swiglu_rows(hg, hu, u, w)
    dweights = torch.empty(routing.order.numel(), dtype=u.dtype, device=u.device)
    dweights[routing.order] = dot
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
