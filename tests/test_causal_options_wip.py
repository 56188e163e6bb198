"""WIP (#27): the chunked torch forward with the options against the float64 oracle (branch
wip/27-causal-options only; the op does not take the options yet)."""

from __future__ import annotations

import pytest
import torch

import cakeops
from cakeops.reference.causal_dot_product_options import scan
from cakeops_torch.causal_options_wip import forward

N, H, L, E, M = 2, 3, 150, 8, 6


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(N, H, L, E, generator=g) * 0.3 for _ in range(2))
    v = torch.randn(N, H, L, M, generator=g)
    options = {"log_decay": -torch.rand(H, generator=g) * 0.2,
               "log_gates": -torch.rand(N, H, L, generator=g) * 0.3,
               "initial_state": torch.randn(N, H, E, M, generator=g), "scale": 0.5}  # fmt: skip
    return q, k, v, options


@pytest.mark.parametrize("given", [(), ("log_decay",), ("log_gates",), ("log_decay", "log_gates",
                                   "initial_state", "scale")])  # fmt: skip
def test_chunked_forward_matches_the_oracle(given):
    q, k, v, options = _inputs()
    kw = {name: options[name] for name in given}
    out, final = forward(q, k, v, **kw)
    ref_out, ref_final = scan(q, k, v, **kw)
    assert cakeops.relative_error(out, ref_out) <= cakeops.tolerance(torch.float32)
    assert cakeops.relative_error(final, ref_final) <= cakeops.tolerance(torch.float32)


def test_packed_sequences_with_an_empty_one():
    q, k, v, options = _inputs()
    cu = torch.tensor([0, 70, 70, L])
    s0 = torch.randn(3, H, E, M)
    kw = {"log_decay": options["log_decay"], "log_gates": options["log_gates"][:1],
          "initial_state": s0, "cu_seqlens": cu}  # fmt: skip
    out, final = forward(q[:1], k[:1], v[:1], **kw)
    ref_out, ref_final = scan(q[:1], k[:1], v[:1], **kw)
    assert cakeops.relative_error(out, ref_out) <= cakeops.tolerance(torch.float32)
    assert cakeops.relative_error(final, ref_final) <= cakeops.tolerance(torch.float32)
    assert torch.equal(final[1], s0[1])  # an empty sequence hands its initial state on


def test_strong_decay_over_65536_steps_stays_finite():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 65536, 8, generator=g) for _ in range(3))
    out, final = forward(q, k, v, log_decay=torch.tensor([-30.0, -0.001]))
    assert torch.isfinite(out).all() and torch.isfinite(final).all()


GIVEN = [
    ("log_decay",),
    ("log_gates", "scale"),
    ("log_decay", "log_gates", "initial_state", "scale"),
]


@pytest.mark.parametrize("given", GIVEN)
@pytest.mark.parametrize("final", [False, True], ids=["no-final-grad", "final-grad"])
def test_chunked_backward_matches_the_oracle_autograd(given, final):
    from cakeops_torch.causal_options_wip import backward

    q, k, v, options = _inputs()
    g = torch.randn(N, H, L, M, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    g_final = torch.randn(N, H, E, M, generator=gen) if final else None
    tensors = {"q": q, "k": k, "v": v, **{n: options[n] for n in given if n != "scale"}}
    leaves = {n: t.double().requires_grad_() for n, t in tensors.items()}
    scale = options["scale"] if "scale" in given else None
    kw = {n: leaves[n] for n in leaves if n not in "qkv"}
    out, fin = scan(leaves["q"], leaves["k"], leaves["v"], scale=scale, **kw)
    loss = (out * g.double()).sum() + ((fin * g_final.double()).sum() if final else 0)
    want = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))
    got = backward(g, g_final, q, k, v, scale=scale, **{n: tensors[n] for n in kw})
    got = dict(zip(("q", "k", "v", "log_decay", "log_gates", "initial_state"), got, strict=True))
    for name, ref in want.items():
        assert cakeops.relative_error(got[name], ref) <= cakeops.tolerance(torch.float32), name
