"""``moe_experts`` and ``routed_experts``: the spec owns the routing rules, so every backend
shares them: the routing (:func:`route`, :class:`Routing`), its backward
(:func:`routing_backward`), sorted-row bookkeeping (:func:`row_weights`, :func:`row_tiles`),
the combine and the dispatch backward (:func:`combine`, :func:`weighted_slot_sum`,
:func:`slot_sum`, :func:`dispatch_backward`), the SwiGLU backward (:func:`swiglu_backward`),
every other activation the experts take (:class:`Activation`), the experts' weights
(:class:`ExpertWeights`) and dropped slots (:func:`kept_rows`)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


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


def kept_rows(routing: Routing) -> torch.Tensor:
    """``(T * k, 1)`` bool: which sorted rows belong to an expert (``routed_experts``' ids
    ``>= E`` are dropped slots, sorted last, past ``offsets[E]``). A device mask, no
    synchronisation."""
    rows = torch.arange(routing.order.numel(), device=routing.order.device)
    return (rows < routing.offsets[-1]).unsqueeze(-1)


def row_experts(routing: Routing) -> torch.Tensor:
    """The expert of each sorted row, ``(T * k,)`` (a dropped row takes the last expert's id:
    callers leave those rows out, :func:`kept_rows`)."""
    E = routing.offsets.numel() - 1
    return routing.experts.flatten()[routing.order].clamp(max=E - 1)


def down_bias_dots(g: torch.Tensor, b_down: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``<b_down[e], g_t>`` of each sorted row, float32 ``(T * k,)``, zero for dropped rows: the
    down projection's bias's share of ``dL/dw_ts = <y_ts, g_t>``."""
    dots = (g.float()[routing.token] * b_down.float()[row_experts(routing)]).sum(-1)
    return dots.masked_fill(~kept_rows(routing).squeeze(-1), 0)


def top_k_choice(router_logits, top_k, renormalize, scale, dtype=torch.float32):
    """``(probs, experts, r, weights)`` of the routing rules, without the sort by expert that
    :func:`route` adds: experts chosen on the float32 softmax (ties to the lower id),
    probabilities and weights in ``dtype`` (float64 for float64 inputs). A decode step's few
    rows need no more."""
    probs32 = torch.softmax(router_logits.float(), dim=-1)
    experts = torch.sort(probs32, dim=-1, descending=True, stable=True).indices[:, :top_k]
    probs = probs32 if dtype == torch.float32 else torch.softmax(router_logits.to(dtype), dim=-1)
    r = probs.gather(1, experts)
    weights = r / r.sum(-1, keepdim=True) if renormalize else r
    return probs, experts, r, weights * scale


def route(router_logits, top_k, renormalize, scale, dtype=torch.float32) -> Routing:
    """The :class:`Routing` of the routing rules (:func:`top_k_choice`), rows sorted by
    expert."""
    probs, experts, r, weights = top_k_choice(router_logits, top_k, renormalize, scale, dtype)
    return given_routing(experts, weights, probs.shape[1])._replace(probs=probs, r=r)


def given_routing(experts: torch.Tensor, weights: torch.Tensor, num_experts: int) -> Routing:
    """The :class:`Routing` of experts and combine weights chosen elsewhere (``routed_experts``):
    rows sorted by expert, stable (no ``probs`` or ``r``: their backward is the caller's). A
    dropped slot (an id ``>= num_experts``, or ``-1``: taken as ``num_experts``, so that it sorts
    last) has weight 0, whatever was given (a NaN there must not reach anything)."""
    experts = experts.masked_fill(experts < 0, num_experts)
    weights = weights.masked_fill(experts >= num_experts, 0)
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
    """:func:`weighted_slot_sum` of expert outputs given in sorted-row order (dropped rows,
    whatever they hold, add nothing)."""
    slots = torch.empty_like(y_sorted)
    slots[routing.order] = y_sorted.masked_fill(~kept_rows(routing), 0)
    return weighted_slot_sum(slots, routing)


def dispatch_backward(dx_sorted: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The input gradient from each sorted row's gradient: a token's copies summed in slot
    order, with no second routing-weight factor (dropped rows add nothing)."""
    slots = torch.empty_like(dx_sorted)
    slots[routing.order] = dx_sorted.masked_fill(~kept_rows(routing), 0)
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


def swiglu_backward(hg: torch.Tensor, hu: torch.Tensor, u: torch.Tensor, routing: Routing,
                    activation: Activation | None = None):  # fmt: skip
    """:func:`swiglu_rows` (or ``activation.rows``) over every sorted row, with ``dL/dw_ts`` put
    in ``(T, k)`` order (zero for dropped slots)."""
    w = row_weights(routing).to(u.dtype).unsqueeze(-1)
    if activation is None or activation.is_swiglu:
        h, dot, d_gate, d_up = swiglu_rows(hg, hu, u, w)
    else:
        h, dot, d_gate, d_up = activation.rows(hg, hu, u, w)
    dweights = torch.empty(routing.order.numel(), dtype=u.dtype, device=u.device)
    dweights[routing.order] = dot.masked_fill(~kept_rows(routing).squeeze(-1), 0)
    return SwiGLUGrads(h, dweights.view_as(routing.weights), d_gate, d_up)


_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


class Activation(NamedTuple):
    """The experts' activation (the spec's ``activation``, ``alpha``, ``limit``, ``up_offset``
    and whether there is a gate): ``h = act(min(gate, L)) * (clamp(up, -L, L) + up_offset)``,
    or ``act(up)`` without a gate. Its forward and backward on float32 (or float64) blocks."""

    name: str = "silu"
    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0
    gated: bool = True

    @property
    def is_swiglu(self) -> bool:
        """The default: ``silu(gate) * up`` (the backends' fused fast path)."""
        return self == Activation()

    def act(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(act(g), act'(g))``."""
        if self.name == "silu":
            sig = torch.sigmoid(self.alpha * g)
            return g * sig, sig * (1 + self.alpha * g * (1 - sig))
        if self.name == "gelu":
            cdf = 0.5 * (1 + torch.erf(g * math.sqrt(0.5)))
            return g * cdf, cdf + g * torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
        if self.name == "gelu_tanh":
            inner = _SQRT_2_OVER_PI * (g + 0.044715 * g**3)
            th = torch.tanh(inner)
            d_inner = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * g * g)
            return 0.5 * g * (1 + th), 0.5 * (1 + th) + 0.5 * g * (1 - th * th) * d_inner
        positive = torch.relu(g)
        if self.name == "relu":
            return positive, (g > 0).to(g.dtype)
        return positive * positive, 2 * positive  # relu2

    def _clamped(self, hg: torch.Tensor, hu: torch.Tensor):
        """``(gate, up, gate's mask, up's mask)`` after the limit (masks: where the gradient
        passes, as ``torch.clamp``'s, bounds included; None without a limit)."""
        L = self.limit
        if L is None:
            return hg, hu, None, None
        return hg.clamp(max=L), hu.clamp(-L, L), hg <= L, (hu >= -L) & (hu <= L)

    def value(self, g: torch.Tensor) -> torch.Tensor:
        """``act(g)`` alone (the forward's: :meth:`act` less its derivative, in PyTorch's own
        fused activations where there is one)."""
        if self.name == "silu":
            return F.silu(g) if self.alpha == 1.0 else g * torch.sigmoid(self.alpha * g)
        if self.name == "gelu":
            return F.gelu(g)
        if self.name == "gelu_tanh":
            return F.gelu(g, approximate="tanh")
        positive = torch.relu(g)
        return positive if self.name == "relu" else positive * positive  # relu2

    def forward(self, hg: torch.Tensor | None, hu: torch.Tensor) -> torch.Tensor:
        """``h`` from the gate and up pre-activations (``hg`` None without a gate): no masks,
        no derivatives (a decode step's experts pay each op)."""
        if not self.gated:
            return self.value(hu)
        L = self.limit
        if L is not None:
            hg, hu = hg.clamp(max=L), hu.clamp(-L, L)
        h = self.value(hg)
        return h.mul_(hu + self.up_offset) if self.up_offset else h.mul_(hu)

    def rows(self, hg, hu, u, w):
        """:func:`swiglu_rows` for this activation: ``(h, <h, u> per row, d_gate, d_up)``
        (``d_gate`` None without a gate); ``u = g_t W_down[e]``, ``w`` the rows' combine
        weights ``(rows, 1)``."""
        dh = u * w
        if not self.gated:
            a, da = self.act(hu)
            return a, (a * u).sum(-1), None, dh * da
        gate, up, mask_g, mask_u = self._clamped(hg, hu)
        a, da = self.act(gate)
        up = up + self.up_offset
        h = a * up
        d_gate, d_up = dh * up * da, dh * a
        if mask_g is not None:
            d_gate, d_up = torch.where(mask_g, d_gate, 0), torch.where(mask_u, d_up, 0)
        return h, (h * u).sum(-1), d_gate, d_up


class ExpertWeights(NamedTuple):
    """An expert op's weights, biases (None where not given) and activation, from its kernel
    arguments ``w_gate, w_up, w_down, b_gate, b_up, b_down, activation, alpha, limit,
    up_offset``."""

    w_gate: torch.Tensor | None
    w_up: torch.Tensor
    w_down: torch.Tensor
    b_gate: torch.Tensor | None
    b_up: torch.Tensor | None
    b_down: torch.Tensor | None
    activation: Activation

    @classmethod
    def of(cls, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, activation="silu",
           alpha=1.0, limit=None, up_offset=0.0) -> ExpertWeights:  # fmt: skip
        act = Activation(activation, alpha, limit, up_offset, w_gate is not None)
        return cls(w_gate, w_up, w_down, b_gate, b_up, b_down, act)

    @property
    def is_swiglu(self) -> bool:
        """The default experts: SiLU-gated, no biases (the backends' fused fast path)."""
        no_bias = self.b_gate is None and self.b_up is None and self.b_down is None
        return no_bias and self.activation.is_swiglu

    @property
    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The six tensors, in argument order (the order of their gradients)."""
        return self[:6]


def gate_up_pair(gate: torch.Tensor | None, up: torch.Tensor | None):
    """``(packed, gate's index, up's index)`` when ``gate`` and ``up`` (weights ``(E, F, D)``
    or biases ``(E, F)``) are two views of one packed tensor along dim 1 whose rows are gate then
    up (Hugging Face's concatenated ``gate_up_proj``: ``packed[:, :F]`` and ``[:, F:]``) or
    alternate (its interleaved one, gpt-oss's: ``packed[:, 0::2]`` and ``[:, 1::2]``); else
    None. ``packed`` is a view, ``(E, 2F, ...)``; the indices select each along its last dim
    of a product's output. One product with it replaces two: a small call's cost is its
    products' count."""
    if gate is None or up is None or gate.shape != up.shape or gate.stride() != up.stride():
        return None
    if gate.numel() == 0 or gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr():
        return None
    E, F = gate.shape[:2]
    strides, offset, step = list(gate.stride()), gate.storage_offset(), gate.stride(1)
    if up.storage_offset() == offset + F * step:  # the halves
        index: tuple[slice, slice] = (slice(0, F), slice(F, 2 * F))
    elif step % 2 == 0 and up.storage_offset() == offset + step // 2:  # interleaved
        strides[1], index = step // 2, (slice(0, None, 2), slice(1, None, 2))
    else:
        return None
    packed = gate.as_strided((E, 2 * F, *gate.shape[2:]), strides, offset)
    return packed, *index


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
