"""WIP (#27): the chunked forward of ``causal_dot_product`` with its options, in PyTorch.

Per chunk of ``CHUNK`` positions, ``b_t`` is the cumulative log multiplier from the chunk's
start (``<= 0``, falling). Within the chunk the scores are ``(q_i . k_j) exp(b_i - b_j)`` for
``j <= i``; the carried state enters as ``exp(b_i) q_i^T S`` and moves on as
``exp(b_C) S + sum_j exp(b_C - b_j) k_j v_j^T``. Every exponent is ``<= 0``, so nothing
overflows, and a strong decay only underflows to zero. This is not wired into the op yet: see
``WIP-27.md``.
"""

from __future__ import annotations

import torch

from cakeops import compute_dtype

CHUNK = 64


def _segments(N: int, L: int, cu_seqlens):
    """``(row, start, end)`` of every sequence: the batch rows, or the packed sequences."""
    if cu_seqlens is None:
        return [(n, 0, L) for n in range(N)]
    offsets = cu_seqlens.tolist()
    return [(0, s, e) for s, e in zip(offsets[:-1], offsets[1:], strict=True)]


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
