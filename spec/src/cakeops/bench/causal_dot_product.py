"""``causal_dot_product`` against the masked-matmul and cumsum composites and ``torch.compile``;
with its options (a per-head decay, per-position gates, packed documents) against the composites
a user would write for them (a masked decay matrix) and a loop over documents."""

from __future__ import annotations

from typing import Any

import torch

import cakeops
from cakeops.bench.limits import Work
from cakeops.bench.tables import format_table
from cakeops.bench.timing import cakeops_rows, fwd_bwd, measure, result_row

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


def masked_decay(q, k, v, log_mult):
    """The masked form with log multipliers ``(N, H, L)``: ``((q k^T) * D) v`` with
    ``D_ij = exp(b_i - b_j)`` below the diagonal, ``b`` their running sum."""
    b = torch.cumsum(log_mult, dim=-1)
    L = b.shape[-1]
    causal = torch.ones(L, L, dtype=torch.bool, device=b.device).tril()
    D = torch.exp((b[..., :, None] - b[..., None, :]).masked_fill(~causal, -torch.inf))
    return ((q @ k.transpose(-1, -2)) * D.to(q.dtype)) @ v


#: the options' cases: name -> (N, H, L, E, M, option); float32
OPTION_CASES = {
    "decay N1 H8 L2048 E64 M64": (1, 8, 2048, 64, 64, "log_decay"),
    "decay N1 H8 L4096 E64 M64": (1, 8, 4096, 64, 64, "log_decay"),
    "gates N1 H8 L2048 E64 M64": (1, 8, 2048, 64, 64, "log_gates"),
    "gates N1 H8 L4096 E64 M64": (1, 8, 4096, 64, 64, "log_gates"),
    "packed 8 docs N1 H8 L4096 E64 M64": (1, 8, 4096, 64, 64, "cu_seqlens"),
}
QUICK_OPTION_CASES = {
    "decay N1 H2 L512 E32 M32": (1, 2, 512, 32, 32, "log_decay"),
    "gates N1 H2 L512 E32 M32": (1, 2, 512, 32, 32, "log_gates"),
    "packed 8 docs N1 H2 L512 E32 M32": (1, 2, 512, 32, 32, "cu_seqlens"),
}


def documents(L: int, count: int = 8) -> torch.Tensor:
    """Offsets of ``count`` packed documents of uneven lengths (fixed, so runs compare)."""
    weights = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6][:count], dtype=torch.float64)
    ends = torch.round(torch.cumsum(weights, 0) / weights.sum() * L).long()
    return torch.cat([torch.zeros(1, dtype=torch.long), ends])


def option_contenders(q, k, v, option: str, backend: str):
    """label -> forward of every contender of one options case (all with the same math)."""
    H, L = q.shape[1], q.shape[2]
    log_decay = -torch.linspace(0.01, 0.5, H, device=q.device)
    gen = torch.Generator().manual_seed(0)
    log_gates = (-torch.rand(q.shape[:3], generator=gen) * 0.1).to(q.device)
    op = cakeops.causal_dot_product
    if option == "cu_seqlens":
        cu = documents(L).to(q.device)
        bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))

        def loop(fn):
            def run(q, k, v):
                return torch.cat([fn(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]) for s, e in bounds],
                                 dim=2)  # fmt: skip

            return run

        def decayed(q, k, v):
            return op(q, k, v, log_decay=log_decay)

        def masked_doc(q, k, v):
            return masked_decay(q, k, v, log_decay[None, :, None].expand(q.shape[:3]))

        return {
            **{label: (lambda q, k, v, fn=fn: fn(q, k, v, log_decay=log_decay, cu_seqlens=cu))
               for label, fn in cakeops_rows(op, backend)},
            "loop over documents (cakeops)": loop(decayed),
            "loop over documents (masked decay)": loop(masked_doc),
        }  # fmt: skip
    given = {"log_decay": log_decay} if option == "log_decay" else {"log_gates": log_gates}
    log_mult = log_decay[None, :, None].expand(q.shape[:3]) if option == "log_decay" else log_gates
    compiled = torch.compile(masked_decay, dynamic=False)
    return {
        **{label: (lambda q, k, v, fn=fn: fn(q, k, v, **given))
           for label, fn in cakeops_rows(op, backend)},
        f"cakeops [{backend}] without {option}": op,
        "masked decay composite": lambda q, k, v: masked_decay(q, k, v, log_mult),
        "torch.compile(masked decay)": lambda q, k, v: compiled(q, k, v, log_mult),
    }  # fmt: skip


def run_options(device: torch.device, quick: bool) -> list[dict[str, Any]]:
    rows = []
    for name, (N, H, L, E, M, option) in (QUICK_OPTION_CASES if quick else OPTION_CASES).items():
        q = (torch.randn(N, H, L, E, device=device) * E**-0.5).requires_grad_()
        k = (torch.randn(N, H, L, E, device=device) * E**-0.5).requires_grad_()
        v = torch.randn(N, H, L, M, device=device, requires_grad=True)
        g = torch.randn(N, H, L, M, device=device)
        backend = cakeops.explain(cakeops.causal_dot_product, q, k, v,
                                  log_decay=-torch.ones(H, device=device)).backend  # fmt: skip
        ours, peers = {}, {}
        for label, fn in option_contenders(q, k, v, option, backend).items():
            mine = label.startswith(f"cakeops [{backend}]")
            (ours if mine else peers)[label] = fwd_bwd(fn, (q, k, v), g)
        baseline = ("loop over documents (cakeops)" if option == "cu_seqlens"
                    else "masked decay composite")  # fmt: skip
        # the chosen backend with and without the option alternate between themselves, the
        # others among theirs: a composite's gigabytes of fresh memory (or the torch backend's
        # chunk copies) slow whichever step follows them, which would skew that ratio
        repeats = 2 if quick else 5
        results = {**measure(ours, device, repeats), **measure(peers, device, repeats)}
        work = recurrent_work(N, H, L, E, M)
        print(format_table(f"\ncausal_dot_product fwd+bwd, {name}, float32", results, baseline,
                           work, "float32"))  # fmt: skip
        rows.append(result_row(name, "float32", backend, baseline, results, work))
    return rows


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
            contenders = {
                label: fwd_bwd(fn, (q, k, v), g)
                for label, fn in (
                    *cakeops_rows(cakeops.causal_dot_product, backend),
                    ("masked composite", masked),
                    ("cumsum composite", cumsum),
                    ("torch.compile(masked)", compiled),
                )
            }
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
    return rows + run_options(device, quick)


def gpu_cases(device: torch.device, shape: tuple[int, ...]) -> list:
    """``python -m cakeops.bench.gpu``: bfloat16 at ``(N, H, L, E, M)``."""
    from cakeops.bench.gpu import GpuCase
    from cakeops.ops.causal_dot_product import Inputs

    N, H, L, E, M = shape
    q = (torch.randn(N, H, L, E, device=device) * E**-0.5).bfloat16()
    k = (torch.randn(N, H, L, E, device=device) * E**-0.5).bfloat16()
    v = torch.randn(N, H, L, M, device=device, dtype=torch.bfloat16)
    log_gates = -torch.rand(N, H, L, device=device) * 0.1
    # Mamba2's SSD scan as the transformers adapter runs it: q = C and k = B, one group (a key
    # head) shared by every head, log_gates = dt A
    c, b = ((torch.randn(N, 1, L, E, device=device) * E**-0.5).bfloat16() for _ in "cb")
    return [GpuCase("bfloat16", Inputs(q, k, v)),
            GpuCase("bfloat16, log_gates", Inputs(q, k, v, log_gates=log_gates)),
            GpuCase("bfloat16, Mamba2 SSD scan", Inputs(c, b, v, log_gates=log_gates))]  # fmt: skip


def gpu_peers(inputs) -> dict[str, Any]:
    """The masked composite (with the gates' decay matrix when ``log_gates`` is given), its
    ``torch.compile``, and flash-linear-attention's chunked kernel (``chunk_linear_attn``;
    ``chunk_simple_gla`` with gates) when it imports (its layout is (B, T, H, D)); a string
    says why a peer is not compared."""
    q, k, v, gates = inputs["q"], inputs["k"], inputs["v"], inputs["log_gates"]
    grouped = k.shape[1] != v.shape[1]  # Mamba2's SSD scan: one key head for every head

    def heads(t):  # made in each step, as every view of a leaf here (see gpu._contenders)
        return t.expand(-1, v.shape[1], -1, -1) if grouped else t

    name = "masked" if gates is None else "masked decay"
    composite = masked if gates is None else (lambda q, k, v: masked_decay(q, k, v, gates))
    compiled = torch.compile(composite, dynamic=False)
    peers: dict[str, Any] = {
        f"{name} composite": lambda: composite(heads(q), heads(k), v),
        f"torch.compile({name})": lambda: compiled(heads(q), heads(k), v),
    }
    if grouped:  # Mamba2's SSD scan: mamba-ssm's kernel when it imports
        peers["mamba-ssm"] = _mamba_peer(q, k, v, gates)
        return peers
    try:
        if gates is None:
            from fla.ops.linear_attn import chunk_linear_attn as kernel
        else:
            from fla.ops.simple_gla import chunk_simple_gla as kernel
    except Exception as exc:  # not installed, or a different API
        peers["flash-linear-attention"] = f"does not import ({type(exc).__name__}: {exc})"[:200]
        return peers

    def fla():
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        if gates is None:
            return kernel(qt, kt, vt, scale=1.0, normalize=False)[0].transpose(1, 2)
        return kernel(qt, kt, vt, g=gates.transpose(1, 2), scale=1.0)[0].transpose(1, 2)

    peers["flash-linear-attention"] = fla
    return peers


def _mamba_peer(q, k, v, gates):
    """mamba-ssm's ``mamba_chunk_scan_combined`` on the same problem (x = v, dt = -log_gates,
    A = -1, B = k and C = q as one group), or why not."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as kernel
    except Exception as exc:  # not installed, or a different API
        return f"does not import ({type(exc).__name__}: {exc})"[:200]
    A = -torch.ones(v.shape[1], device=q.device)

    def step():  # the views made in each step (see gpu._contenders)
        x, dt = v.transpose(1, 2), (-gates).transpose(1, 2).to(v.dtype)
        B, C = (t.transpose(1, 2) for t in (k, q))  # (N, L, 1, S)
        return kernel(x, dt, A, B, C, chunk_size=256)

    return step
