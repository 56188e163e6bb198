"""WIP (#27): the float64 oracle of ``causal_dot_product`` with its options, a plain scan.

``S_t = exp(log_decay_h + log_gates_t) S_{t-1} + k_t v_t^T``, ``out_t = scale * q_t^T S_t``,
``S_0 = initial_state`` (per sequence with ``cu_seqlens``, the state reset at each start), the
final state ``S_T`` of each sequence. Differentiable by autograd in every input; a loop over
positions, so for short sequences only (the conformance suite's oracle, not a kernel).
"""

from __future__ import annotations

import itertools

import torch


def scan(q, k, v, *, scale=None, log_decay=None, log_gates=None, initial_state=None,
         cu_seqlens=None):  # fmt: skip
    """``(out (N, H, L, M), final_state (N or sequences, H, E, M))`` in float64."""
    q, k, v = q.double(), k.double(), v.double()
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
