"""``cakeops.helpers.log_multiplier_grads``, the log multipliers' gradients the GPU kernels of
``causal_dot_product`` take from PyTorch ops after them (on the CPU the conformance suite runs
it only under the emulators): against the float64 scan's autograd, within the float32
tolerance of the crossing terms' sizes, with packed sequences (an empty one, one longer than
a chunk), initial and final states, a hard reset and strong gates."""

from __future__ import annotations

import pytest
import torch

from cakeops import helpers
from cakeops.reference.causal_dot_product import scan
from cakeops.testing.test_causal_dot_product import assert_log_grads_match, log_multiplier_scale


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("gates", ["moderate", "strong", "reset"])
def test_crossing_sums_match_the_scan(packed, gates):
    gen = torch.Generator().manual_seed(0)
    N, H, L, E, M = (1, 2, 150, 5, 4) if packed else (2, 2, 150, 5, 4)
    cu = torch.tensor([0, 70, 70, 83, 150]) if packed else None
    rows = 4 if packed else N
    q, k, g = (torch.randn(N, H, L, d, generator=gen, dtype=torch.float64) for d in (E, E, M))
    v = torch.randn(N, H, L, M, generator=gen, dtype=torch.float64)
    init, g_final = (torch.randn(rows, H, E, M, generator=gen, dtype=torch.float64)
                     for _ in "ig")  # fmt: skip
    low, high = {"moderate": (-1.0, 0.0), "strong": (-12.0, -6.0), "reset": (-1.0, 0.0)}[gates]
    gates_ = torch.empty(N, H, L, dtype=torch.float64).uniform_(low, high, generator=gen)
    decay = torch.tensor([-0.05, -0.5], dtype=torch.float64)
    if gates == "reset":
        gates_[0, 0, 64] = gates_[0, 1, 100] = -torch.inf
    exact = {"q": q, "k": k, "v": v, "log_decay": decay, "log_gates": gates_,
             "initial_state": init}  # fmt: skip
    leaves = {n: t.clone().requires_grad_() for n, t in exact.items()}
    out, state = scan(*(leaves[n] for n in "qkv"), log_decay=leaves["log_decay"],
                      log_gates=leaves["log_gates"], initial_state=leaves["initial_state"],
                      cu_seqlens=cu)  # fmt: skip
    want = torch.autograd.grad((out * g).sum() + (state * g_final).sum(),
                               [leaves["log_decay"], leaves["log_gates"]])  # fmt: skip
    f = torch.float32
    lm = helpers.log_multipliers(q.float(), decay.float(), gates_.float())
    got = helpers.log_multiplier_grads(g.to(f), g_final.to(f), q.to(f), k.to(f), v.to(f), lm,
                                       init.to(f), cu, decay.float(), gates_.float())  # fmt: skip
    gamma = log_multiplier_scale(leaves, g, g_final, {"cu_seqlens": cu} if packed else {})
    assert_log_grads_match(got, want, gamma, f)
