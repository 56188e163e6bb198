"""The float64 oracle of ``causal_dot_product``'s options (``reference.causal_dot_product.scan``)
against independent statements of the same math: the conformance suite trusts it."""

from __future__ import annotations

import torch

from cakeops.reference.causal_dot_product import math, scan

N, H, L, E, M = 2, 3, 37, 5, 4


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(N, H, L, E, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(N, H, L, M, generator=g, dtype=torch.float64)
    return q, k, v, g


def test_without_options_it_is_the_plain_op():
    q, k, v, _ = _inputs()
    out, final = scan(q, k, v)
    torch.testing.assert_close(out, math(q, k, v))
    torch.testing.assert_close(final, torch.einsum("nhle,nhlm->nhem", k, v))


def test_decay_and_gates_are_the_masked_decay_matrix():
    """``out = scale ((q k^T) * D) v`` with ``D_ij = exp(sum_{j<t<=i} lm_t)`` below the
    diagonal, plus ``exp(sum_{t<=i} lm_t) q_i^T S_0``: the composite a user would write."""
    q, k, v, g = _inputs(1)
    log_decay = -torch.rand(H, generator=g, dtype=torch.float64)
    log_gates = -torch.rand(N, H, L, generator=g, dtype=torch.float64)
    s0 = torch.randn(N, H, E, M, generator=g, dtype=torch.float64)
    out, final = scan(q, k, v, scale=0.3, log_decay=log_decay, log_gates=log_gates,
                      initial_state=s0)  # fmt: skip
    b = torch.cumsum(log_decay[None, :, None] + log_gates, dim=-1)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    D = torch.exp(b[..., :, None] - b[..., None, :]) * causal
    want = ((q @ k.transpose(-1, -2)) * D) @ v + torch.exp(b)[..., None] * (q @ s0)
    torch.testing.assert_close(out, 0.3 * want)
    want_final = torch.exp(b[..., -1])[..., None, None] * s0 + torch.einsum(
        "nhl,nhle,nhlm->nhem", torch.exp(b[..., -1:] - b), k, v
    )
    torch.testing.assert_close(final, want_final)


def test_packed_sequences_are_separate_sequences():
    q, k, v, g = _inputs(2)
    cu = torch.tensor([0, 12, 12, 30, L])
    s0 = torch.randn(4, H, E, M, generator=g, dtype=torch.float64)
    log_gates = -torch.rand(1, H, L, generator=g, dtype=torch.float64)
    out, final = scan(q[:1], k[:1], v[:1], log_gates=log_gates, initial_state=s0, cu_seqlens=cu)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        part = (slice(0, 1), slice(None), slice(s, e))
        o, f = scan(
            q[part], k[part], v[part], log_gates=log_gates[part], initial_state=s0[i : i + 1]
        )
        torch.testing.assert_close(out[part], o)
        torch.testing.assert_close(final[i : i + 1], f)
    assert torch.equal(final[1], s0[1])  # an empty sequence hands its initial state on


def test_a_prefill_then_its_continuation_is_the_whole_sequence():
    q, k, v, g = _inputs(3)
    log_decay = -torch.rand(H, generator=g, dtype=torch.float64)
    out, final = scan(q, k, v, log_decay=log_decay)
    first, state = scan(q[:, :, :20], k[:, :, :20], v[:, :, :20], log_decay=log_decay)
    rest, end = scan(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], log_decay=log_decay,
                     initial_state=state)  # fmt: skip
    torch.testing.assert_close(out, torch.cat([first, rest], dim=2))
    torch.testing.assert_close(final, end)
