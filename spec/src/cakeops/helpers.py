"""Helpers for backend authors: each piece of math the spec owns that several backends need,
written once here (the conformance guide names this module).

- ``moe_experts``: the routing rules (:func:`route`, :class:`Routing`), their backward
  (:func:`routing_backward`), sorted-row bookkeeping (:func:`row_weights`, :func:`row_tiles`),
  the combine and the dispatch backward (:func:`combine`, :func:`weighted_slot_sum`,
  :func:`slot_sum`, :func:`dispatch_backward`), the SwiGLU backward (:func:`swiglu_backward`)
  and every other activation the experts take (:class:`Activation`), dropped slots
  (:func:`kept_rows`);
- ``causal_dot_product``: the backward as three causal scans (:func:`backward_by_scans`), the
  per-position log multipliers (:func:`log_multipliers`) and their gradients
  (:func:`log_multiplier_grads`, or :func:`split_log_grads` for a kernel that sums them
  itself), one decode step
  (:func:`causal_step`, :func:`causal_step_backward`) and a state times a vector the way a
  CPU computes it fast (:func:`state_times`);
- ``causal_conv1d``: each sequence's place (:func:`conv_sequences`), the final state gathered
  from the inputs (:func:`conv_final_state`) and the initial state's gradient
  (:func:`conv_initial_state_grad`), for kernels that compute the positions only;
- every op: :func:`cast_grads` (each gradient in its input's dtype),
  :func:`cakeops.compute_dtype` (the precision to compute in), :func:`as_dtype` (a tensor in a
  dtype, without a no-op ``.to``) and :func:`index_tensor` (a host list of indices as a tensor,
  cheaply).
"""

from __future__ import annotations

import array
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from cakeops._spec import compute_dtype

__all__ = [
    "Activation",
    "ExpertWeights",
    "Routing",
    "SwiGLUGrads",
    "as_dtype",
    "backward_by_scans",
    "cast_grads",
    "causal_step",
    "causal_step_backward",
    "combine",
    "compute_dtype",
    "conv_final_state",
    "conv_initial_state_grad",
    "conv_sequences",
    "dispatch_backward",
    "down_bias_dots",
    "given_routing",
    "index_tensor",
    "kept_rows",
    "log_multiplier_grads",
    "log_multipliers",
    "route",
    "routing_backward",
    "row_experts",
    "row_tiles",
    "row_weights",
    "slot_sum",
    "split_log_grads",
    "state_times",
    "swiglu_backward",
    "swiglu_rows",
    "top_k_choice",
    "weighted_slot_sum",
]


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: ``t`` itself when it already is (a no-op ``.to`` still costs a decode
    step's call a microsecond or two)."""
    return t if t.dtype == dtype else t.to(dtype)


def index_tensor(values: list[int], device: torch.device | str | None = None) -> torch.Tensor:
    """The int64 tensor of a host list of ints, through the list's bytes: ``torch.tensor(list)``
    inspects each element for its type, several times the cost, a bookkeeping step's share of
    a small call."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    t = torch.frombuffer(array.array("q", values), dtype=torch.int64)  # keeps the array alive
    return t if device is None else t.to(device)


def cast_grads(grads, inputs) -> tuple[torch.Tensor, ...]:
    """Each gradient in the dtype of the input it belongs to (a no-op where it already is; None
    for an optional input not given)."""
    return tuple(None if t is None else g.to(t.dtype) for g, t in zip(grads, inputs, strict=True))


# --------------------------------------------------------------------------------------------
# causal_dot_product


class ConvSequences(NamedTuple):
    """Each sequence of a ``causal_conv1d`` call: its batch row, first position and length,
    ``(S,)`` int64 on x's device (computed there: no synchronisation)."""

    row: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor


def conv_sequences(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> ConvSequences:
    N, _, L = x.shape
    if cu_seqlens is None:
        rows = torch.arange(N, device=x.device)
        return ConvSequences(rows, torch.zeros_like(rows), torch.full_like(rows, L))
    cu = cu_seqlens.to(torch.long)
    return ConvSequences(torch.zeros_like(cu[1:]), cu[:-1], cu[1:] - cu[:-1])


def _conv_taps(x, width, cu_seqlens):
    """The sequences, and per sequence the positions ``length - (W - 1) + k`` of the final
    state's ``W - 1`` slots (negative: a slot of the initial state)."""
    seqs = conv_sequences(x, cu_seqlens)
    k = torch.arange(width - 1, device=x.device)
    return seqs, k, seqs.length[:, None] - (width - 1) + k


def _gather_positions(t: torch.Tensor, seqs: ConvSequences, p: torch.Tensor) -> torch.Tensor:
    """``t[row, :, start + p]`` for each sequence and each ``p`` ``(S, P)`` (zeros where ``p`` is
    outside the sequence), as ``(S, C, P)``."""
    inside = (p >= 0) & (p < seqs.length[:, None])
    if t.shape[2] == 0:
        return t.new_zeros(p.shape[0], t.shape[1], p.shape[1])
    index = (seqs.start[:, None] + p).clamp(0, t.shape[2] - 1)
    picked = t[seqs.row[:, None], :, index]  # (S, P, C)
    return picked.masked_fill(~inside[..., None], 0).transpose(1, 2)


def conv_final_state(x, initial_state, width: int, cu_seqlens, dtype) -> torch.Tensor:
    """``causal_conv1d``'s final state ``(sequences, C, W - 1)`` in ``dtype``: each sequence's
    last ``W - 1`` inputs, reaching into its initial state (or zeros) when it is shorter."""
    seqs, k, p = _conv_taps(x, width, cu_seqlens)
    final = _gather_positions(x, seqs, p).to(dtype)
    if initial_state is not None:
        # slot k of the final state is slot length + k of the initial one when p < 0
        slot = (seqs.length[:, None] + k).clamp(max=max(width - 2, 0))
        sequence = torch.arange(slot.shape[0], device=x.device)[:, None]
        past = initial_state[sequence, :, slot].transpose(1, 2).to(dtype)
        final = torch.where((p < 0)[:, None, :], past, final)
    return final.contiguous()


def conv_initial_state_grad(dpre, weight, g_final, cu_seqlens) -> torch.Tensor:
    """``causal_conv1d``'s initial-state gradient ``(sequences, C, W - 1)`` in float32, from
    the pre-activation's gradient ``dpre`` ``(N, C, L)`` (slot ``k`` feeds position ``k - j``
    through tap ``j``) and the final state's gradient ``g_final`` (empty: none), which reaches
    the slots a sequence shorter than the state hands on."""
    width = weight.shape[1]
    seqs, k, p = _conv_taps(dpre, width, cu_seqlens)
    first = _gather_positions(dpre, seqs, k[None, :].expand(p.shape[0], -1)).float()
    w = weight.float()
    grad = torch.zeros_like(first)
    for slot in range(width - 1):
        for j in range(slot + 1):
            grad[:, :, slot] += w[:, j] * first[:, :, slot - j]
    if g_final.numel():
        slot = seqs.length[:, None] + k
        handed = (slot <= width - 2)[:, None, :]
        index = slot.clamp(max=width - 2)[:, None, :].expand_as(grad)
        grad.scatter_add_(2, index, g_final.float().masked_fill(~handed, 0))
    return grad


def log_multipliers(q, log_decay, log_gates, dtype=torch.float32) -> torch.Tensor | None:
    """``log_decay`` and ``log_gates`` summed per position, ``(N, H, L)`` in ``dtype`` (None
    without either): the log of what multiplies the state at each step."""
    if log_decay is None and log_gates is None:
        return None
    N, _, L, _ = q.shape  # the heads: the value heads (q may have fewer, shared by groups)
    H = log_gates.shape[1] if log_gates is not None else log_decay.shape[0]
    lm = torch.zeros((N, H, L), dtype=dtype, device=q.device)
    if log_decay is not None:
        lm += log_decay.to(dtype)[None, :, None]
    if log_gates is not None:
        lm += log_gates.to(dtype)
    return lm


#: Gate factors ``exp(x)`` of ``x`` below this are taken as exactly 0 by the CPU's chunked forms
#: (:func:`gate_factors`) where they weigh terms of the same scale as those beside them: such a
#: factor (under 1.6e-28) is far below any dtype's rounding of those terms, and left in, it and
#: its products reach float32's subnormal range, which x86 CPUs compute tens of times slower (a
#: strong gate, as Mamba2's and Gated DeltaNet's models start from, made the matrix products of
#: a chunk several times slower). Factors on a carried state use :func:`state_floor`, lower by
#: the state's scale.
LOG_FACTOR_FLOOR = -64.0


def gate_factors(x: torch.Tensor, floor: float | torch.Tensor = LOG_FACTOR_FLOOR) -> torch.Tensor:
    """``exp(x)``, exactly 0 where ``x < floor`` (NaN stays NaN)."""
    return torch.exp(x.masked_fill(x < floor, -torch.inf))


def state_floor(*states: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor],
                dtype: torch.dtype) -> float | torch.Tensor:  # fmt: skip
    """The floor of :func:`gate_factors` for factors on a carried state: a dropped factor's
    share of the terms beside it must stay under ``exp(LOG_FACTOR_FLOOR)`` whatever the
    state's scale. A state the scan builds sums products of its terms (``a``, ``b``: ``max|a|
    max|b|`` each, up to ``L`` of them, still far under any dtype's rounding); a given one
    (``(state, a, b)``: an initial state and the terms it meets, a final state's gradient and
    its) may exceed them by any factor, which lowers the floor (a state of ``1e25`` behind a
    gate of ``-66`` was dropped, where it weighs ``2e-4`` of the terms). Never below where
    ``exp`` is subnormal in ``dtype`` (such factors are 0 to the dtype). ``LOG_FACTOR_FLOOR``
    itself without a given state, else a 0-dim tensor on its device (no synchronisation)."""
    given = [(state, a, b) for state, a, b in states if state is not None]
    if not given:
        return LOG_FACTOR_FLOOR
    tiny = math.log(torch.finfo(dtype).tiny)

    def log_scale(t: torch.Tensor) -> torch.Tensor:
        if not t.numel():
            return t.new_full((), -math.inf, dtype=torch.float64)
        return t.detach().abs().amax().to(torch.float64).log()

    shift = torch.zeros((), dtype=torch.float64, device=given[0][0].device)
    for state, a, b in given:
        ratio = log_scale(state) - (log_scale(a) + log_scale(b))
        # terms of 0 (inf): nothing beside the state, no floor; NaN inputs: no change
        shift = shift + torch.nan_to_num(ratio, nan=0.0, posinf=-tiny).clamp(min=0)
    return (LOG_FACTOR_FLOOR - shift).clamp(min=tiny)


def drop_tiny_(x: torch.Tensor, floor: float | torch.Tensor = LOG_FACTOR_FLOOR) -> torch.Tensor:
    """``x`` with its entries under ``exp(floor)`` in magnitude set to 0, in place: for
    products of gate factors (a chunk's ``(I + A)^{-1}``, whose entries multiply factors along
    paths) beside entries of 1; ``floor`` from :func:`state_floor` where they meet a state."""
    bound = math.exp(floor) if isinstance(floor, float) else floor.exp().to(x.dtype)
    return x.masked_fill_(x.abs() < bound, 0.0)


def value_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``causal_dot_product``'s ``q`` or ``k`` ``(N, Hk, L, E)`` as ``(N, heads, L, E)``, value
    head ``h`` reading key head ``h // (heads / Hk)``: ``t`` itself, a stride-0 view for one key
    head, else a copy (for kernels that read one head per value head)."""
    Hk = t.shape[1]
    if Hk == heads:
        return t
    if Hk == 1:
        return t.expand(-1, heads, -1, -1)
    return t.repeat_interleave(heads // Hk, dim=1)


def key_head_sums(d: torch.Tensor, key_heads: int) -> torch.Tensor:
    """Per-value-head gradients ``(N, H, L, E)`` of :func:`value_heads`' result summed over
    each key head's group: ``(N, key_heads, L, E)``."""
    N, H, L, E = d.shape
    return d if key_heads == H else d.view(N, key_heads, H // key_heads, L, E).sum(2)


def causal_step(q, k, v, scale, log_decay, log_gates, initial_state, output_final_state):
    """A kernel's forward outputs ``(out, final)`` of one position (``L = 1``, one sequence per
    row): ``S = a S_0 + k^T v`` (``a`` the exp of ``log_decay`` plus ``log_gates``, each None for
    none; ``S_0`` zeros when ``initial_state`` is None), ``out = scale q S`` in ``q``'s dtype,
    ``final`` the state in ``initial_state``'s dtype (the compute dtype without one), empty
    unless ``output_final_state``. A decode step in the fewest ops: the outer product broadcast
    from ``k`` transposed and ``v`` as they come, added in place to the decayed state just
    written (on a CPU, on PyTorch's threads: from 8 heads of 128 faster than numba's one pass
    over the state on a hot loop, not with caches cold; below, the numba backend makes that
    pass)."""
    ct, out_dtype = compute_dtype(q.dtype), q.dtype
    H = v.shape[1]
    if q.shape[1] != H:
        q, k = value_heads(q, H), value_heads(k, H)
    kt = k.mT  # (N, H, E, 1)
    if q.dtype != ct:
        q, kt, v = q.to(ct), kt.to(ct), v.to(ct)
    if initial_state is None:
        state = kt * v
    else:
        s0 = as_dtype(initial_state, ct)
        log = None if log_decay is None else as_dtype(log_decay, ct).view(-1, 1, 1)  # (H, 1, 1)
        if log_gates is not None:
            gates = as_dtype(log_gates, ct)[..., None]  # (N, H, 1, 1)
            log = gates if log is None else gates + log
        state = torch.addcmul(s0, kt, v) if log is None else (s0 * log.exp()).addcmul_(kt, v)
    out = q @ state
    if scale is not None:
        out = out.mul_(scale)
    out = as_dtype(out, out_dtype)
    if not output_final_state:
        return out, out.new_empty(0)
    return out, state if initial_state is None else as_dtype(state, initial_state.dtype)


def state_times(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``state @ x`` for states ``(..., E, M)`` and vectors ``(..., M)``: ``(..., E)``, as the
    row vector ``x^T`` times ``state^T``. On a CPU (torch 2.13, MKL) the batched product with
    the vector as a column took four to five times as long at a decode step's 8 heads of 128
    (the row times the transposed view takes the fast path); a decode step's backward makes
    two or three such products."""
    return (x[..., None, :] @ state.mT)[..., 0, :]


def causal_step_backward(g, g_final, q, k, v, scale, log_decay, log_gates, initial_state):
    """The six gradients of a ``causal_dot_product`` kernel's backward (None for an option not
    given) for one position (:func:`causal_step`; ``g_final`` None for none): with ``R = s q
    g^T + G``, the gradient reaching the state (``G``: ``g_final``), ``dq = s S g``, ``dk = R
    v``, ``dv = R^T k``, the initial state's ``a R`` and the log multiplier's ``a <R, S_0>``
    (``a`` its exp; exactly 0 where ``a`` is). Expanded so that no state-sized product is made
    but the initial state's gradient: ``S g = a S_0 g + k (v . g)``, ``R v = s q (g . v) + G
    v``, ``R^T k = s g (q . k) + G^T k``, ``<R, S_0> = s q . S_0 g + <G, S_0>`` (a decode step's
    backward reads each state-sized tensor once or twice instead of rebuilding ``S`` and
    ``R``)."""
    ct = compute_dtype(q.dtype)
    lm = log_multipliers(q, log_decay, log_gates, ct)
    s = 1.0 if scale is None else scale
    key_heads, H = q.shape[1], v.shape[1]
    given_q, given_k = q, k
    q, k = value_heads(q, H), value_heads(k, H)
    qt, kt, vt, gt = (x[:, :, 0].to(ct) for x in (q, k, v, g))  # (N, H, E) and (N, H, M)
    sq = qt * s
    a = None if lm is None else torch.exp(lm[:, :, 0])  # (N, H)
    s0 = None if initial_state is None else initial_state.to(ct)
    gf = None if g_final is None else g_final.to(ct)
    vg = torch.linalg.vecdot(vt, gt)[..., None]  # (N, H, 1): in dq and dk
    dq = kt * vg
    s0g = None
    if s0 is not None:
        s0g = state_times(s0, gt)  # S_0 g, (N, H, E)
        dq = dq + (s0g if a is None else s0g * a[..., None])
    dq = dq * s
    dk = sq * vg
    dv = gt * torch.linalg.vecdot(sq, kt)[..., None]
    if gf is not None:
        dk = dk + state_times(gf, vt)
        dv = dv + (kt[..., None, :] @ gf)[..., 0, :]
    d_init = d_decay = d_gates = None
    if s0 is not None:
        outer = (sq[..., :, None], gt[..., None, :])  # R: (N, H, E, M)
        reach = outer[0] * outer[1] if gf is None else torch.addcmul(gf, *outer)
        d_init = (reach if a is None else reach.mul_(a[..., None, None])).to(initial_state.dtype)
    if a is not None:
        if s0 is None:
            d_lm = torch.zeros_like(a)
        else:
            dot = torch.linalg.vecdot(sq, s0g)
            if gf is not None:
                dot = dot + torch.linalg.vecdot(gf.flatten(-2), s0.flatten(-2))
            d_lm = (dot * a).masked_fill(a == 0, 0.0)
        d_decay = None if log_decay is None else d_lm.sum(0).to(log_decay.dtype)
        d_gates = None if log_gates is None else d_lm[..., None].to(log_gates.dtype)
    dq, dk, dv = (t.unsqueeze(2) for t in (dq, dk, dv))  # (N, H, 1, E) and (N, H, 1, M)
    dq, dk = key_head_sums(dq, key_heads), key_head_sums(dk, key_heads)
    dq, dk, dv = cast_grads((dq, dk, dv), (given_q, given_k, v))
    return dq, dk, dv, d_decay, d_gates, d_init


#: positions per chunk of :func:`log_multiplier_grads`
LOG_GRAD_CHUNK = 64


class _Chunks(NamedTuple):
    """Positions laid out as chunks of ``LOG_GRAD_CHUNK`` that never straddle two sequences:
    ``dest`` each position's place in the padded ``(chunks * C)`` layout (None: every row is one
    sequence, the layout is the positions padded at the end); per chunk, ``first`` / ``last``
    whether it starts / ends its sequence and ``seq`` that sequence (``sequences`` for a chunk
    past the last one: zero initial state and final gradient). None flags: only the first /
    last chunk."""

    count: int
    sequences: int
    dest: torch.Tensor | None
    first: torch.Tensor | None
    last: torch.Tensor | None
    seq: torch.Tensor | None


def _log_grad_chunks(L: int, cu_seqlens: torch.Tensor | None, device) -> _Chunks:
    C = LOG_GRAD_CHUNK
    if cu_seqlens is None:
        return _Chunks(-(-L // C), 0, None, None, None, None)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    S = cu.numel() - 1
    count = -(-L // C) + S  # sum of ceil(len_s / C) never exceeds it: no host synchronisation
    per_seq = (cu[1:] - cu[:-1] + C - 1) // C
    ends = per_seq.cumsum(0)
    starts = ends - per_seq
    pos = torch.arange(L, device=device)
    seq_of_pos = torch.searchsorted(cu[1:], pos, right=True)
    local = pos - cu[seq_of_pos]
    dest = (starts[seq_of_pos] + local // C) * C + local % C
    chunk = torch.arange(count, device=device)
    seq = torch.searchsorted(ends, chunk, right=True)  # S past the last chunk
    valid = seq < S
    at = seq.clamp(max=max(S - 1, 0))
    first = ~valid | (chunk == starts[at])
    last = ~valid | (chunk == ends[at] - 1)
    return _Chunks(count, S, dest, first, last, seq)


def _in_chunks(x: torch.Tensor, chunks: _Chunks, ct) -> torch.Tensor:
    """``x`` ``(N, H, L, ...)`` in ``ct`` as ``(N, H, chunks, C, ...)``, zeros in the padding."""
    C = LOG_GRAD_CHUNK
    N, H, L = x.shape[:3]
    out = x.new_zeros((N, H, chunks.count * C, *x.shape[3:]), dtype=ct)
    if chunks.dest is None:
        out[:, :, :L] = x
    else:
        out.index_copy_(2, chunks.dest, x.to(ct))
    return out.view(N, H, chunks.count, C, *x.shape[3:])


def _chunk_scan(adds, across, given, chunks: _Chunks, reverse: bool) -> torch.Tensor:
    """``out[c]``, the state entering chunk ``c`` (``reverse``: the gradient leaving it) of
    ``X_c = across_c X_{c-1} + adds_c`` from ``given`` (the initial states, or the final
    states' gradients; zeros when None), restarted at each sequence's first (last) chunk."""
    n = adds.shape[2]
    out = torch.empty_like(adds)
    starts = None
    if chunks.seq is not None:  # per chunk, its sequence's given state (zeros past the last)
        table = adds.new_zeros((chunks.sequences + 1, *adds.shape[1:2], *adds.shape[3:]))
        if given is not None:
            table[:-1] = given
        starts = table.index_select(0, chunks.seq)  # (n, H, E, M)
    order = range(n - 1, -1, -1) if reverse else range(n)
    # each chunk's views made once (a view is a host op too)
    outs, added, factors = out.unbind(2), adds.unbind(2), across[..., None, None].unbind(2)
    if starts is not None:
        flags = (chunks.last if reverse else chunks.first).unbind(0)
        starts = starts.unbind(0)
    for step, c in enumerate(order):
        if step == 0:
            if starts is not None:
                outs[c].copy_(starts[c])
            elif given is None:
                outs[c].zero_()
            else:
                outs[c].copy_(given)
            continue
        p = c + 1 if reverse else c - 1  # the chunk before, in the scan's order
        if starts is None:
            torch.addcmul(added[p], factors[p], outs[p], out=outs[c])
        else:
            carried = torch.addcmul(added[p], factors[p], outs[p])
            torch.where(flags[c], starts[c], carried, out=outs[c])
    return out


def log_multiplier_grads(g, g_final, q, k, v, lm, initial_state, cu_seqlens, log_decay,
                         log_gates):  # fmt: skip
    """``(dlog_decay, dlog_gates)`` (None for one not given) of ``S_t = exp(lm_t) S_{t-1} +
    k_t v_t^T``, ``out_t = q_t^T S_t`` for the output's gradient ``g`` (the scale in it) and
    the final states' ``g_final`` (None: zero); ``lm`` :func:`log_multipliers`.

    The gradient of ``lm_t`` is ``exp(lm_t) <R_t, S_{t-1}>``: the sum of the terms
    ``exp(lm_{j+1} + ... + lm_i) (q_i . k_j) (g_i . v_j)`` of the pairs ``j < t <= i`` that
    cross ``t`` (the initial state counting as a pair before the sequence, the final state's
    gradient as one after it). Summed as exactly those terms, chunk by chunk: the pairs inside
    a chunk, the chunk's positions against the states entering and leaving it, and the pairs
    that span it. Never as ``q_t . dq_t - k_t . dk_t`` summed backwards, which cancels each
    position's own term and every later one, and loses the gradient of a strongly decaying
    gate (Mamba2's) to rounding. No host synchronisation."""
    ct = compute_dtype(q.dtype)
    lm = lm.to(ct)
    if q.shape[2] == 0:
        dlm = lm
    else:
        dlm = _crossing_sums(g, g_final, q, k, v, lm, initial_state, cu_seqlens, ct)
    return split_log_grads(dlm, lm, log_decay, log_gates)


def split_log_grads(dlm, lm, log_decay, log_gates):
    """``(dlog_decay, dlog_gates)`` (None for one not given) from ``dlm`` ``(N, H, L)``, the
    gradient of each position's log multiplier ``lm``: exactly 0 where the multiplier is
    (a log multiplier of -inf, or one whose exp underflows)."""
    dlm = dlm.masked_fill(torch.exp(lm.to(dlm.dtype)) == 0, 0.0)
    d_decay = None if log_decay is None else dlm.sum((0, 2)).to(log_decay.dtype)
    d_gates = None if log_gates is None else dlm.to(log_gates.dtype)
    return d_decay, d_gates


def _crossing_sums(g, g_final, q, k, v, lm, initial_state, cu_seqlens, ct):
    C = LOG_GRAD_CHUNK
    N, H, L, _ = q.shape
    chunks = _log_grad_chunks(L, cu_seqlens, q.device)
    Q, K, V, G = (_in_chunks(x, chunks, ct) for x in (q, k, v, g))
    x = _in_chunks(lm[..., None], chunks, ct)[..., 0]  # (N, H, n, C), 0 in the padding
    # sums of exactly the steps each factor spans (see the torch backend's _chunk_logs)
    later = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)  # [i, j]: i > j
    pairs = torch.where(later, x[..., :, None], 0.0).cumsum(-2)  # lm_{j+1} + ... + lm_i
    tail = torch.exp(pairs[..., -1, :])  # from after j to the chunk's end
    decays = torch.exp(pairs.masked_fill_(~later.logical_or(torch.eye(C, dtype=torch.bool,
                                          device=q.device)), -torch.inf))  # fmt: skip
    into = torch.exp(torch.cumsum(x, -1))  # from the chunk's start to i
    across = torch.exp(x.sum(-1))  # the whole chunk, (N, H, n)
    # the states entering each chunk and the gradients leaving it: one product per chunk in
    # a loop (a kernel launch or two a chunk on a GPU), the rest batched over the chunks
    adds = (K * tail[..., None]).transpose(-1, -2) @ V  # (N, H, n, E, M)
    states = _chunk_scan(adds, across, initial_state, chunks, reverse=False)
    del adds
    reaches = (Q * into[..., None]).transpose(-1, -2) @ G
    grads = _chunk_scan(reaches, across, g_final, chunks, reverse=True)
    del reaches
    entering = into * ((Q @ states) * G).sum(-1)
    leaving = tail * ((K @ grads) * V).sum(-1)
    spanning = across * (states * grads).sum((-1, -2))
    del states, grads
    pair = (Q @ K.transpose(-1, -2)) * (G @ V.transpose(-1, -2))
    pair = (pair * decays).masked_fill_(decays == 0, 0.0)
    total = crossing_in_chunk(pair, entering, leaving, spanning).reshape(N, H, chunks.count * C)
    return total[:, :, :L] if chunks.dest is None else total[:, :, chunks.dest]


def crossing_in_chunk(pair, entering, leaving, spanning):
    """A chunk's log multipliers' gradients from the terms crossing each position ``t``: the
    chunk's pairs ``i >= t > j`` (``pair[..., i, j]``, zero unless ``i > j``), its positions
    ``i >= t`` against the state entering (``entering[..., i]``), ``j < t`` against the gradient
    leaving (``leaving[..., j]``), and the pairs spanning the whole chunk (``spanning``)."""
    C = pair.shape[-1]
    crossing = torch.ones(C, C, dtype=torch.bool, device=pair.device).tril(-1)  # [t, j]: j < t
    inside = pair.flip(-2).cumsum(-2).flip(-2).masked_fill_(~crossing, 0.0).sum(-1)
    before = torch.nn.functional.pad(leaving.cumsum(-1)[..., :-1], (1, 0))
    return entering.flip(-1).cumsum(-1).flip(-1) + before + inside + spanning[..., None]


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
