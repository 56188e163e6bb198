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


DECODE_OPS = ("rmsnorm_silu_gate", "gated_delta_rule", "causal_dot_product", "moe_experts",
              "routed_experts", "causal_conv1d")  # fmt: skip


def _decode_steps(dtype: torch.dtype) -> dict:
    """Each op as a patched model calls it for one generated token (batch 1), as a function of
    no arguments."""
    dev = dict(device="cuda", dtype=dtype)
    H, Hv, D, E, F, k = 4, 8, 64, 8, 128, 2
    x, z, w = torch.randn(Hv, D, **dev), torch.randn(Hv, D, **dev), torch.ones(D, **dev)
    q, kk = (torch.randn(1, 1, H, D, **dev).transpose(1, 2) for _ in range(2))
    v = torch.randn(1, 1, Hv, D, **dev).transpose(1, 2)
    g = -torch.rand(1, 1, Hv, device="cuda").transpose(1, 2)
    beta = torch.rand(1, 1, Hv, **dev).transpose(1, 2)
    state = torch.randn(1, Hv, D, D, device="cuda") * 0.1
    qc, kc, vc = (torch.randn(1, Hv, 1, D, **dev) * D**-0.5 for _ in range(3))
    decay = -torch.rand(Hv, device="cuda")
    h = torch.randn(1, D * 4, **dev)
    logits = torch.randn(1, E, device="cuda")
    ws = [torch.randn(E, F, D * 4, **dev) * 0.05 for _ in range(2)]
    ws.append(torch.randn(E, D * 4, F, **dev) * 0.05)
    index = torch.tensor([[3, 5]], device="cuda")
    weights = torch.tensor([[0.75, 0.25]], **dev)
    # a Gated DeltaNet layer's convolution: q, k and v's channels, width 4, the models' layout
    xc = torch.randn(1, 1, 2 * H * D + Hv * D, **dev).transpose(1, 2)
    wc, bc = torch.randn(xc.shape[1], 4, **dev), torch.randn(xc.shape[1], **dev)
    conv_state = torch.randn(1, xc.shape[1], 3, **dev)
    return {
        "causal_conv1d": lambda: cakeops.causal_conv1d(
            xc, wc, bc, activation="silu", initial_state=conv_state, output_final_state=True
        ),
        "rmsnorm_silu_gate": lambda: cakeops.rmsnorm_silu_gate(x, z, w, 1e-6),
        "gated_delta_rule": lambda: cakeops.gated_delta_rule(
            q, kk, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm=True
        ),
        "causal_dot_product": lambda: cakeops.causal_dot_product(
            qc, kc, vc, log_decay=decay, initial_state=state, output_final_state=True
        ),
        "moe_experts": lambda: cakeops.moe_experts(h, logits, *ws, top_k=k),
        "routed_experts": lambda: cakeops.routed_experts(h, index, weights, *ws),
    }


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("op", DECODE_OPS)
def test_a_decode_step_never_waits_and_replays_in_a_cuda_graph(backend, op):
    """#37: a decode step (no autograd, the lean path) queues without a host synchronisation,
    and a CUDA graph captured of it replays to the eager result."""
    step = _decode_steps(torch.bfloat16)[op]
    with cakeops.use_backend(backend), torch.no_grad():
        eager = step()  # compile, tune, remember the signature
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # a warm-up on a side stream, as torch.cuda.graph asks
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        graph.replay()
        torch.cuda.synchronize()
    eager = eager if isinstance(eager, tuple) else (eager,)
    captured = captured if isinstance(captured, tuple) else (captured,)
    for a, b in zip(eager, captured, strict=True):
        assert torch.equal(a, b), op
