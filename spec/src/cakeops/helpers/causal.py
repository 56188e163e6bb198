"""``causal_dot_product`` and the delta rule: the backward as three causal scans
(:func:`backward_by_scans`), the per-position log multipliers (:func:`log_multipliers`) and their
gradients (:func:`log_multiplier_grads`, or :func:`split_log_grads` for a kernel that sums them
itself), one decode step (:func:`causal_step`, :func:`causal_step_backward`), a state times a
vector the way a CPU computes it fast (:func:`state_times`), key heads shared by groups of value
heads (:func:`value_heads`, :func:`key_head_sums`), and the gate factors taken as 0 below a floor
(:data:`LOG_FACTOR_FLOOR`, :func:`gate_factors`, :func:`state_floor`, :func:`drop_tiny_`)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from cakeops._spec import compute_dtype
from cakeops.helpers.common import as_dtype, cast_grads


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
