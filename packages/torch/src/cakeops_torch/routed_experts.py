"""The routed experts in plain PyTorch, for a given routing: sorted, dropless, deterministic
(``moe_experts`` is the spec's routing followed by these).

The (token, slot) pairs are sorted by expert once; each expert then runs one grouped pass over its
own rows, gathered block by block (no dense all-experts compute, no padding to a capacity, no
``(T * top_k, D)`` copy of the input). Each block's outputs go straight to their (token, slot)
places; the combine sums a token's slots in slot order, and the dispatch backward sums each
token's copies the same way: no ``index_add_``, no atomics. The backward recomputes the gate/up
projections; experts that received no token keep exact zero gradients.

Matmuls run in the input dtype with float32 accumulation on accelerators and, for bfloat16, on
CPUs that multiply it natively (:func:`native_bf16_cpu`); in float32 for other 16-bit inputs on a
CPU (weights cast per expert, on the fly) and with float32 master weights. In the per-expert
backward the recomputed gate and up projections and ``u = g W_down`` run in float32 always: they
give the routing weights' gradient, which keeps float32 accuracy.

Where ``torch._grouped_mm`` exists and takes the inputs (weights in the matmul dtype, views of a
packed gate/up tensor included, so no weight copy; rows and strides 16-byte aligned; float32 on
the CPU, bfloat16 on CUDA), each projection of a run of experts is one grouped matmul over their
sorted rows instead of one matmul per expert. The runs hold at most ``GROUP_ELEMENTS`` elements
of the widest temporary, so memory stays bounded like the loop's. Anywhere else the per-expert
loop runs. On a CPU the SwiGLU part of the backward of a big block is one inductor-compiled loop
(:mod:`cakeops_torch._compile`).

Every expert form (biases, another activation, a limit or offset, no gate:
:class:`cakeops.helpers.ExpertWeights`) takes those paths, with
:class:`cakeops.helpers.Activation`; gate and up weights that are views of one packed tensor
(halves or interleaved) take one product for both. Calls of a few rows on a CPU go slot by slot
(:func:`few_rows_forward`) or through two padded ``bmm`` (:func:`_padded_forward`). Slots with
ids ``>= E`` or ``-1`` (dropped) are zeros in the combine and get zero gradients.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from cakeops import compute_dtype
from cakeops.helpers import (
    ExpertWeights,
    Routing,
    as_dtype,
    cast_grads,
    combine,
    gate_up_pair,
    given_routing,
    index_tensor,
    row_weights,
    slot_sum,
    swiglu_rows,
    weighted_slot_sum,
)
from cakeops_torch._compile import FAILED, run_compiled, use_compiled


@functools.cache
def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): oneDNN's bfloat16
    GEMMs, float32 accumulation, then run about three times faster than float32 ones (measured:
    ``nox -s bench``). Elsewhere bfloat16 products are emulated, slower than float32."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def _mm_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The products' dtype: the inputs' own on accelerators and, for bfloat16, on CPUs that
    multiply it natively; float32 for other 16-bit inputs on a CPU and with float32 master
    weights (so every weight gradient keeps float32 accuracy)."""
    if w.dtype != x.dtype or x.dtype == torch.float64:
        return torch.promote_types(x.dtype, w.dtype)
    if x.device.type != "cpu":
        return x.dtype
    return x.dtype if x.dtype == torch.bfloat16 and native_bf16_cpu() else torch.float32


GROUP_ELEMENTS = 1 << 21
#: From this many elements of a block's ``(rows, F)`` projections the SwiGLU backward on a CPU
#: is one inductor-compiled loop (:func:`_fused_swiglu`) instead of a dozen eager passes.
COMPILE_MIN_ELEMENTS = 1 << 16


def _fused_swiglu(hg, hu, u, w):
    """:func:`cakeops.helpers.swiglu_rows` as one expression, for inductor to fuse into one
    loop (the eager version makes a dozen passes over blocks bigger than the caches)."""
    sig = torch.sigmoid(hg)
    gate = hg * sig
    h = gate * hu
    dh = u * w
    return h, (h * u).sum(-1), dh * hu * (sig * (1 + hg * (1 - sig))), dh * gate


def _swiglu(hg, hu, u, w):
    """``(h, <h, u> per row, d_gate, d_up)`` of :func:`cakeops.helpers.swiglu_rows`, compiled
    on a CPU for big blocks."""
    if use_compiled(hg, COMPILE_MIN_ELEMENTS):
        fused = run_compiled("moe_experts", _fused_swiglu, hg, hu, u, w)
        if fused is not FAILED:
            return fused
    return swiglu_rows(hg, hu, u, w)


def _experts(bounds: list[int]):
    """``(e, start, end)`` for every expert that received rows (``bounds``: the routing's
    offsets on the host, read once per call)."""
    for e in range(len(bounds) - 1):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            yield e, start, end


#: The dtype ``torch._grouped_mm`` takes on each device type.
_GROUPED_DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}


def _grouped(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands as they are: views of a packed
    ``(E, 2F, D)`` gate/up tensor qualify, only their strides must be aligned."""
    dtype = x.dtype
    if _GROUPED_DTYPE.get(x.device.type) is not dtype or not hasattr(torch, "_grouped_mm"):
        return False
    align = 16 // x.element_size()
    D, F = x.shape[1], weights[0].shape[1]
    if not D or not F or D % align or F % align:
        return False
    for w in weights:
        *lead, last = w.stride()
        if w.dtype is not dtype or last != 1 or any(st % align for st in lead):
            return False
    return True


#: Experts without rows a run takes in between two with rows rather than end: on a CPU a grouped
#: matmul's group costs little, an empty one too, and a run's own ops (its offsets, its rows'
#: gather, two grouped matmuls, the activation) far more (a decode step's 16 rows over 8 experts
#: ran 3 runs of 6 grouped matmuls: now one run of 2). (The backward's weight
#: gradients, one output matrix per group, are grouped over the run's experts with rows only.)
EMPTY_GAP = 8


def _runs(routing: Routing, bounds: list[int], width: int):
    """Runs of consecutive experts ``(e0, e1, start, end, offs)``: rows ``start:end`` belong to
    experts ``e0..e1-1``, ``offs`` their end offsets relative to ``start`` (int32), at most
    ``GROUP_ELEMENTS`` elements of ``(rows, width)`` per run (a bigger expert runs alone). A run
    starts and ends with an expert that received rows, and takes at most ``EMPTY_GAP`` experts
    without rows in between: a grouped matmul costs per group, and the cost must follow the
    experts used, not ``E``."""
    E = len(bounds) - 1
    e0 = 0
    while e0 < E:
        if bounds[e0 + 1] == bounds[e0]:
            e0 += 1
            continue
        e1 = e0 + 1
        while e1 < E:
            nxt = e1  # the next expert with rows, within the gap
            while nxt < E and nxt - e1 < EMPTY_GAP and bounds[nxt + 1] == bounds[nxt]:
                nxt += 1
            if nxt == E or bounds[nxt + 1] == bounds[nxt]:
                break
            if (bounds[nxt + 1] - bounds[e0]) * width > GROUP_ELEMENTS:
                break
            e1 = nxt + 1
        start, end = bounds[e0], bounds[e1]
        offs = torch.tensor(bounds[e0 + 1 : e1 + 1], dtype=torch.int32) - start
        yield e0, e1, start, end, offs.to(routing.order.device)
        e0 = e1


def _rows(t: torch.Tensor, routing: Routing, s: int, e: int) -> torch.Tensor:
    """The dispatch of sorted rows ``s:e``: their tokens' rows of ``t``, gathered per block so
    that no ``(T * k, D)`` copy is made (one that size is a fresh mapping on every step, its
    page faults costing more than the gather)."""
    return t.index_select(0, routing.token[s:e])


def _bias(b: torch.Tensor | None, e: int, dtype: torch.dtype):
    """Expert ``e``'s bias in ``dtype`` (0 when there is none)."""
    return 0 if b is None else b[e].to(dtype)


def _drop(t: torch.Tensor, routing: Routing, dropped: int) -> None:
    """Zero the ``(token, slot)`` places of the dropped slots (ids ``>= E``, sorted last)."""
    if dropped:
        t[routing.order[-dropped:]] = 0


def _swiglu_products(rows, pair, ew: ExpertWeights, experts: slice, product, acc):
    """The default experts' three projections of ``rows`` by experts ``experts``, each
    ``product(a, w)``: ``a`` times every expert's ``w`` transposed (a grouped matmul over sorted
    rows, or ``bmm`` over padded ones); gate and up in one product where they are views of one
    packed tensor (``pair``: the call's :func:`_gate_up`, halves or interleaved), the SiLU gate
    in ``acc``, the down projection's input and output in ``rows``' dtype."""
    if pair:  # one product for both
        hgu = as_dtype(product(rows, pair[0][experts]), acc)
        hg, hu = hgu[..., pair[2]], hgu[..., pair[3]]
    else:
        hg = as_dtype(product(rows, ew.w_gate[experts]), acc)
        hu = as_dtype(product(rows, ew.w_up[experts]), acc)
    return product(as_dtype(F.silu(hg).mul_(hu), rows.dtype), ew.w_down[experts])


def _general_products(rows, ew: ExpertWeights, experts: slice | int, product, acc, pair):
    """:func:`_swiglu_products` for any expert form (biases, the activations, the limit):
    ``product(a, w, b)`` is ``a`` times every expert's ``w`` transposed plus its bias ``b``
    (None: none), in ``acc``; ``experts`` a slice (padded rows, ``(experts, m, D)``) or one
    expert's index (its rows, ``(m, D)``); ``pair`` the call's :func:`_gate_up`. The output in
    ``acc``."""

    def bias(b):
        return None if b is None else b[experts]

    act = ew.activation
    if pair:  # one product for both (gpt-oss's interleaved gate_up_proj too)
        w, b, gate, up = pair
        y = product(rows, w[experts], bias(b))
        hg, hu = y[..., gate], y[..., up]
    else:
        hu = product(rows, ew.w_up[experts], bias(ew.b_up))
        hg = product(rows, ew.w_gate[experts], bias(ew.b_gate)) if act.gated else None
    h = as_dtype(act.forward(hg, hu), rows.dtype)
    return product(h, ew.w_down[experts], bias(ew.b_down))


def _gate_up(ew: ExpertWeights):
    """``(packed weights, packed biases or None, gate's index, up's index)`` where the gate and
    up projections (and their biases, if any) are views of one packed tensor each, packed the
    same way (:func:`cakeops.helpers.gate_up_pair`); else ``()`` (no gate among them)."""
    weights = gate_up_pair(ew.w_gate, ew.w_up)
    if weights is None:
        return ()
    if ew.b_gate is None and ew.b_up is None:
        return weights[0], None, *weights[1:]
    biases = gate_up_pair(ew.b_gate, ew.b_up)
    if biases is None or biases[1:] != weights[1:]:
        return ()
    return weights[0], biases[0], *weights[1:]


def _grouped_product(offs: torch.Tensor):
    """:func:`_swiglu_products`' ``product`` for rows sorted by expert, ``offs`` their ends."""
    return lambda a, w: torch._grouped_mm(a, w.transpose(1, 2), offs=offs)


def _grouped_biased(offs: torch.Tensor, acc: torch.dtype):
    """:func:`_general_products`' ``product`` for rows sorted by expert, ``offs`` their ends:
    each row's bias repeated from its expert's by the experts' row counts."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))

    def product(a, w, b):
        y = torch._grouped_mm(a, w.transpose(1, 2), offs=offs).to(acc)
        if b is None:
            return y
        return y + torch.repeat_interleave(b.to(acc), counts, dim=0, output_size=y.shape[0])

    return product


def _linear_product(mm: torch.dtype, acc: torch.dtype):
    """:func:`_general_products`' ``product`` for one expert's rows, its weights in ``mm``: the
    bias inside the product (one ``addmm``) where the product runs in ``acc``, else added in
    ``acc`` to the product's result."""
    if mm == acc:
        return lambda a, w, b: F.linear(a, as_dtype(w, mm), None if b is None else as_dtype(b, mm))
    return lambda a, w, b: _plus(as_dtype(F.linear(a, as_dtype(w, mm)), acc), b, 0)


def _batched_product(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`_swiglu_products`' ``product`` for rows padded per expert, ``(experts, m, D)``."""
    return torch.bmm(a, w.transpose(1, 2))


def _padded_product(acc: torch.dtype):
    """:func:`_general_products`' ``product`` for rows padded per expert: the bias inside the
    product (one ``baddbmm``) where it runs in ``acc``."""

    def product(a, w, b):
        if b is None or a.dtype != acc:
            return _plus(as_dtype(_batched_product(a, w), acc), b, 1)
        return torch.baddbmm(as_dtype(b, acc).unsqueeze(1), a, w.transpose(1, 2))

    return product


def _plus(y: torch.Tensor, b: torch.Tensor | None, dim: int) -> torch.Tensor:
    """``y`` plus a bias ``b`` (None: none) of each expert, broadcast over rows at ``dim``."""
    return y if b is None else y + as_dtype(b, y.dtype).unsqueeze(dim)


def _off_the_host(x: torch.Tensor) -> bool:
    """Whether a call's routing stays on the device (:func:`_device_forward`): not on a CPU,
    where reading the offsets costs nothing (a test runs the device's path there by patching
    this)."""
    return x.device.type != "cpu"


def _device_forward(x, routing: Routing, ew: ExpertWeights) -> torch.Tensor:
    """:func:`experts_forward` of a call small enough for one run (a decode step's), without
    reading the routing on the host: every expert's rows through one grouped matmul per
    projection, with the offsets on the device (empty experts included: a device pays little
    per group), so that the call queues without a synchronisation and a CUDA graph can capture
    it. Dropped rows (past ``offsets[E]``) are left out by the combine."""
    acc = compute_dtype(x.dtype)
    product = _grouped_product(routing.offsets[1:].to(torch.int32))
    xe = x.index_select(0, routing.token)
    out = _swiglu_products(xe, _gate_up(ew), ew, slice(None), product, acc)
    return combine(out.to(acc), routing).to(x.dtype)


#: A call of at most this many (token, slot) rows on a CPU may run as two batched products over
#: its experts' rows padded to the busiest expert's count (:func:`_padded_forward`): faster than
#: the sorted path's grouped matmuls up to a few hundred rows, slower at 1024 (the padding's
#: rows, the bookkeeping's Python); 256 keeps a margin below that.
PADDED_ROWS = 256
#: The weights of experts without rows inside its range that path may read: their reads against
#: the products per expert it saves (two for each expert with rows).
PADDED_SPARE_BYTES = 1 << 20


def _padded_forward(x, ids: torch.Tensor, weights: torch.Tensor, ew: ExpertWeights):
    """The experts of a few rows on a CPU, from their ids (``(T, k)``, read on the host; an id
    outside ``[0, E)`` is a dropped slot): two ``bmm`` over experts ``e0..e1-1`` (the first and
    last with rows), each expert's rows padded to the busiest one's count. Two products instead
    of two per expert (each with a fixed cost on a CPU whatever its few rows) and no routing
    sort: the bookkeeping of a batch-8 decode step's 16 rows is two passes over one host list.
    ``None`` where the padding would more than double the rows, or read more than
    ``PADDED_SPARE_BYTES`` of experts without rows. A padding row repeats row 0 of ``x``; no
    output reads it (each expert's rows are independent in a ``bmm``). Any expert form. A
    token's slots are summed in slot order, as :func:`experts_forward` sums them."""
    T, D = x.shape
    E, k = ew.w_up.shape[0], weights.shape[1]
    flat = ids.reshape(-1).tolist()  # (token, slot) order
    count = [0] * E
    rank = []  # each (token, slot)'s row among its expert's; -1: a dropped slot
    for e in flat:
        if 0 <= e < E:
            rank.append(count[e])
            count[e] += 1
        else:
            rank.append(-1)
    kept = [e for e in flat if 0 <= e < E]
    if not kept:
        return None
    e0, e1 = min(kept), max(kept) + 1
    m = max(count)
    # at most twice the rows, and at most PADDED_SPARE_BYTES of weights of experts in the range
    # without rows (read all the same: reading many more weights than the rows' experts' was
    # slower than one product per expert)
    unused = e1 - e0 - (E - count.count(0))
    if (e1 - e0) * m > 2 * len(kept):
        return None
    if unused:
        per_expert = [w.numel() // E * w.element_size() for w in (ew.w_gate, ew.w_up, ew.w_down)
                      if w is not None]  # fmt: skip
        if unused * sum(per_expert) > PADDED_SPARE_BYTES:
            return None
    padded = (e1 - e0) * m
    # one host list, one tensor: the padded rows' tokens, then each (token, slot)'s padded row
    # (a dropped slot's: row 0, its slot zeroed below)
    index = [0] * (padded + T * k)
    for i, e in enumerate(flat):
        if rank[i] >= 0:
            row = (e - e0) * m + rank[i]
            index[row] = i // k
            index[padded + i] = row
    index = index_tensor(index)
    rows = x.index_select(0, index[:padded]).view(e1 - e0, m, D)
    acc, pair = compute_dtype(x.dtype), _gate_up(ew)
    if ew.is_swiglu:
        y = _swiglu_products(rows, pair, ew, slice(e0, e1), _batched_product, acc)
    else:
        y = _general_products(rows, ew, slice(e0, e1), _padded_product(acc), acc, pair)
    slots = as_dtype(y.view(-1, D).index_select(0, index[padded:]), acc).view(T, k, D)
    w = as_dtype(weights, acc)
    if len(kept) < T * k:  # zero slot and weight: a NaN weight there must reach nothing
        dropped = index_tensor([i for i, r in enumerate(rank) if r < 0])
        w = w.flatten().index_fill(0, dropped, 0).view(T, k)
        slots.view(T * k, D)[dropped] = 0
    out = slots[:, 0] * w[:, :1]
    for j in range(1, k):
        out.addcmul_(slots[:, j], w[:, j : j + 1])
    return as_dtype(out, x.dtype)


def _padded_fits(x, ew: ExpertWeights, rows: int) -> bool:
    """Whether :func:`_padded_forward` may serve a call: few rows, the weights in ``x``'s dtype
    and that the products' dtype, on a CPU."""
    if rows > PADDED_ROWS or _off_the_host(x):
        return False
    mm = _mm_dtype(x, ew.w_up)
    weights = (ew.w_gate, ew.w_up, ew.w_down)
    return mm == x.dtype and all(w is None or w.dtype == mm for w in weights)


def experts_forward(x, routing: Routing, ew: ExpertWeights):
    """The experts and the combine for a routing: ``(T, D)`` in ``x.dtype``."""
    T, D = x.shape
    rows = T * routing.experts.shape[1]
    if (
        _off_the_host(x)
        and ew.is_swiglu
        and rows * max(ew.w_up.shape[1], D) <= GROUP_ELEMENTS
        and _grouped(x, ew.w_gate, ew.w_up, ew.w_down)
    ):
        return _device_forward(x, routing, ew)
    if _padded_fits(x, ew, rows):
        out = _padded_forward(x, routing.experts, routing.weights, ew)
        if out is not None:
            return out
    return _sorted_forward(x, routing, ew)


def _sorted_forward(x, routing: Routing, ew: ExpertWeights):
    """:func:`experts_forward` through the rows sorted by expert: runs of grouped matmuls where
    they apply, else one product per expert."""
    T, D = x.shape
    top_k = routing.experts.shape[1]
    bounds = routing.bounds
    w_gate, w_up, w_down = ew.w_gate, ew.w_up, ew.w_down
    mm = _mm_dtype(x, w_up)
    acc = compute_dtype(x.dtype)
    # Each block's outputs go straight to their (token, slot) places.
    slots = torch.empty((T * top_k, D), dtype=acc, device=x.device)
    pair = _gate_up(ew)
    if _grouped(x, *(w for w in (w_gate, w_up, w_down) if w is not None)):
        for e0, e1, s, t, offs in _runs(routing, bounds, max(w_up.shape[1], D)):
            xe = _rows(x, routing, s, t)
            if ew.is_swiglu:
                product = _grouped_product(offs)
                out = _swiglu_products(xe, pair, ew, slice(e0, e1), product, acc)
            else:
                product = _grouped_biased(offs, acc)
                out = _general_products(xe, ew, slice(e0, e1), product, acc, pair)
            slots[routing.order[s:t]] = out.to(acc)
    elif ew.is_swiglu:
        for e, s, t in _experts(bounds):
            xe = _rows(x, routing, s, t).to(mm)
            h = F.silu((xe @ w_gate[e].to(mm).T).to(acc)).mul_((xe @ w_up[e].to(mm).T).to(acc))
            slots[routing.order[s:t]] = (h.to(mm) @ w_down[e].to(mm).T).to(acc)
    else:
        product = _linear_product(mm, acc)
        for e, s, t in _experts(bounds):
            xe = _rows(x, routing, s, t).to(mm)
            slots[routing.order[s:t]] = _general_products(xe, ew, e, product, acc, pair)
    _drop(slots, routing, T * top_k - bounds[-1])
    return weighted_slot_sum(slots, routing).to(x.dtype)


def experts_backward(g, x, routing: Routing, ew: ExpertWeights):
    """``(dx, dL/dw_ts (T, k), dw_gate, dw_up, dw_down, db_gate, db_up, db_down)`` for a routing
    (None for a tensor not given), in float32 (float64 for float64 inputs) but for the weight
    and bias gradients, stored in their own dtypes."""
    T, D = x.shape
    top_k = routing.experts.shape[1]
    bounds = routing.bounds
    acc = compute_dtype(x.dtype)
    slot_w = row_weights(routing).to(acc)
    dx_slots = torch.empty((T * top_k, D), dtype=acc, device=x.device)  # (token, slot) order
    dw_flat = torch.empty(T * top_k, dtype=acc, device=x.device)
    # Each expert's weight gradient is one float32-accumulated matmul over its rows, stored in the
    # weight's dtype as it is produced: no float32 buffer for all experts at once.
    grads = [
        None if w is None else torch.zeros_like(w, memory_format=torch.contiguous_format)
        for w in ew.tensors
    ]
    if not ew.is_swiglu:
        backward_pass = _general_backward
    elif _grouped(x, ew.w_gate, ew.w_up, ew.w_down):
        backward_pass = _grouped_backward
    else:
        backward_pass = _loop_backward
    backward_pass(routing, bounds, x, g, slot_w, ew, dx_slots, dw_flat, grads)
    dropped = T * top_k - bounds[-1]
    _drop(dx_slots, routing, dropped)
    _drop(dw_flat, routing, dropped)
    # dispatch backward: each token's copies summed in slot order (no routing weight again)
    return slot_sum(dx_slots, routing), dw_flat.view(T, top_k), *grads


def _loop_backward(routing, bounds, x, g, slot_w, ew, dx_slots, dw_flat, grads):
    """One pass per expert; fills ``dx_slots``, ``dw_flat`` (``<y, g>`` per slot) and ``grads``."""
    w_gate, w_up, w_down = ew.w_gate, ew.w_up, ew.w_down
    mm, acc = _mm_dtype(x, w_gate), dx_slots.dtype
    for e, s, t in _experts(bounds):
        xr, gr, we = _rows(x, routing, s, t), _rows(g, routing, s, t), slot_w[s:t, None]
        xa, ga = xr.to(acc), gr.to(acc)
        # The recomputed projections and u feed <h, u>, the routing weights' gradient, which
        # keeps float32 accuracy: these three products run in float32 whatever the inputs.
        hg, hu = xa @ w_gate[e].to(acc).T, xa @ w_up[e].to(acc).T
        u = ga @ w_down[e].to(acc)  # g_t W_down: dL/dh before the routing weight
        h, dw_flat[routing.order[s:t]], dhg, dhu = _swiglu(hg, hu, u, we)
        # The weight and input gradients are stored in 16 bits: their products in ``mm``.
        xe, dhg, dhu = xr.to(mm), dhg.to(mm), dhu.to(mm)
        grads[2][e] = (ga * we).to(mm).T @ h.to(mm)  # dW_down = dy^T h with dy = w g
        grads[0][e] = dhg.T @ xe
        grads[1][e] = dhu.T @ xe
        dx = dhg @ w_gate[e].to(mm) + dhu @ w_up[e].to(mm)
        dx_slots[routing.order[s:t]] = dx.to(acc)


def _general_backward(routing, bounds, x, g, slot_w, ew, dx_slots, dw_flat, grads):
    """``_loop_backward`` for every form of expert: biases, any activation, no gate."""
    w_gate, w_up, w_down = ew.w_gate, ew.w_up, ew.w_down
    act = ew.activation
    mm, acc = _mm_dtype(x, w_up), dx_slots.dtype
    for e, s, t in _experts(bounds):
        xr, gr, we = _rows(x, routing, s, t), _rows(g, routing, s, t), slot_w[s:t, None]
        xa, ga = xr.to(acc), gr.to(acc)
        hu = xa @ w_up[e].to(acc).T + _bias(ew.b_up, e, acc)
        hg = xa @ w_gate[e].to(acc).T + _bias(ew.b_gate, e, acc) if act.gated else None
        u = ga @ w_down[e].to(acc)
        h, dot, dhg, dhu = act.rows(hg, hu, u, we)
        if ew.b_down is not None:  # <y, g> = <h, u> + <b_down, g>
            dot = dot + ga @ ew.b_down[e].to(acc)
        dw_flat[routing.order[s:t]] = dot
        dy = ga * we
        xe = xr.to(mm)
        grads[2][e] = dy.to(mm).T @ h.to(mm)
        grads[1][e] = dhu.to(mm).T @ xe
        dx = dhu.to(mm) @ w_up[e].to(mm)
        if act.gated:
            grads[0][e] = dhg.to(mm).T @ xe
            dx = dx + dhg.to(mm) @ w_gate[e].to(mm)
        for i, d in ((3, dhg), (4, dhu), (5, dy)):
            if grads[i] is not None:
                grads[i][e] = d.sum(0)
        dx_slots[routing.order[s:t]] = dx.to(acc)


def _grouped_backward(routing, bounds, x, g, slot_w, ew, dx_slots, dw_flat, grads):
    """``_loop_backward`` with every projection a grouped matmul over a run of experts."""
    w_gate, w_up, w_down = ew.w_gate, ew.w_up, ew.w_down
    acc = dx_slots.dtype
    dt = x.dtype
    F_, D = w_gate.shape[1], w_gate.shape[2]
    for e0, e1, s, t, offs in _runs(routing, bounds, max(F_, D)):
        xe, ge, we = _rows(x, routing, s, t), _rows(g, routing, s, t), slot_w[s:t, None]
        hg = torch._grouped_mm(xe, w_gate[e0:e1].transpose(1, 2), offs=offs).to(acc)
        hu = torch._grouped_mm(xe, w_up[e0:e1].transpose(1, 2), offs=offs).to(acc)
        u = torch._grouped_mm(ge, w_down[e0:e1], offs=offs).to(acc)  # g_t W_down
        h, dw_flat[routing.order[s:t]], dhg, dhu = _swiglu(hg, hu, u, we)
        dy = (ge.to(acc) * we).to(dt)
        # The weight gradients of the run's experts with rows only: a product grouped over the
        # rows writes a whole zero gradient for each expert without (2 MiB at F 512 and D 1024,
        # then copied over the zeros it already was), where a decode step's run is mostly such.
        used = [e for e in range(e0, e1) if bounds[e + 1] > bounds[e]]
        if len(used) == e1 - e0:
            to, w_offs = slice(e0, e1), offs
        else:
            to = index_tensor(used, offs.device)
            w_offs = offs[to - e0]
        grads[2][to] = torch._grouped_mm(dy.T, h.to(dt), offs=w_offs)
        dhu, dhg = dhu.to(dt), dhg.to(dt)
        grads[0][to] = torch._grouped_mm(dhg.T, xe, offs=w_offs)
        grads[1][to] = torch._grouped_mm(dhu.T, xe, offs=w_offs)
        dx = torch._grouped_mm(dhg, w_gate[e0:e1], offs=offs).to(acc)
        dx_slots[routing.order[s:t]] = dx.add_(torch._grouped_mm(dhu, w_up[e0:e1], offs=offs))
    # An expert without rows is in no run: its gradients stay the zeros they start as.


#: A call of at most this many (token, slot) rows (a decode step's) runs each slot's expert with
#: ``F.linear`` directly: the sort, the runs and the grouped matmuls cost most of such a call.
FEW_ROWS = 8


def few_rows(x: torch.Tensor, rows: int) -> bool:
    """Whether :func:`few_rows_forward` serves a call of ``rows`` (token, slot) rows: at most
    ``FEW_ROWS`` rows, on the host."""
    return rows <= FEW_ROWS and not _off_the_host(x)


def few_rows_forward(x, top_k_index, top_k_weights, ew: ExpertWeights):
    """:func:`experts_forward` of a few rows, slot by slot, for every expert form (biases, the
    activations, the limit): one product per slot for its gate and up (one for both where they
    are views of one packed tensor: :func:`_gate_up`), the activation once over every slot's
    rows, one product per slot for its down projection; the same sums in the same order (each
    token's slots in slot order), a dropped slot adding nothing."""
    T, E = top_k_index.shape[0], ew.w_up.shape[0]
    acc, mm = compute_dtype(x.dtype), _mm_dtype(x, ew.w_up)
    slots = [(t, j, e) for t, ids in enumerate(top_k_index.tolist())
             for j, e in enumerate(ids) if 0 <= e < E]  # fmt: skip
    out = torch.zeros((T, x.shape[1]), dtype=acc, device=x.device)
    if not slots:
        return as_dtype(out, x.dtype)
    product, act = _linear_product(mm, acc), ew.activation
    xm = as_dtype(x, mm)

    def first(w, b):  # a projection of each slot's row by its expert's, slots stacked as rows
        ys = [product(xm[t : t + 1], w[e], None if b is None else b[e]) for t, _, e in slots]
        return ys[0] if len(ys) == 1 else torch.cat(ys)

    pair = _gate_up(ew)
    if pair:
        y = first(pair[0], pair[1])
        hg, hu = y[:, pair[2]], y[:, pair[3]]
    else:
        hu = first(ew.w_up, ew.b_up)
        hg = first(ew.w_gate, ew.b_gate) if act.gated else None
    h = as_dtype(act.forward(hg, hu), mm)
    weights = as_dtype(top_k_weights, acc)
    for i, (t, j, e) in enumerate(slots):
        b = None if ew.b_down is None else ew.b_down[e]
        out[t : t + 1].addcmul_(product(h[i : i + 1], ew.w_down[e], b), weights[t, j])
    return as_dtype(out, x.dtype)


def forward(x, top_k_index, top_k_weights, *weights):
    ew = ExpertWeights.of(*weights)
    if few_rows(x, top_k_index.numel()):
        return few_rows_forward(x, top_k_index, top_k_weights, ew)
    routing = functools.partial(given_routing, top_k_index, top_k_weights, ew.w_up.shape[0])
    if _padded_fits(x, ew, top_k_index.numel()):  # (on a CPU: the device's path never runs)
        # from the ids themselves: no routing sort unless the padding declines
        out = _padded_forward(x, top_k_index, top_k_weights, ew)
        return out if out is not None else _sorted_forward(x, routing(), ew)
    return experts_forward(x, routing(), ew)


def backward(g, x, top_k_index, top_k_weights, *weights):
    ew = ExpertWeights.of(*weights)
    routing = given_routing(top_k_index, top_k_weights, ew.w_up.shape[0])
    dx, dweights, *dws = experts_backward(g, x, routing, ew)
    return cast_grads((dx, dweights, *dws), (x, top_k_weights, *ew.tensors))
