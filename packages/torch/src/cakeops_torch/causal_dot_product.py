"""Causal linear attention in plain PyTorch, chunked.

Within a chunk of ``CHUNK`` positions: a masked ``C x C`` score matrix times the chunk's values.
Across chunks: one running ``E x M`` state in float32. Never an ``L x L`` matrix, never a state per
position: peak extra memory is O(N H (L C + E M)) (the per-chunk float32 copies and scores).
The backward recomputes everything from q, k, v: a forward-time scan for dq and a reverse-time
scan for dk and dv.
"""

from __future__ import annotations

import torch

from cakeops import compute_dtype

CHUNK = 64


def _chunks(L: int, reverse: bool = False):
    starts = range(0, L, CHUNK)
    for s in reversed(starts) if reverse else starts:
        yield slice(s, min(s + CHUNK, L))


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def _causal_mm(scores: torch.Tensor, x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """``scores @ x`` for ``scores`` that are zero outside the causal range (lower triangle,
    upper with ``reverse``), with no masked zero times a NaN or Inf of ``x``: the non-finite
    entries enter through a running sum instead, so they reach only the rows in their causal
    range, as in the reference."""
    finite = torch.isfinite(x)
    out = scores @ x.where(finite, 0)
    bad = x.masked_fill(finite, 0)
    out.add_(bad.flip(-2).cumsum(-2).flip(-2) if reverse else bad.cumsum(-2))
    return out


def forward(q, k, v, scale=None, log_decay=None, log_gates=None, initial_state=None,
            output_final_state=False, cu_seqlens=None):  # fmt: skip
    options = (scale, log_decay, log_gates, initial_state, cu_seqlens)
    if all(o is None for o in options) and not output_final_state:
        return _forward(q, k, v), q.new_empty(0)
    from cakeops_torch import causal_options_wip as wip

    out, final = wip.forward(q, k, v, scale, log_decay, log_gates, initial_state, cu_seqlens)
    if not output_final_state:
        return out, q.new_empty(0)
    dtype = initial_state.dtype if initial_state is not None else compute_dtype(q.dtype)
    return out, final.to(dtype)


def backward(g, g_final, q, k, v, scale=None, log_decay=None, log_gates=None,
             initial_state=None, output_final_state=False, cu_seqlens=None):  # fmt: skip
    options = (scale, log_decay, log_gates, initial_state, cu_seqlens)
    if all(o is None for o in options) and not output_final_state:
        return (*_backward(g, q, k, v), None, None, None)
    from cakeops_torch import causal_options_wip as wip

    g_final = g_final if output_final_state and g_final.numel() else None
    return wip.backward(g, g_final, q, k, v, scale, log_decay, log_gates, initial_state,
                        cu_seqlens)  # fmt: skip


def _forward(q, k, v):
    ct = compute_dtype(q.dtype)
    N, H, L, E = q.shape
    out = torch.empty((N, H, L, v.shape[-1]), dtype=q.dtype, device=q.device)
    state = torch.zeros((N, H, E, v.shape[-1]), dtype=ct, device=q.device)  # sum_j k_j v_j^T
    for c in _chunks(L):
        qc, kc, vc = q[:, :, c].to(ct), k[:, :, c].to(ct), v[:, :, c].to(ct)
        scores = (qc @ _t(kc)).tril_()
        oc = _causal_mm(scores, vc)
        oc.add_(qc @ state)
        out[:, :, c] = oc
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
