"""The gated delta rule (and KDA) in plain PyTorch, step by step: calls of at most
``RECURRENT_UP_TO`` positions forward (a decode step in its fewest ops, :func:`_step`; two to
four positions as :func:`_recurrent`) and one position backward (:func:`_step_backward`), where
a padded chunk's machinery would cost more than the math."""

from __future__ import annotations

import torch

from cakeops import compute_dtype
from cakeops.helpers import (
    as_dtype,
    cast_grads,
    state_times,
)

from .._compile import FAILED, run_compiled, use_compiled
from ._common import OP, _inverse_norms

#: On the CPU, a recurrence of 2 to ``RECURRENT_UP_TO`` positions, and a one-position backward,
#: whose state has at least this many elements runs as one inductor-compiled function (faster
#: than twenty small ops for a decode step's backward at Qwen3-Next's widths); smaller
#: ones, as tests use, eagerly (no compile per shape). A one-position forward is always eager
#: (:func:`_step`).
RECURRENT_COMPILE_MIN_STATE = 1 << 15


def _run_step(fn, v, K, *args):
    """``fn(*args)``, inductor-compiled where the step's state (``v``'s heads times ``K`` by
    ``V``) is large enough to repay it (about half the eager ops' time), eagerly otherwise or
    when compiling failed."""
    N, Hv, _, V = v.shape
    if use_compiled(v, 0) and N * Hv * K * V >= RECURRENT_COMPILE_MIN_STATE:
        result = run_compiled(OP, fn, *args)
        if result is not FAILED:
            return result
    return fn(*args)


def _recurrent(q, k, v, g, beta, scale, initial_state, use_qk_l2norm):
    """``(out (N, Hv, L, V), final (N, H, G, K, V))`` one step at a time (no packing; two to
    ``RECURRENT_UP_TO`` positions, one is :func:`_step`'s), in as few ops as the recurrence
    allows: a decode step's cost is the ops' count, not their size."""
    N, H, L, K = q.shape
    Hv, V = v.shape[1], v.shape[3]
    G = Hv // H
    ct = compute_dtype(q.dtype)
    q, k = q.to(ct), k.to(ct)
    if use_qk_l2norm:
        q, k = q * _inverse_norms(q).mul_(scale), k * _inverse_norms(k)
    else:
        q = q * scale
    # (N, H, G, L, Kg, 1): the gate of S's rows; views split the head dim (any strides)
    decay = torch.exp(g.to(ct)).view(N, H, G, L, 1, -1).transpose(-1, -2)
    v = v.to(ct).view(N, H, G, L, 1, V)
    beta = beta.to(ct).view(N, H, G, L, 1, 1)
    q, k = q.view(N, H, 1, L, 1, K), k.view(N, H, 1, L, 1, K)
    if initial_state is None:
        S = torch.zeros(N, H, G, K, V, dtype=ct, device=q.device)
    else:
        S = initial_state.to(ct).view(N, H, G, K, V)
    out = []
    for t in range(L):
        S = S * decay[:, :, :, t]  # a new tensor: the caller's state is never written
        kt = k[:, :, :, t]  # (N, H, 1, 1, K)
        u = (v[:, :, :, t] - kt @ S).mul_(beta[:, :, :, t])  # (N, H, G, 1, V)
        S.addcmul_(kt.transpose(-1, -2), u)
        out.append(q[:, :, :, t] @ S)
    out = torch.cat(out, -2)  # (N, H, G, L, V)
    return out.view(N, Hv, L, V), S


def _step(q, k, v, g, beta, scale, initial_state, use_qk_l2norm):
    """:func:`_recurrent` of one position (a decode step) in its fewest ops, eagerly: measured
    against the inductor-compiled recurrence, faster at every size from 4 value heads of 16 to
    32 of 128 (the compiled function's call costs more than the ops it fuses, above all with
    caches cold)."""
    N, H, _, K = q.shape
    Hv, V = v.shape[1], v.shape[3]
    G, ct = Hv // H, compute_dtype(q.dtype)
    q, k = as_dtype(q, ct), as_dtype(k, ct)
    if use_qk_l2norm:
        q, k = q * _inverse_norms(q).mul_(scale), k * _inverse_norms(k)
    else:
        q = q * scale
    # (N, H, G, Kg, 1): the gate of S's rows (Kg 1, or K for a gate per key channel)
    decay = as_dtype(g, ct).exp().view(N, H, G, 1, -1).transpose(-1, -2)
    if initial_state is None:  # (zeros times the gate: a NaN gate reaches S, as in the math)
        S = torch.zeros(N, H, G, K, V, dtype=ct, device=q.device) * decay
    else:
        # a new tensor: the caller's state is never written
        S = as_dtype(initial_state, ct).view(N, H, G, K, V) * decay
    kt = k.view(N, H, 1, 1, K)
    u = (as_dtype(v, ct).view(N, H, G, 1, V) - kt @ S).mul_(as_dtype(beta, ct).view(N, H, G, 1, 1))
    S.addcmul_(kt.mT, u)
    return (q.view(N, H, 1, 1, K) @ S).view(N, Hv, 1, V), S


def forward(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
            cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    """Two to ``RECURRENT_UP_TO`` positions, or a decode step's one, step by step."""
    N, _, L, K = q.shape
    Hv, V = v.shape[1], v.shape[3]
    if L == 1:
        out, S = _step(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
    else:
        out, S = _run_step(_recurrent, v, K, q, k, v, g, beta, scale, initial_state,
                           use_qk_l2norm)  # fmt: skip
    if not output_final_state:
        return as_dtype(out, q.dtype), q.new_empty(0)
    dtype = initial_state.dtype if initial_state is not None else S.dtype
    return as_dtype(out, q.dtype), as_dtype(S.reshape(N, Hv, K, V), dtype)


def _step_backward(g_out, g_final, q, k, v, g, beta, scale, initial_state, use_qk_l2norm):
    """The gradients of one position (``L = 1``, no packing): a decode step's few products
    instead of the chunked backward's machinery. With ``S' = a S_0`` (``a`` the gate, per key
    channel for KDA), ``u = beta (v - S'^T k)``, ``S = S' + k u^T``, ``o = s S^T q`` (q and k
    normalised with ``use_qk_l2norm``) and ``R = s q g_o^T + g_final`` the gradient reaching
    ``S``: ``dq = s S g_o``, ``du = R^T k``, ``dk = R u - S' beta du``, ``dv = beta du``,
    ``dbeta = du . (v - S'^T k)``, ``dS' = R - k (beta du)^T``, ``dS_0 = a dS'`` and the log
    gate's ``a <dS', S_0>`` (per key channel for KDA)."""
    N, H, _, K = q.shape
    Hv, V = v.shape[1], v.shape[3]
    G = Hv // H
    ct = compute_dtype(q.dtype)
    qn, kn = q[:, :, 0].to(ct), k[:, :, 0].to(ct)  # (N, H, K)
    if use_qk_l2norm:
        rq, rk = _inverse_norms(qn), _inverse_norms(kn)
        qn, kn = qn * rq, kn * rk
    a = torch.exp(g[:, :, 0].to(ct)).reshape(N, H, G, -1)  # (N, H, G, 1 or K)
    vt = v[:, :, 0].to(ct).reshape(N, H, G, V)
    bt = beta[:, :, 0].to(ct).reshape(N, H, G, 1)
    go = g_out[:, :, 0].to(ct).reshape(N, H, G, V)
    qg, kg = qn[:, :, None, :], kn[:, :, None, :]  # (N, H, 1, K)
    sq = qg * scale
    S0 = None if initial_state is None else initial_state.to(ct).reshape(N, H, G, K, V)
    gf = None if g_final is None else g_final.to(ct).reshape(N, H, G, K, V)
    # S'^T k = S_0^T (a k): one read of S_0 (S' is never made)
    r = vt if S0 is None else vt - ((a * kg)[..., None, :] @ S0)[..., 0, :]  # (N, H, G, V)
    u = bt * r
    du = go * torch.linalg.vecdot(sq, kg)[..., None]  # R^T k = s g_o (q . k) + G^T k
    if gf is not None:
        du = du + (kg[..., None, :] @ gf)[..., 0, :]
    bdu = bt * du
    ug = torch.linalg.vecdot(u, go)[..., None]  # (N, H, G, 1)
    dqn = kg * ug  # s S g_o = s (a S_0 g_o + k (u . g_o))
    dkn = sq * ug  # R u - S' bdu = s q (g_o . u) + G u - a S_0 bdu
    if gf is not None:
        dkn = dkn + state_times(gf, u)
    if S0 is not None:
        # one more read of S_0, the two vectors as rows (see state_times)
        S0go, S0bdu = (torch.stack([go, bdu], -2) @ S0.mT).unbind(-2)
        dqn = dqn + a * S0go
        dkn = dkn - a * S0bdu
    dqn = dqn * scale
    dq, dk = dqn.sum(2), dkn.sum(2)  # the value heads of a key head summed: (N, H, K)
    if use_qk_l2norm:  # through x / sqrt(|x|^2 + eps)
        dq = rq * (dq - qn * (qn * dq).sum(-1, keepdim=True))
        dk = rk * (dk - kn * (kn * dk).sum(-1, keepdim=True))
    if S0 is None:
        dg = torch.zeros(N, H, G, a.shape[-1], dtype=ct, device=q.device)
        d_init = None
    else:
        # dS' = R - k bdu^T = G + (s q) g_o^T - k bdu^T: the two outer products as one
        # product of rank 2 (a folded in), G added once; a <dS', S_0> per key row from vectors
        sides = torch.stack([sq, -kg], -1) * a[..., None]  # (N, H, G, K, 2)
        d_init = sides @ torch.stack([go, bdu], -2)  # (N, H, G, K, V)
        if gf is not None:
            d_init = d_init.addcmul_(gf, a[..., None])
        d_init = d_init.reshape(initial_state.shape).to(initial_state.dtype)
        rows = sq * S0go - kg * S0bdu  # <dS', S_0> per key row: (N, H, G, K)
        if gf is not None:
            rows = rows + torch.linalg.vecdot(gf, S0)
        dg = rows * a if g.dim() == 4 else rows.sum(-1, keepdim=True) * a
    dg = dg.reshape(N, Hv, 1, -1) if g.dim() == 4 else dg.reshape(N, Hv, 1)
    grads = (dq[:, :, None], dk[:, :, None], bdu.reshape(N, Hv, 1, V),
             dg, (du * r).sum(-1).reshape(N, Hv, 1))  # fmt: skip
    return (*cast_grads(grads, (q, k, v, g, beta)), d_init)


def backward(g_out, g_final, q, k, v, g, beta, scale, initial_state=None,
             output_final_state=False, cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    """One position's gradients (:func:`_step_backward`)."""
    K = q.shape[3]
    has_final = output_final_state and g_final.numel() > 0
    args = (g_out, g_final if has_final else None, q, k, v, g, beta, scale, initial_state,
            use_qk_l2norm)  # fmt: skip
    return _run_step(_step_backward, v, K, *args)
