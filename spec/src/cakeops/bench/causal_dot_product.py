"""``causal_dot_product`` against the masked-matmul and cumsum composites and ``torch.compile``."""

from __future__ import annotations

from typing import Any

import torch

import cakeops
from cakeops.bench import Work, cakeops_rows, format_table, measure, result_row

# name -> (N, H, L, E, M)
CASES = {
    "N2 H4 L2048 E64 M64": (2, 4, 2048, 64, 64),
    "N1 H8 L8192 E64 M64": (1, 8, 8192, 64, 64),
    "N8 H8 L512 E128 M128": (8, 8, 512, 128, 128),
}
QUICK_CASES = {
    "N1 H2 L1024 E32 M32": (1, 2, 1024, 32, 32),
}


def recurrent_work(N: int, H: int, L: int, E: int, M: int) -> Work:
    """The FLOPs of the recurrent form, forward+backward: per position the forward adds
    ``k v^T`` to the state and reads it with ``q`` (``4 E M``), the backward does that for ``dq``
    and runs the reversed scan for ``dk`` and ``dv`` (``8 E M``)."""
    return Work("flops", 12 * N * H * L * E * M)


def masked(q, k, v):
    """The masked form a user writes: ``tril(q k^T) v`` (an ``L x L`` matrix per head)."""
    return torch.tril(q @ k.transpose(-1, -2)) @ v


def cumsum(q, k, v):
    """Prefix sums of ``k_j v_j^T`` (one ``E x M`` state per position)."""
    states = torch.cumsum(k.unsqueeze(-1) * v.unsqueeze(-2), dim=2)
    return (q.unsqueeze(-2) @ states).squeeze(-2)


def run(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    compiled = torch.compile(masked, dynamic=False)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (N, H, L, E, M) in (QUICK_CASES if quick else CASES).items():
            q = (torch.randn(N, H, L, E, device=device) * E**-0.5).to(dtype).requires_grad_()
            k = (torch.randn(N, H, L, E, device=device) * E**-0.5).to(dtype).requires_grad_()
            v = torch.randn(N, H, L, M, device=device, dtype=dtype, requires_grad=True)
            g = torch.randn(N, H, L, M, device=device, dtype=dtype)
            backend = cakeops.explain(cakeops.causal_dot_product, q, k, v).backend
            contenders = {}
            for label, fn in (
                *cakeops_rows(cakeops.causal_dot_product, backend),
                ("masked composite", masked),
                ("cumsum composite", cumsum),
                ("torch.compile(masked)", compiled),
            ):

                def fwd(fn=fn, q=q, k=k, v=v):
                    return fn(q, k, v)

                def step(fwd=fwd, q=q, k=k, v=v, g=g):
                    return torch.autograd.grad(fwd(), (q, k, v), g)

                contenders[label] = (fwd, step)
            results = measure(contenders, device, repeats=2 if quick else 3)
            dt = str(dtype).removeprefix("torch.")
            work = recurrent_work(N, H, L, E, M)
            title = f"\ncausal_dot_product fwd+bwd, {name}, {dt}"
            print(format_table(title, results, "masked composite", work, dt))
            ours = results[f"cakeops [{backend}]"]
            fastest = min(results, key=lambda r: results[r]["time_s"])
            mem = ours["peak_bytes"] / results["masked composite"]["peak_bytes"]
            print(f"  fastest: {fastest}; cakeops peak memory / masked composite's: {mem:.3f}")
            rows.append(result_row(name, dt, backend, "masked composite", results, work))
    return rows


def gpu_cases(device: torch.device, shape: tuple[int, ...]) -> list:
    """``python -m cakeops.bench.gpu``: bfloat16 at ``(N, H, L, E, M)``."""
    from cakeops.bench.gpu import GpuCase
    from cakeops.ops.causal_dot_product import Inputs

    N, H, L, E, M = shape
    q = (torch.randn(N, H, L, E, device=device) * E**-0.5).bfloat16()
    k = (torch.randn(N, H, L, E, device=device) * E**-0.5).bfloat16()
    v = torch.randn(N, H, L, M, device=device, dtype=torch.bfloat16)
    return [GpuCase("bfloat16", Inputs(q, k, v))]


def gpu_peers(inputs) -> dict[str, Any]:
    """The masked composite, its ``torch.compile``, and flash-linear-attention's chunked kernel
    when it imports (its layout is (B, T, H, D)); a string says why a peer is not compared."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    compiled = torch.compile(masked, dynamic=False)
    peers: dict[str, Any] = {
        "masked composite": lambda: masked(q, k, v),
        "torch.compile(masked)": lambda: compiled(q, k, v),
    }
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except Exception as exc:  # not installed, or a different API
        peers["flash-linear-attention"] = f"does not import ({type(exc).__name__}: {exc})"[:200]
        return peers

    def fla():
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        return chunk_linear_attn(qt, kt, vt, scale=1.0, normalize=False)[0].transpose(1, 2)

    peers["flash-linear-attention"] = fla
    return peers
