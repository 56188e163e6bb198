"""Float64 reference math of ``gated_delta_rule``: the plain recurrence, one step at a time.

The oracle of the conformance suite: no chunking, no triangular solve, nothing but the
recurrence of the op's page, so that every backend's chunked form is checked against the
definition itself. Its backward is autograd through this loop.
"""

from __future__ import annotations

import itertools

import torch

from cakeops.ops.gated_delta_rule import L2NORM_EPS


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (``use_qk_l2norm``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def scan(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
         use_qk_l2norm=False):  # fmt: skip
    """``(out (N, Hv, L, V), final_state (sequences, Hv, K, V))`` in float64, differentiable."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    N, H, L, K = q.shape
    Hv, V = v.shape[1], v.shape[3]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    # value head h reads key head h // G
    q, k = (t.repeat_interleave(Hv // H, dim=1) for t in (q, k))
    scale = K**-0.5 if scale is None else scale
    kda = g.dim() == 4
    if cu_seqlens is None:
        sequences = [(n, 0, L) for n in range(N)]
    else:
        sequences = [(0, s, e) for s, e in itertools.pairwise(cu_seqlens.tolist())]
    rows: dict[int, list[torch.Tensor]] = {n: [] for n in range(N)}
    finals = []
    for i, (n, start, end) in enumerate(sequences):
        S = q.new_zeros(Hv, K, V) if initial_state is None else initial_state[i].double()
        for t in range(start, end):
            decay = torch.exp(g[n, :, t])
            S = decay[:, :, None] * S if kda else decay[:, None, None] * S
            kt = k[n, :, t]
            u = beta[n, :, t, None] * (v[n, :, t] - torch.einsum("hkv,hk->hv", S, kt))
            S = S + kt[:, :, None] * u[:, None, :]
            rows[n].append(scale * torch.einsum("hkv,hk->hv", S, q[n, :, t]))
        finals.append(S)
    out = torch.stack(
        [torch.stack(rows[n], dim=1) if rows[n] else q.new_zeros(Hv, 0, V) for n in range(N)]
    )
    return out, torch.stack(finals)


def forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    out, final = scan(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)  # fmt: skip
    if not output_final_state:
        return out.to(q.dtype), q.new_empty(0)
    dtype = initial_state.dtype if initial_state is not None else (
        torch.float64 if q.dtype == torch.float64 else torch.float32)  # fmt: skip
    return out.to(q.dtype), final.to(dtype)


def backward(g_out, g_final, q, k, v, g, beta, scale=None, initial_state=None,
             output_final_state=False, cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    from cakeops._autograd import grads_by_autograd

    def fn(q, k, v, g, beta, initial_state):
        out, final = scan(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                          cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)  # fmt: skip
        loss = (out * g_out.double()).sum()
        if output_final_state and g_final.numel():
            loss = loss + (final * g_final.double()).sum()
        return loss

    one = torch.ones((), dtype=torch.float64)
    return grads_by_autograd(fn, one, (q, k, v, g, beta, initial_state), {})
