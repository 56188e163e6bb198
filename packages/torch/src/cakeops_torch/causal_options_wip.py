"""WIP (#27): the chunked forward of ``causal_dot_product`` with its options, in PyTorch.

Per chunk of ``CHUNK`` positions, ``b_t`` is the cumulative log multiplier from the chunk's
start (``<= 0``, falling). Within the chunk the scores are ``(q_i . k_j) exp(b_i - b_j)`` for
``j <= i``; the carried state enters as ``exp(b_i) q_i^T S`` and moves on as
``exp(b_C) S + sum_j exp(b_C - b_j) k_j v_j^T``. Every exponent is ``<= 0``, so nothing
overflows, and a strong decay only underflows to zero. This is not wired into the op yet: see
``WIP-27.md``.
"""

from __future__ import annotations

import itertools

import torch

from cakeops import compute_dtype

CHUNK = 64


def _segments(N: int, L: int, cu_seqlens):
    """``(row, start, end)`` of every sequence: the batch rows, or the packed sequences."""
    if cu_seqlens is None:
        return [(n, 0, L) for n in range(N)]
    offsets = cu_seqlens.tolist()
    return [(0, s, e) for s, e in itertools.pairwise(offsets)]


def forward(q, k, v, scale=None, log_decay=None, log_gates=None, initial_state=None,
            cu_seqlens=None):  # fmt: skip
    """``(out (N, H, L, M) in q.dtype, final states (N or sequences, H, E, M) float32)``."""
    ct = compute_dtype(q.dtype)
    N, H, L, E = q.shape
    M = v.shape[-1]
    log_mult = torch.zeros((N, H, L), dtype=ct, device=q.device)
    if log_decay is not None:
        log_mult += log_decay.to(ct)[None, :, None]
    if log_gates is not None:
        log_mult += log_gates.to(ct)
    out = torch.empty((N, H, L, M), dtype=ct, device=q.device)
    finals = []
    for i, (n, start, end) in enumerate(_segments(N, L, cu_seqlens)):
        state = (torch.zeros((H, E, M), dtype=ct, device=q.device) if initial_state is None
                 else initial_state[i].to(ct).clone())  # fmt: skip
        for s in range(start, end, CHUNK):
            c = slice(s, min(s + CHUNK, end))
            qc, kc, vc = q[n, :, c].to(ct), k[n, :, c].to(ct), v[n, :, c].to(ct)
            b = torch.cumsum(log_mult[n, :, c], dim=-1)  # (H, C), <= 0
            causal = torch.ones(b.shape[-1], b.shape[-1], dtype=torch.bool, device=q.device).tril()
            decay = torch.exp((b[:, :, None] - b[:, None, :]).masked_fill(~causal, -torch.inf))
            scores = (qc @ kc.transpose(-1, -2)) * decay
            out[n, :, c] = scores @ vc + torch.exp(b)[..., None] * (qc @ state)
            last = b[:, -1:]
            state = (
                torch.exp(last)[..., None] * state
                + (kc * torch.exp(last - b)[..., None]).transpose(-1, -2) @ vc
            )
        finals.append(state)
    if scale is not None:
        out *= scale
    return out.to(q.dtype), torch.stack(finals)


def _log_multipliers(N, H, L, log_decay, log_gates, ct, device):
    log_mult = torch.zeros((N, H, L), dtype=ct, device=device)
    if log_decay is not None:
        log_mult += log_decay.to(ct)[None, :, None]
    if log_gates is not None:
        log_mult += log_gates.to(ct)
    return log_mult


def backward(g, g_final, q, k, v, scale=None, log_decay=None, log_gates=None, initial_state=None,
             cu_seqlens=None):  # fmt: skip
    """``(dq, dk, dv, dlog_decay, dlog_gates, dinitial_state)`` (None for an option not given)
    for the gradients ``g`` of ``out`` and ``g_final`` of the final states (None: zero).

    dS_t, the gradient reaching the state S_t, runs backward in time from ``g_final``:
    ``dk_j = dS_j v_j``, ``dv_j = dS_j^T k_j``; ``dq_i = s S_i g_i`` runs forward. The log
    multipliers' gradient is the reverse cumulative sum, per sequence, of
    ``q_t . dq_t - k_t . dk_t`` (plus ``<g_final, S_T>`` at each sequence's end); the initial
    state's is the gradient that reaches S_0."""
    ct = compute_dtype(q.dtype)
    N, H, L, E = q.shape
    M = v.shape[-1]
    s = 1.0 if scale is None else scale
    log_mult = _log_multipliers(N, H, L, log_decay, log_gates, ct, q.device)
    dq = torch.zeros((N, H, L, E), dtype=ct, device=q.device)
    dk, dv = torch.zeros_like(dq), torch.zeros((N, H, L, M), dtype=ct, device=q.device)
    db = torch.zeros((N, H, L), dtype=ct, device=q.device)  # dL/db_t, b the cumulative log
    d_initial = []
    for i, (n, start, end) in enumerate(_segments(N, L, cu_seqlens)):
        state = (torch.zeros((H, E, M), dtype=ct, device=q.device) if initial_state is None
                 else initial_state[i].to(ct).clone())  # fmt: skip
        # forward in time: dq_i = s S_i g_i
        for c0 in range(start, end, CHUNK):
            c = slice(c0, min(c0 + CHUNK, end))
            gc, kc, vc = g[n, :, c].to(ct), k[n, :, c].to(ct), v[n, :, c].to(ct)
            b = torch.cumsum(log_mult[n, :, c], dim=-1)
            decay = _decay(b)
            dq[n, :, c] = s * (
                ((gc @ vc.transpose(-1, -2)) * decay) @ kc
                + torch.exp(b)[..., None] * (gc @ state.transpose(-1, -2))
            )
            last = b[:, -1:]
            state = (
                torch.exp(last)[..., None] * state
                + (kc * torch.exp(last - b)[..., None]).transpose(-1, -2) @ vc
            )
        final = state
        # backward in time: the gradient reaching each state, from the final state's
        carry = (torch.zeros((H, E, M), dtype=ct, device=q.device) if g_final is None
                 else g_final[i].to(ct).clone())  # fmt: skip
        if g_final is not None and end > start:
            db[n, :, end - 1] += (g_final[i].to(ct) * final).sum((-1, -2))
        chunk_starts = list(range(start, end, CHUNK))
        for c0 in reversed(chunk_starts):
            c = slice(c0, min(c0 + CHUNK, end))
            gc, qc = g[n, :, c].to(ct), q[n, :, c].to(ct)
            kc, vc = k[n, :, c].to(ct), v[n, :, c].to(ct)
            b = torch.cumsum(log_mult[n, :, c], dim=-1)
            decay_t = _decay(b).transpose(-1, -2)  # [j, i] = exp(b_i - b_j), i >= j
            last = b[:, -1:]
            tail = torch.exp(last - b)[..., None]  # exp(b_{C-1} - b_j)
            dk[n, :, c] = s * (((vc @ gc.transpose(-1, -2)) * decay_t) @ qc) + tail * (
                vc @ carry.transpose(-1, -2)
            )
            dv[n, :, c] = s * (((kc @ qc.transpose(-1, -2)) * decay_t) @ gc) + tail * (kc @ carry)
            carry = (
                s * (qc * torch.exp(b)[..., None]).transpose(-1, -2) @ gc
                + torch.exp(last)[..., None] * carry
            )
        d_initial.append(carry)
        seg = slice(start, end)
        db[n, :, seg] += (q[n, :, seg].to(ct) * dq[n, :, seg]).sum(-1) - (
            k[n, :, seg].to(ct) * dk[n, :, seg]
        ).sum(-1)
        # dL/dlog_mult_t = sum over the sequence's positions i >= t of dL/db_i
        db[n, :, seg] = db[n, :, seg].flip(-1).cumsum(-1).flip(-1)
    d_decay = None if log_decay is None else db.sum((0, 2)).to(log_decay.dtype)
    d_gates = None if log_gates is None else db.to(log_gates.dtype)
    d_init = None if initial_state is None else torch.stack(d_initial).to(initial_state.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_decay, d_gates, d_init


def _decay(b: torch.Tensor) -> torch.Tensor:
    """``[i, j] = exp(b_i - b_j)`` for ``j <= i``, 0 above (never an exp of a positive)."""
    C = b.shape[-1]
    causal = torch.ones(C, C, dtype=torch.bool, device=b.device).tril()
    return torch.exp((b[:, :, None] - b[:, None, :]).masked_fill(~causal, -torch.inf))
