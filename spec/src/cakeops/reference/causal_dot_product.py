"""Float64 reference math of ``causal_dot_product``.

Written as scans of per-position states, with no masked product anywhere, so that every output
and gradient entry is computed from exactly the values it depends on: a NaN or Inf reaches
what depends on it and nothing else (the non-finite contract of the op's docs page).
"""

from __future__ import annotations

import itertools

import torch


def _states(a: torch.Tensor, b: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """``S_i = sum_{j <= i} a_j b_j^T`` (``j >= i`` with ``reverse``): ``(N, H, L, E, M)``."""
    outer = a.unsqueeze(-1) * b.unsqueeze(-2)
    if reverse:
        return torch.cumsum(outer.flip(2), dim=2).flip(2)
    return torch.cumsum(outer, dim=2)


def value_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``q`` or ``k`` ``(N, Hk, L, E)`` repeated to the ``heads`` value heads (head ``h`` reads
    ``h // (heads / Hk)``); differentiable, so that autograd sums each group's gradients."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // max(t.shape[1], 1), dim=1)


def math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``out_i = q_i^T S_i`` with ``S_i = sum_{j<=i} k_j v_j^T`` in float64. Differentiable;
    memory ``L x E x M`` per head."""
    H = v.shape[1]
    q, k, v = value_heads(q.double(), H), value_heads(k.double(), H), v.double()
    return torch.einsum("nhle,nhlem->nhlm", q, _states(k, v))


def _empty(q):
    return q.new_empty(0)


def forward(q, k, v, scale=None, log_decay=None, log_gates=None, initial_state=None,
            output_final_state=False, cu_seqlens=None):  # fmt: skip
    options = (scale, log_decay, log_gates, initial_state, cu_seqlens)
    if all(o is None for o in options) and not output_final_state:
        return math(q, k, v).to(q.dtype), _empty(q)
    out, final = scan(q, k, v, scale=scale, log_decay=log_decay, log_gates=log_gates,
                      initial_state=initial_state, cu_seqlens=cu_seqlens)  # fmt: skip
    dtype = initial_state.dtype if initial_state is not None else final.dtype
    if q.dtype != torch.float64 and initial_state is None:
        dtype = torch.float32
    return out.to(q.dtype), (final.to(dtype) if output_final_state else _empty(q))


def backward(g, g_final, q, k, v, scale=None, log_decay=None, log_gates=None,
             initial_state=None, output_final_state=False, cu_seqlens=None):  # fmt: skip
    options = (scale, log_decay, log_gates, initial_state, cu_seqlens)
    if all(o is None for o in options) and not output_final_state:
        return (*_plain_backward(g, q, k, v), None, None, None)
    from cakeops._autograd import grads_by_autograd

    def fn(q, k, v, log_decay, log_gates, initial_state):
        out, final = scan(q, k, v, scale=scale, log_decay=log_decay, log_gates=log_gates,
                          initial_state=initial_state, cu_seqlens=cu_seqlens)  # fmt: skip
        if output_final_state and g_final.numel():
            # one scalar whose gradient is (g, g_final): the two outputs' gradients together
            return (out * g.double()).sum() + (final * g_final.double()).sum()
        return (out * g.double()).sum()

    one = torch.ones((), dtype=torch.float64)
    return grads_by_autograd(fn, one, (q, k, v, log_decay, log_gates, initial_state), {})


def _plain_backward(g, q, k, v):
    """``dq_i = S_i g_i``, ``dk_j = R_j v_j``, ``dv_j = R_j^T k_j`` with
    ``R_j = sum_{i>=j} q_i g_i^T``, in float64 (each key head's gradients summed over the value
    heads reading it)."""
    H = v.shape[1]
    gd, vd = g.double(), v.double()
    qd, kd = value_heads(q.double(), H), value_heads(k.double(), H)
    dq = torch.einsum("nhlem,nhlm->nhle", _states(kd, vd), gd)
    rev = _states(qd, gd, reverse=True)
    dk = torch.einsum("nhlem,nhlm->nhle", rev, vd)
    dv = torch.einsum("nhlem,nhle->nhlm", rev, kd)
    N, Hk, L, E = q.shape
    dq, dk = (d.reshape(N, Hk, H // max(Hk, 1), L, E).sum(2) for d in (dq, dk))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def scan(q, k, v, *, scale=None, log_decay=None, log_gates=None, initial_state=None,
         cu_seqlens=None):  # fmt: skip
    """``(out (N, H, L, M), final_state (N or sequences, H, E, M))`` in float64."""
    H = v.shape[1]
    q, k, v = value_heads(q.double(), H), value_heads(k.double(), H), v.double()
    N, H, L, E = q.shape
    M = v.shape[-1]
    zero = q.new_zeros(())
    if cu_seqlens is None:
        sequences = [(n, 0, L) for n in range(N)]
    else:
        offsets = cu_seqlens.tolist()
        sequences = [(0, s, e) for s, e in itertools.pairwise(offsets)]
    rows: dict[int, list[torch.Tensor]] = {n: [] for n in range(N)}
    finals = []
    for i, (n, start, end) in enumerate(sequences):
        state = q.new_zeros(H, E, M) if initial_state is None else initial_state[i].double()
        for t in range(start, end):
            log_mult = zero.expand(H)
            if log_decay is not None:
                log_mult = log_mult + log_decay.double()
            if log_gates is not None:
                log_mult = log_mult + log_gates[n, :, t].double()
            state = (
                torch.exp(log_mult)[:, None, None] * state
                + k[n, :, t, :, None] * v[n, :, t, None, :]
            )
            rows[n].append(torch.einsum("he,hem->hm", q[n, :, t], state))
        finals.append(state)
    scale = 1.0 if scale is None else scale
    out = torch.stack(
        [torch.stack(rows[n], dim=1) if rows[n] else q.new_zeros(H, 0, M) for n in range(N)]
    )
    return out * scale, torch.stack(finals)
