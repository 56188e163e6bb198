"""``causal_conv1d`` against transformers' PyTorch fallback (``causal_conv1d_fn``: a padded
``F.conv1d`` then SiLU, under autograd, what every Mamba2 and Gated DeltaNet layer runs without
the causal-conv1d package), with x in the models' layout (a transposed ``(N, L, C)`` view)."""

from __future__ import annotations

from typing import Any

import torch

import cakeops
from cakeops.bench.tables import format_table
from cakeops.bench.timing import cakeops_rows, fwd_bwd, measure, result_row

#: name -> (N, C, L, W)
CASES = {
    "N1 C2048 L4096 W4 (Qwen3-Next, hidden 1024)": (1, 2048, 4096, 4),
    "N1 C8192 L2048 W4 (Qwen3-Next 80B)": (1, 8192, 2048, 4),
}
QUICK_CASES = {"N1 C64 L256 W4": (1, 64, 256, 4)}


def transformers_fallback():
    """transformers' ``causal_conv1d_fn`` fallback itself (not its hub wrapper), or None."""
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
    except ImportError:
        return None
    fn = m.causal_conv1d_fn
    return getattr(fn, "__wrapped__", fn)


def _inputs(N, C, L, W, device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, L, C, generator=gen).to(device, dtype).transpose(1, 2)
    weight = (torch.randn(C, W, generator=gen) * 0.5).to(device, dtype)
    bias = (torch.randn(C, generator=gen) * 0.1).to(device, dtype)
    return x, weight, bias


def run(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    rows = []
    fallback = transformers_fallback()
    for name, (N, C, L, W) in (QUICK_CASES if quick else CASES).items():
        leaves = tuple(t.requires_grad_() for t in _inputs(N, C, L, W, device))
        upstream = torch.randn(N, L, C, generator=torch.Generator().manual_seed(1)).to(device)
        upstream = upstream.transpose(1, 2)

        def op(x, weight, bias):
            return cakeops.causal_conv1d(x, weight, bias, activation="silu")

        choice = cakeops.explain(cakeops.causal_conv1d, *leaves, activation="silu").backend
        contenders_ = list(cakeops_rows(op, choice))
        if fallback is not None:
            contenders_.append(("transformers fallback",
                                lambda *a: fallback(*a, activation="silu")))  # fmt: skip
        contenders = {label: fwd_bwd(fn, leaves, upstream) for label, fn in contenders_}
        results = measure(contenders, device, repeats=2 if quick else 5)
        baseline = "transformers fallback" if fallback is not None else next(iter(results))
        print(format_table(f"\ncausal_conv1d fwd+bwd, {name}, float32", results, baseline,
                           None, "float32"))  # fmt: skip
        backend = next(iter(results)).split("[")[1].rstrip("]")
        rows.append(result_row(name, "float32", backend, baseline, results))
    return rows


def gpu_cases(device: torch.device, shape: tuple[int, ...]) -> list:
    """``python -m cakeops.bench.gpu``: bfloat16 x in the models' layout at ``(N, C, L, W)``,
    a bias and SiLU, as the models call it."""
    from cakeops.bench.gpu import GpuCase
    from cakeops.ops.causal_conv1d import Inputs

    x, weight, bias = _inputs(*shape, device, torch.bfloat16)
    return [GpuCase("bfloat16", Inputs(x, weight, bias, activation="silu"))]


def gpu_peers(inputs) -> dict[str, Any]:
    """transformers' fallback when it imports, and the causal-conv1d package's CUDA kernel when
    it does (a string says why a peer is not compared)."""
    peers: dict[str, Any] = {}
    x, weight, bias = inputs.x, inputs.weight, inputs.bias
    fallback = transformers_fallback()
    if fallback is None:
        peers["transformers fallback"] = "does not import"
    else:
        peers["transformers fallback"] = lambda: fallback(x, weight, bias, activation="silu")
    try:
        from causal_conv1d import causal_conv1d_fn as kernel
    except Exception as exc:  # not installed, or a different API
        peers["causal-conv1d"] = f"does not import ({type(exc).__name__}: {exc})"[:200]
        return peers
    peers["causal-conv1d"] = lambda: kernel(x, weight, bias, activation="silu")
    return peers
