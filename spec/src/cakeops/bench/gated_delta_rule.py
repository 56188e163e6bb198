"""``gated_delta_rule`` against transformers' PyTorch fallbacks under autograd, what the models
run without flash-linear-attention: ``torch_chunk_gated_delta_rule`` (Qwen3-Next, Qwen3.5,
OLMo-Hybrid) and, for KDA's per-channel gates, ``chunk_kimi_delta_attention`` (Kimi Linear);
in the models' ``(N, L, H, D)`` layout, with l2-normalised q and k as they call them."""

from __future__ import annotations

import math
from typing import Any

import torch

import cakeops
from cakeops.bench.tables import format_table
from cakeops.bench.timing import cakeops_rows, fwd_bwd, measure, result_row

#: name -> (N, L, H key heads, Hv value heads, K = V, KDA)
CASES = {
    "N1 L4096 H8 Hv16 D128": (1, 4096, 8, 16, 128, False),
    "N1 L2048 H16 Hv32 D128 (Qwen3-Next 80B)": (1, 2048, 16, 32, 128, False),
    # KDA: the fallback's peak grows as L K heads (its C x C x K decay factors of every chunk at
    # once): 11.5 GB at L 2048 with Kimi Linear's 32 heads of 128, so that size runs at L 1024
    "KDA N1 L4096 H8 D64": (1, 4096, 8, 8, 64, True),
    "KDA N1 L1024 H32 D128 (Kimi Linear)": (1, 1024, 32, 32, 128, True),
}
QUICK_CASES = {
    "N1 L256 H2 Hv4 D32": (1, 256, 2, 4, 32, False),
    "KDA N1 L256 H2 D32": (1, 256, 2, 2, 32, True),
}


def transformers_fallback(kda: bool = False):
    """transformers' chunked fallback itself (not its hub wrapper): Qwen3-Next's, or Kimi
    Linear's for KDA; None without it."""
    try:
        if kda:
            from transformers.models.kimi_linear import modeling_kimi_linear as m
        else:
            from transformers.models.qwen3_next import modeling_qwen3_next as m
    except ImportError:
        return None
    fn = m.chunk_kimi_delta_attention if kda else m.torch_chunk_gated_delta_rule
    return getattr(fn, "__wrapped__", fn)


def run(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    rows = []
    for name, (N, L, H, Hv, D, kda) in (QUICK_CASES if quick else CASES).items():
        fallback = transformers_fallback(kda)
        gen = torch.Generator().manual_seed(0)
        q, k = (torch.randn(N, L, H, D, generator=gen).to(device) for _ in "qk")
        v = torch.randn(N, L, Hv, D, generator=gen).to(device)
        g = -torch.rand(N, L, Hv, *((D,) if kda else ()), generator=gen).to(device) * 0.1
        beta = torch.rand(N, L, Hv, generator=gen).to(device)
        leaves = tuple(t.requires_grad_() for t in (q, k, v, g, beta))
        upstream = torch.randn(N, L, Hv, D, generator=gen).to(device)

        def op(q, k, v, g, beta):
            t = lambda x: x.transpose(1, 2)  # noqa: E731
            out = cakeops.gated_delta_rule(t(q), t(k), t(v), t(g), t(beta), use_qk_l2norm=True)
            return t(out)

        rows_ = list(cakeops_rows(op, cakeops.explain(cakeops.gated_delta_rule, *(
            t.transpose(1, 2) for t in leaves), use_qk_l2norm=True).backend))  # fmt: skip
        if fallback is not None:

            def hf(*a, f=fallback):
                return f(*a, use_qk_l2norm_in_kernel=True)[0]

            rows_.append(("transformers fallback", hf))
        contenders = {label: fwd_bwd(fn, leaves, upstream) for label, fn in rows_}
        # every contender timed the same number of times, the fallbacks' seconds-long steps too
        results = measure(contenders, device, repeats=2 if quick else 3, slow_s=math.inf)
        baseline = "transformers fallback" if fallback is not None else next(iter(results))
        print(format_table(f"\ngated_delta_rule fwd+bwd, {name}, float32", results, baseline,
                           None, "float32"))  # fmt: skip
        backend = next(iter(results)).split("[")[1].rstrip("]")
        rows.append(result_row(name, "float32", backend, baseline, results))
    return rows


def gpu_cases(device: torch.device, shape: tuple[int, ...]) -> list:
    """``python -m cakeops.bench.gpu``: bfloat16 q, k, v, beta and float32 gates at
    ``(N, L, H, Hv, D)`` in the models' layout (transposed views), ``use_qk_l2norm``; the
    gated delta rule and KDA."""
    from cakeops.bench.gpu import GpuCase
    from cakeops.ops.gated_delta_rule import Inputs

    N, L, H, Hv, D = shape
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    q, k = (torch.randn(N, L, H, D, device=device, dtype=torch.bfloat16) for _ in "qk")
    v = torch.randn(N, L, Hv, D, device=device, dtype=torch.bfloat16)
    beta = torch.rand(N, L, Hv, device=device, dtype=torch.bfloat16)
    g = -torch.rand(N, L, Hv, device=device) * 0.1
    g_kda = -torch.rand(N, L, Hv, D, device=device) * 0.1
    return [GpuCase("bfloat16", Inputs(t(q), t(k), t(v), t(g), t(beta), use_qk_l2norm=True)),
            GpuCase("bfloat16, KDA", Inputs(t(q), t(k), t(v), t(g_kda), t(beta),
                                            use_qk_l2norm=True))]  # fmt: skip


def gpu_peers(inputs) -> dict[str, Any]:
    """transformers' fallback (when it imports) and flash-linear-attention's
    ``chunk_gated_delta_rule`` / ``chunk_kda`` when they import (layout (B, T, H, D), value
    heads sharing a key head repeated for fla where it needs them); a string says why a peer
    is not compared."""
    names = ("q", "k", "v", "g", "beta")

    def views():  # made in each step, as every view of a leaf here (see gpu._contenders)
        return (inputs[n].transpose(1, 2) for n in names)

    kda = inputs["g"].dim() == 4
    peers: dict[str, Any] = {}
    fallback = transformers_fallback(kda)
    if fallback is None:
        peers["transformers fallback"] = "does not import"
    elif kda and inputs["v"].shape[1] != inputs["q"].shape[1]:
        peers["transformers fallback"] = "KDA's takes as many key heads as value heads"
    else:

        def hf():
            return fallback(*views(), use_qk_l2norm_in_kernel=True)[0]

        peers["transformers fallback"] = hf
    try:
        if kda:
            from fla.ops.kda import chunk_kda as kernel
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel
    except Exception as exc:  # not installed, or a different API
        peers["flash-linear-attention"] = f"does not import ({type(exc).__name__}: {exc})"[:200]
        return peers
    groups = inputs["v"].shape[1] // inputs["q"].shape[1]

    def fla():
        q, k, v, g, beta = views()
        qf, kf = (x.repeat_interleave(groups, dim=2) for x in (q, k))
        return kernel(qf, kf, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    peers["flash-linear-attention"] = fla
    return peers
