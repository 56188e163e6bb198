"""triton backend on a real CUDA device: what only a GPU shows.

Run by ``nox -s gpu`` (``pytest tests/gpu``); the default test run ignores this folder.
"""

from __future__ import annotations

import pytest
import torch

import cakeops

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (run by nox -s gpu)"
)


def test_moe_experts_never_waits_for_the_device():
    """Routing, the row-tile table and the launches queue without a host synchronisation, in the
    forward and in the backward (launch grids come from an upper bound on the row tiles)."""
    T, D, F, E, k = 256, 128, 96, 8, 2
    dev = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, D, **dev, requires_grad=True)
    logits = torch.randn(T, E, device="cuda", requires_grad=True)
    ws = [torch.randn(E, F, D, **dev) * 0.1 for _ in range(2)] + [torch.randn(E, D, F, **dev) * 0.1]
    ws = [w.requires_grad_() for w in ws]
    g = torch.randn(T, D, **dev)
    with cakeops.use_backend("triton"):
        cakeops.moe_experts(x, logits, *ws, top_k=k).backward(g)  # compile and tune first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            cakeops.moe_experts(x, logits, *ws, top_k=k).backward(g)
        finally:
            torch.cuda.set_sync_debug_mode("default")
