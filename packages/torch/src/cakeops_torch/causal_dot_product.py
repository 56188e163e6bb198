"""Causal linear attention in plain PyTorch, chunked.

Within a chunk of ``CHUNK`` positions: a masked ``C x C`` score matrix times the chunk's values.
Across chunks: one running ``E x M`` state in float32. Never an ``L x L`` matrix, never a state per
position: peak extra memory is O(N H (L C + E M)) (the per-chunk float32 copies and scores).
The backward recomputes everything from q, k, v: a forward-time scan for dq and a reverse-time
scan for dk and dv. Key heads shared by a group of value heads are never repeated: the chunk forms
run on ``(N, Hk, G, ...)`` views, q and k broadcast over the group, and each chunk's dq and dk
summed over it as they are formed.
"""

from __future__ import annotations

import itertools

import torch

from cakeops import compute_dtype
from cakeops.helpers import (
    causal_step,
    causal_step_backward,
    crossing_in_chunk,
    gate_factors,
    log_multipliers,
    split_log_grads,
    state_floor,
)

from ._causal import causal_mm as _causal_mm

CHUNK = 64


def _chunks(L: int, reverse: bool = False):
    starts = range(0, L, CHUNK)
    for s in reversed(starts) if reverse else starts:
        yield slice(s, min(s + CHUNK, L))


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def forward(q, k, v, scale=None, log_decay=None, log_gates=None, initial_state=None,
            output_final_state=False, cu_seqlens=None):  # fmt: skip
    if q.shape[2] == 1 and cu_seqlens is None:  # a decode step
        return causal_step(q, k, v, scale, log_decay, log_gates, initial_state,
                           output_final_state)  # fmt: skip
    lm = log_multipliers(q, log_decay, log_gates, compute_dtype(q.dtype))
    if (lm is None and initial_state is None and not output_final_state and cu_seqlens is None
          and q.shape[1] == v.shape[1]):  # fmt: skip
        out = _forward(q, k, v, scale)
    else:
        outs, finals = zip(*(_forward_options(q[r], k[r], v[r], None if lm is None else lm[r],
                                              None if initial_state is None else initial_state[i],
                                              scale)
                             for r, i in _sequences(q, cu_seqlens)), strict=True)  # fmt: skip
        out = outs[0] if cu_seqlens is None else torch.cat(outs, dim=2)
    if not output_final_state:
        return out, q.new_empty(0)
    dtype = initial_state.dtype if initial_state is not None else compute_dtype(q.dtype)
    final = finals[0] if len(finals) == 1 else torch.cat(finals)  # (a cat copies even one)
    return out, final.to(dtype)


def backward(g, g_final, q, k, v, scale=None, log_decay=None, log_gates=None,
             initial_state=None, output_final_state=False, cu_seqlens=None):  # fmt: skip
    g_final = g_final if output_final_state and g_final.numel() else None
    if q.shape[2] == 1 and cu_seqlens is None:  # a decode step
        return causal_step_backward(g, g_final, q, k, v, scale, log_decay, log_gates,
                                    initial_state)  # fmt: skip
    # the output's gradient carries the scale
    gs = g if scale is None else g.to(compute_dtype(g.dtype)) * scale
    lm = log_multipliers(q, log_decay, log_gates, compute_dtype(q.dtype))
    if (lm is None and initial_state is None and g_final is None and cu_seqlens is None
            and q.shape[1] == v.shape[1]):  # fmt: skip
        return (*_backward(gs, q, k, v), None, None, None)
    sequences = _sequences(q, cu_seqlens)  # once: cu_seqlens is read on the host
    parts = [
        _backward_options(gs[r], q[r], k[r], v[r], None if lm is None else lm[r],
                          None if initial_state is None else initial_state[i],
                          None if g_final is None else g_final[i])
        for r, i in sequences
    ]  # fmt: skip
    dq, dk, dv = (torch.cat(t, dim=2) for t in list(zip(*parts, strict=True))[:3])
    d_decay = d_gates = d_init = None
    if lm is not None:
        dlm = torch.cat([p[5] for p in parts], dim=2)
        d_decay, d_gates = split_log_grads(dlm, lm, log_decay, log_gates)
    if initial_state is not None:
        d_init = torch.cat([p[3] for p in parts]).to(initial_state.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_decay, d_gates, d_init


def _sequences(q, cu_seqlens):
    """``(index, states)`` of each batch of equal-length sequences: every row at once, or each
    packed sequence (``index`` picks its positions of q, ``states`` its initial state)."""
    if cu_seqlens is None:
        return [((slice(None),), slice(None))]
    bounds = cu_seqlens.tolist()
    return [((slice(None), slice(None), slice(s, e)), slice(i, i + 1))
            for i, (s, e) in enumerate(itertools.pairwise(bounds))]  # fmt: skip


def _chunk_logs(lm, c):
    """The chunk's log multipliers as sums of exactly the steps each factor spans (never a
    difference of running sums, which loses a small gate beside a large one and gives NaN for a
    gate of ``-inf``): ``(pairs, b, last, tail)`` with ``pairs[i, j] = lm_{j+1} + ... + lm_i``
    for ``j <= i`` (``-inf`` above the diagonal), ``b_i = lm_0 + ... + lm_i`` (the state into
    position ``i``), ``last`` ``(.., 1)`` the chunk's sum and ``tail_j = lm_{j+1} + ... +
    lm_{C-1}`` (position ``j`` to the chunk's end)."""
    x = lm[..., c]
    C = x.shape[-1]
    later = torch.ones(C, C, dtype=torch.bool, device=x.device).tril(-1)  # [s, j]: s > j
    pairs = torch.where(later, x[..., :, None], 0.0).cumsum(-2)
    tail = pairs[..., -1, :]
    pairs = pairs.masked_fill(~torch.ones_like(later).tril(), -torch.inf)
    b = torch.cumsum(x, dim=-1)
    return pairs, b, b[..., -1:], tail


def _groups(q, v, *per_value_head):
    """``q`` ``(N, Hk, L, E)`` as ``(N, Hk, 1, L, E)`` and ``v`` and the others (value heads
    first: ``(N, H, ...)``; None stays None) as ``(N, Hk, G, ...)``: views, no copies."""
    Hk = q.shape[1]
    G = v.shape[1] // Hk

    def split(t):
        return None if t is None else t.view(t.shape[0], Hk, G, *t.shape[2:])

    return (q[:, :, None], *(split(t) for t in (v, *per_value_head)))


def _value_heads(t):
    """A ``(N, Hk, G, ...)`` tensor of :func:`_groups` as ``(N, H, ...)``."""
    return None if t is None else t.flatten(1, 2)


def _forward_options(q, k, v, lm, init, scale):
    """``(out, final state)`` of ``S_t = exp(lm_t) S_{t-1} + k_t v_t^T``, ``out_t = s q_t^T S_t``
    from ``S_0 = init`` (zeros when None), chunk by chunk: ``b`` summed from the chunk's start,
    the scores ``(q_i . k_j) exp(b_i - b_j)``, the state entering as ``exp(b_i) q_i^T S`` and
    moving on as ``exp(b_C) S + sum_j exp(b_C - b_j) k_j v_j^T``."""
    q, v, lm, init = _groups(q, v, lm, init)
    k = k[:, :, None]
    out, state = _forward_groups(q, k, v, lm, init, scale)
    return _value_heads(out), _value_heads(state)


def _forward_groups(q, k, v, lm, init, scale):
    """:func:`_forward_options` on the views of :func:`_groups` (q, k broadcast over G)."""
    ct = compute_dtype(q.dtype)
    N, Hk, _, L, E = q.shape
    G, M = v.shape[2], v.shape[-1]
    out = torch.empty((N, Hk, G, L, M), dtype=q.dtype, device=q.device)
    state = (torch.zeros((N, Hk, G, E, M), dtype=ct, device=q.device) if init is None
             else init.to(ct, copy=True))  # fmt: skip
    floor = None if lm is None else state_floor((init, k, v), dtype=ct)
    for c in _chunks(L):
        qc, kc, vc = q[..., c, :].to(ct), k[..., c, :].to(ct), v[..., c, :].to(ct)
        if lm is None:
            oc = _causal_mm((qc @ _t(kc)).tril_(), vc).add_(qc @ state)
            state = state + _t(kc) @ vc
        else:
            pairs, b, last, tail = _chunk_logs(lm, c)
            oc = _causal_mm(_masked(qc @ _t(kc), gate_factors(pairs)), vc)
            oc.add_(gate_factors(b, floor)[..., None] * (qc @ state))
            state = _carry(state, last, kc * gate_factors(tail)[..., None], vc, floor)
        out[..., c, :] = oc if scale is None else oc.mul_(scale)
    return out, state


def _carry(state, last, a, c, floor):
    """The state carried past a chunk: ``exp(b_C) S + a^T c`` (``a`` weighted already), the
    factor on the state floored at ``floor`` (:func:`cakeops.helpers.state_floor`)."""
    return gate_factors(last, floor)[..., None] * state + _t(a) @ c


def _masked(scores, decays):
    """``scores * decays`` with the masked entries exactly 0 (no 0 * Inf)."""
    return (scores * decays).masked_fill_(decays == 0, 0.0)


def _backward_options(g, q, k, v, lm, init, g_final):
    """``(dq, dk, dv, gradient reaching S_0, final state S_T, dlm)`` of :func:`_forward_options`
    for the output's gradient ``g`` and the final state's ``g_final`` (None: zero); ``dlm``
    ``(N, H, L)`` the log multipliers' gradient (None without them).

    ``dq_i = S_i g_i`` runs forward in time (from ``init``); the gradient reaching each state,
    ``R_j = exp(lm_{j+1}) R_{j+1} + q_j g_j^T`` from ``R_T = g_final``, runs backward with
    ``dk_j = R_j v_j`` and ``dv_j = R_j^T k_j``. ``dlm_t = exp(lm_t) <R_t, S_{t-1}>`` is summed
    as the pairs crossing ``t`` (see :func:`cakeops.helpers.log_multiplier_grads`), from what
    the scans form anyway: the chunk's pairs (their scores times their values' products), its
    positions against the state entering (``q . dq`` of the state's part of ``dq``) and the
    gradient leaving (``k . dk`` of the carried part of ``dk``), and the pairs spanning it.

    Key heads shared by value heads (``q``, ``k`` of fewer heads than ``v``): on the views of
    :func:`_groups`, each chunk's ``dq`` and ``dk`` summed over the group as it is formed."""
    q, v, g, lm, init, g_final = _groups(q, v, g, lm, init, g_final)
    k = k[:, :, None]
    grads = _backward_groups(g, q, k, v, lm, init, g_final)
    dq, dk = (d[:, :, 0] for d in grads[:2])
    return (dq, dk, *(_value_heads(t) for t in grads[2:]))


def _group_sum(x):
    """A chunk's per-value-head ``(N, Hk, G, C, E)`` summed over each group (kept as G = 1)."""
    return x if x.shape[2] == 1 else x.sum(2, keepdim=True)


def _backward_groups(g, q, k, v, lm, init, g_final):
    """:func:`_backward_options` on the views of :func:`_groups` (q, k broadcast over G)."""
    ct = compute_dtype(q.dtype)
    N, Hk, _, L, E = q.shape
    G, M = v.shape[2], v.shape[-1]
    dq = torch.empty((N, Hk, 1, L, E), dtype=ct, device=q.device)
    dk, dv = torch.empty_like(dq), torch.empty((N, Hk, G, L, M), dtype=ct, device=q.device)
    dlm = None if lm is None else torch.empty((N, Hk, G, L), dtype=ct, device=q.device)
    state = (torch.zeros((N, Hk, G, E, M), dtype=ct, device=q.device) if init is None
             else init.to(ct, copy=True))  # fmt: skip
    entering = []  # per chunk: the state entering it
    # the factors on the states (S forward, R backward) floored at their scales
    floor = None if lm is None else state_floor((init, k, v), (g_final, q, g), dtype=ct)
    for c in _chunks(L):
        gc, kc, vc = g[..., c, :].to(ct), k[..., c, :].to(ct), v[..., c, :].to(ct)
        if lm is None:
            dqc = _causal_mm((gc @ _t(vc)).tril_(), kc).add_(gc @ _t(state))
            state = state + _t(kc) @ vc
        else:
            pairs, b, last, tail = _chunk_logs(lm, c)
            from_state = gate_factors(b, floor)[..., None] * (gc @ _t(state))
            dlm[..., c] = (q[..., c, :].to(ct) * from_state).sum(-1)
            entering.append(state)
            dqc = _causal_mm(_masked(gc @ _t(vc), gate_factors(pairs)), kc).add_(from_state)
            state = _carry(state, last, kc * gate_factors(tail)[..., None], vc, floor)
        dq[..., c, :] = _group_sum(dqc)
    final = state
    carry = (torch.zeros((N, Hk, G, E, M), dtype=ct, device=q.device) if g_final is None
             else g_final.to(ct, copy=True))  # fmt: skip
    for c in _chunks(L, reverse=True):
        gc, qc = g[..., c, :].to(ct), q[..., c, :].to(ct)
        kc, vc = k[..., c, :].to(ct), v[..., c, :].to(ct)
        if lm is None:
            gv, qk = (gc @ _t(vc)).tril_(), (qc @ _t(kc)).tril_()
            dkc = _causal_mm(_t(gv), qc, reverse=True).add_(vc @ _t(carry))
            dvc = _causal_mm(_t(qk), gc, reverse=True).add_(kc @ carry)
            carry = carry + _t(qc) @ gc
        else:
            pairs, b, last, tail = _chunk_logs(lm, c)
            decays_t = _t(gate_factors(pairs))  # [j, i]: the factors from j to i >= j
            tail = gate_factors(tail, floor)[..., None]  # from j to the chunk's end (onto R)
            kq, vg = kc @ _t(qc), _masked(vc @ _t(gc), decays_t)
            from_carry = tail * (vc @ _t(carry))
            dkc = _causal_mm(vg, qc, reverse=True).add_(from_carry)
            dvc = _causal_mm(_masked(kq, decays_t), gc, reverse=True)
            dvc.add_(tail * (kc @ carry))
            spanning = gate_factors(last[..., 0], floor) * (carry * entering.pop()).sum((-1, -2))
            pair = _t((vg * kq).masked_fill_(decays_t == 0, 0.0))  # [i, j]
            leaving = (kc * from_carry).sum(-1)
            dlm[..., c] = crossing_in_chunk(pair, dlm[..., c], leaving, spanning)
            carry = _carry(carry, last, qc * gate_factors(b)[..., None], gc, floor)
        dk[..., c, :], dv[..., c, :] = _group_sum(dkc), dvc
    return dq, dk, dv, carry, final, dlm


def _forward(q, k, v, scale=None):
    """The plain op (times ``scale``, applied in float32 before the output is rounded)."""
    ct = compute_dtype(q.dtype)
    N, H, L, E = q.shape
    out = torch.empty((N, H, L, v.shape[-1]), dtype=q.dtype, device=q.device)
    state = torch.zeros((N, H, E, v.shape[-1]), dtype=ct, device=q.device)  # sum_j k_j v_j^T
    for c in _chunks(L):
        qc, kc, vc = q[:, :, c].to(ct), k[:, :, c].to(ct), v[:, :, c].to(ct)
        scores = (qc @ _t(kc)).tril_()
        oc = _causal_mm(scores, vc)
        oc.add_(qc @ state)
        out[:, :, c] = oc if scale is None else oc.mul_(scale)
        state.add_(_t(kc) @ vc)
    return out


def _backward(g, q, k, v):
    ct = compute_dtype(q.dtype)
    N, H, L, E = q.shape
    M = v.shape[-1]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # dq_i = S_i g_i with S_i = sum_{j<=i} k_j v_j^T: a forward-time scan.
    state = torch.zeros((N, H, E, M), dtype=ct, device=q.device)
    for c in _chunks(L):
        gc, kc, vc = g[:, :, c].to(ct), k[:, :, c].to(ct), v[:, :, c].to(ct)
        gv = (gc @ _t(vc)).tril_()  # [i, j] = g_i . v_j, j <= i
        dqc = _causal_mm(gv, kc)
        dqc.add_(gc @ _t(state))
        dq[:, :, c] = dqc
        state.add_(_t(kc) @ vc)
    # dk_j = R_j v_j and dv_j = R_j^T k_j with R_j = sum_{i>=j} q_i g_i^T: a reverse-time scan.
    state.zero_()
    for c in _chunks(L, reverse=True):
        gc, qc = g[:, :, c].to(ct), q[:, :, c].to(ct)
        kc, vc = k[:, :, c].to(ct), v[:, :, c].to(ct)
        gv = (gc @ _t(vc)).tril_()
        qk = (qc @ _t(kc)).tril_()
        dkc = _causal_mm(_t(gv), qc, reverse=True)
        dkc.add_(vc @ _t(state))
        dvc = _causal_mm(_t(qk), gc, reverse=True)
        dvc.add_(kc @ state)
        dk[:, :, c] = dkc
        dv[:, :, c] = dvc
        state.add_(_t(qc) @ gc)
    return dq, dk, dv
