"""The calls the GPU compile check makes: every op at the shapes of the conformance suite and of
the benchmarks (CPU and GPU), in every dtype the kernels serve, read from those modules so that a
shape added there is compiled here too."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from cakeops.bench import causal_dot_product as bench_causal
from cakeops.bench import gpu as bench_gpu
from cakeops.bench import moe_experts as bench_moe
from cakeops.bench import rmsnorm_silu_gate as bench_rmsnorm
from cakeops.testing import test_causal_dot_product as suite_causal
from cakeops.testing import test_moe_experts as suite_moe
from cakeops.testing import test_rmsnorm_silu_gate as suite_rmsnorm
from cakeops.testing import test_routed_experts as suite_routed

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Call:
    """One op call: forward and backward at ``shape`` in ``dtype`` (``variant`` names a layout
    or weight-dtype variation of the suite; ``source`` who makes the call on a GPU: ``suite``,
    ``gpu-bench`` (``python -m cakeops.bench.gpu``), or ``other`` (CPU benchmark shapes and
    other dtypes, compiled for their resources only))."""

    op: str
    dtype: torch.dtype
    shape: tuple[Any, ...]
    variant: str = ""
    source: str = field(default="suite", compare=False)

    def label(self) -> str:
        return f"{self.op} {self.shape}{' ' + self.variant if self.variant else ''}"


def _unique(calls: list[Call]) -> list[Call]:
    return list(dict.fromkeys(calls))


def calls(dtypes=DTYPES) -> Iterator[Call]:
    """The suite's calls in every dtype, then the GPU benchmark's, then the rest: a kernel is
    compiled, and counted, under the first call that needs it."""
    rms = [(shape, gs, nbg) for shape, gs, nbg in suite_rmsnorm.CASES.values()]
    causal = [*list(suite_causal.CASES.values()), (1, 1, suite_causal.LONG_L, 16, 16)]
    moe = [c[:5] for c in suite_moe.CASES.values()]
    # routed_experts: the same kernels as moe_experts, with Hugging Face's packed gate/up views
    routed = [c[1:] for c in suite_routed.CASES]
    out = []
    for dtype in dtypes:
        out += [Call("rmsnorm_silu_gate", dtype, c) for c in rms]
        # z as a slice of a packed projection (rows strided), as the suite checks
        out += [Call("rmsnorm_silu_gate", dtype, ((4, 64), None, True), "strided")]
        out += [Call("causal_dot_product", dtype, c) for c in causal]
        out += [Call("causal_dot_product", dtype, (2, 3, 37, 8, 8), "transposed")]
        out += [Call("moe_experts", dtype, c) for c in moe]
        if dtype != torch.float32:
            out += [Call("moe_experts", dtype, (16, 12, 20, 4, 2), "float32-weights")]
        out += [Call("routed_experts", dtype, c) for c in routed]
        out += [Call("routed_experts", dtype, (16, 12, 20, 4, 2), "packed")]
    full = bench_gpu.FULL
    bench = {
        "rmsnorm_silu_gate": [(tuple(full["rmsnorm_silu_gate"]), None, True)],
        "causal_dot_product": [tuple(full["causal_dot_product"])],
        "moe_experts": [tuple(full["moe_experts"])],
        "routed_experts": [tuple(full["routed_experts"])],
    }
    ran = {"rmsnorm_silu_gate": (torch.bfloat16, torch.float16)}
    for dtype in dtypes:
        for op, shapes in bench.items():
            source = "gpu-bench" if dtype in ran.get(op, (torch.bfloat16,)) else "other"
            variant = "packed" if op == "routed_experts" else ""
            out += [Call(op, dtype, shape, variant, source) for shape in shapes]
    for dtype in dtypes:  # the CPU benchmarks' shapes, and the largest head size
        out += [Call("rmsnorm_silu_gate", dtype, (shape, gs, True), source="other")
                for shape, gs in bench_rmsnorm.CASES.values()]  # fmt: skip
        out += [Call("causal_dot_product", dtype, c, source="other")
                for c in [*bench_causal.CASES.values(), (1, 2, 64, 256, 256)]]  # fmt: skip
        out += [Call("moe_experts", dtype, c, source="other") for c in bench_moe.CASES.values()]
    yield from _unique([c for c in out if c.dtype in dtypes])


#: the head sizes the resource sweep compiles causal_dot_product at (E = M, and a few E != M)
HEAD_SIZES = (16, 24, 32, 40, 48, 64, 80, 96, 128, 192, 256)
#: (D, F) of the experts in the sweep, and rmsnorm's D: sizes that are not powers of two
EXPERT_SIZES = ((96, 160), (640, 1408), (1000, 1400), (2880, 2880), (7168, 2048))
NORM_SIZES = (96, 640, 1000, 2880, 5120, 8200)


def sweep_calls(dtypes=(torch.bfloat16, torch.float16)) -> Iterator[Call]:
    """The resource sweep: shapes no test uses, which a config must fit all the same (every
    config the pruning keeps is compiled), 16-bit and 16-bit ``x`` with float32 weights."""
    heads = [(E, E) for E in HEAD_SIZES] + [(16, 256), (256, 16), (24, 192), (192, 24)]
    for dtype in dtypes:
        out = [Call("causal_dot_product", dtype, (1, 2, 8192, E, M)) for E, M in heads]
        out += [Call("rmsnorm_silu_gate", dtype, ((64, D), None, True)) for D in NORM_SIZES]
        out += [Call("rmsnorm_silu_gate", dtype, ((64, D), 64, False)) for D in NORM_SIZES[:3]]
        for D, F in EXPERT_SIZES:
            # 4096 tokens x 2: enough rows to be tuned (every kept config compiled)
            out += [Call("moe_experts", dtype, (4096, D, F, 8, 2))]
            out += [Call("moe_experts", dtype, (4096, D, F, 8, 2), "float32-weights")]
            out += [Call("routed_experts", dtype, (4096, D, F, 8, 2), "packed")]
        yield from _unique(out)


def inputs(call: Call) -> tuple[tuple, tuple]:
    """``(forward args, backward args)`` for the backend kernels. Values are left uninitialised
    where no host code reads them (the kernels only compile), so bench shapes cost no time."""
    dt = call.dtype

    def empty(*shape, dtype=dt):
        return torch.empty(shape, dtype=dtype)

    if call.op == "rmsnorm_silu_gate":
        shape, gs, nbg = call.shape
        gs = gs or shape[-1]
        x = empty(*shape)
        z = empty(*shape[:-1], 2 * shape[-1])[..., : shape[-1]] if call.variant else empty(*shape)
        w = empty(shape[-1])
        return (x, z, w, 1e-6, gs, nbg), (empty(*shape), x, z, w, 1e-6, gs, nbg)
    if call.op == "causal_dot_product":
        N, H, L, E, M = call.shape
        if call.variant == "transposed":
            q, k = (empty(N, L, H, E).transpose(1, 2) for _ in range(2))
            v = empty(N, L, H, M).transpose(1, 2)
        else:
            q, k, v = empty(N, H, L, E), empty(N, H, L, E), empty(N, H, L, M)
        return (q, k, v), (empty(N, H, L, M), q, k, v)
    T, D, F, E, top_k = call.shape
    wdt = torch.float32 if call.variant == "float32-weights" else dt
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(T, E, generator=gen)
    x = empty(T, D)
    if call.variant == "packed":  # Hugging Face's gate_up_proj (E, 2F, D), read as two views
        gate_up = empty(E, 2 * F, D, dtype=wdt)
        ws = (gate_up[:, :F], gate_up[:, F:], empty(E, D, F, dtype=wdt))
    else:
        ws = (empty(E, F, D, dtype=wdt), empty(E, F, D, dtype=wdt), empty(E, D, F, dtype=wdt))
    if call.op == "routed_experts":
        weights, index = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        args = (x, index, weights.to(dt), *ws)
        return args, (empty(T, D), *args)
    return (x, logits, *ws, top_k, True, 1.0), (empty(T, D), x, logits, *ws, top_k, True, 1.0)
