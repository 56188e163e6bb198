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
from cakeops.testing import test_causal_conv1d as suite_conv
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


def calls(dtypes=DTYPES, other_dtypes=DTYPES) -> Iterator[Call]:
    """The suite's calls in every dtype, then the GPU benchmark's, then the rest (``other``,
    in ``other_dtypes`` only): a kernel is compiled, and counted, under the first call that
    needs it."""
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
        # WIP #27: every option (decay, gates, initial and final state), and packed sequences
        out += [Call("causal_dot_product", dtype, (2, 2, 45, 6, 5), "options")]
        out += [Call("causal_dot_product", dtype, (1, 2, 45, 6, 5), "packed")]
        # key heads shared by groups of 3 value heads (TestKeyHeadGroups): one key head (a
        # stride-0 view) and two (repeated), with and without the options
        out += [Call("causal_dot_product", dtype, (2, 6, 45, 6, 5), f"groups:{hk}:{opts}")
                for hk in (1, 2) for opts in ("plain", "gates", "options")]  # fmt: skip
        out += [Call("causal_dot_product", dtype, (1, 6, 45, 6, 5), f"groups:{hk}:packed")
                for hk in (1, 2)]  # fmt: skip
        # the gated delta rule and KDA: every option, grouped value heads, and packed
        out += [Call("gated_delta_rule", dtype, DELTA_SUITE, v) for v in DELTA_VARIANTS]
        out += [Call("gated_delta_rule", dtype, (1, 1, 1, 20, 136, 5), "kda")]  # wide heads
        # the causal convolution: every width the suite takes, every option, packed, and x in
        # the models' layout
        out += [Call("causal_conv1d", dtype, (2, 5, suite_conv.L, W), v)
                for W in (1, 2, 3, 4, 5) for v in ("", "options")]  # fmt: skip
        out += [Call("causal_conv1d", dtype, (1, 5, suite_conv.L, 4), "packed")]
        out += [Call("causal_conv1d", dtype, (2, 6, suite_conv.L, 4), "models")]
        out += [Call("moe_experts", dtype, c) for c in moe]
        if dtype != torch.float32:
            out += [Call("moe_experts", dtype, (16, 12, 20, 4, 2), "float32-weights")]
        out += [Call("routed_experts", dtype, c) for c in routed]
        out += [Call("routed_experts", dtype, (16, 12, 20, 4, 2), "packed")]
        # every form of expert the suite checks (those with a kink in float32 only, as there)
        out += [Call("routed_experts", dtype, suite_routed.FORM_SHAPE, f"form:{name}")
                for name, (_, make) in suite_routed.FORMS.items()
                if dtype == torch.float32 or not make.get("kink")]  # fmt: skip
    full = bench_gpu.FULL
    bench = {
        "rmsnorm_silu_gate": [(tuple(full["rmsnorm_silu_gate"]), None, True)],
        "causal_dot_product": [tuple(full["causal_dot_product"])],
        "causal_conv1d": [tuple(full["causal_conv1d"])],
        "moe_experts": [tuple(full["moe_experts"])],
        "routed_experts": [tuple(full["routed_experts"])],
    }
    N, L, H, Hv, D = full["gated_delta_rule"]
    for dtype in dtypes:  # the GPU benchmark's: the models' layout, every option they pass
        source = "gpu-bench" if dtype == torch.bfloat16 else "other"
        out += [Call("gated_delta_rule", dtype, (N, H, Hv // H, L, D, D), v, source)
                for v in ("models", "models-kda")]  # fmt: skip
    ran = {"rmsnorm_silu_gate": (torch.bfloat16, torch.float16)}
    for dtype in dtypes:
        for op, shapes in bench.items():
            source = "gpu-bench" if dtype in ran.get(op, (torch.bfloat16,)) else "other"
            # the variants of bench/<op>.py's gpu_cases
            variants = {"routed_experts": ("packed",), "causal_conv1d": ("bench",),
                        "causal_dot_product": ("", "gates", "mamba2")}.get(op, ("",))  # fmt: skip
            out += [Call(op, dtype, shape, v, source) for shape in shapes for v in variants]
    for dtype in dtypes:  # the CPU benchmarks' shapes, and the largest head size
        out += [Call("rmsnorm_silu_gate", dtype, (shape, gs, True), source="other")
                for shape, gs in bench_rmsnorm.CASES.values()]  # fmt: skip
        out += [Call("causal_dot_product", dtype, c, source="other")
                for c in [*bench_causal.CASES.values(), (1, 2, 64, 256, 256)]]  # fmt: skip
        out += [Call("moe_experts", dtype, c, source="other") for c in bench_moe.CASES.values()]
    wanted = [c for c in out if c.dtype in dtypes]
    yield from _unique([c for c in wanted if c.source != "other" or c.dtype in other_dtypes])


#: (N, H, G, L, K, V) of the suite's gated_delta_rule calls, and their variants
DELTA_SUITE = (2, 2, 2, 77, 8, 6)
DELTA_VARIANTS = ("", "kda", "options", "options-kda", "packed-kda")
#: the head sizes (K = V) the sweep compiles gated_delta_rule at
DELTA_HEADS = (64, 128, 256)

#: the head sizes the resource sweep compiles causal_dot_product at (E = M, and a few E != M)
HEAD_SIZES = (16, 24, 32, 40, 48, 64, 80, 96, 128, 192, 256)
#: (D, F) of the experts in the sweep, and rmsnorm's D: sizes that are not powers of two
EXPERT_SIZES = ((96, 160), (640, 1408), (1000, 1400), (2880, 2880), (7168, 2048))
NORM_SIZES = (96, 640, 1000, 2880, 5120, 8200)


def _grouped_causal_inputs(call: Call, empty):
    """The forward's and backward's arguments of a ``groups:<key heads>:<options>`` call."""
    N, H, L, E, M = call.shape
    _, hk, given = call.variant.split(":")
    q, k, v = empty(N, int(hk), L, E), empty(N, int(hk), L, E), empty(N, H, L, M)
    gates = -torch.rand(N, H, L)
    if given == "plain":
        return (q, k, v), (empty(N, H, L, M), empty(0), q, k, v)
    if given == "gates":
        opts = (None, None, gates, None, False, None)
        return (q, k, v, *opts), (empty(N, H, L, M), empty(0), q, k, v, *opts)
    cu = torch.tensor([0, 10, 10, 31, L]) if given == "packed" else None
    S = N if cu is None else cu.numel() - 1
    opts = (0.7, -torch.rand(H), gates, torch.randn(S, H, E, M), True, cu)
    return (q, k, v, *opts), (empty(N, H, L, M), torch.randn(S, H, E, M), q, k, v, *opts)


def sweep_calls(dtypes=(torch.bfloat16, torch.float16)) -> Iterator[Call]:
    """The resource sweep: shapes no test uses, which a config must fit all the same (every
    config the pruning keeps is compiled), 16-bit and 16-bit ``x`` with float32 weights."""
    heads = [(E, E) for E in HEAD_SIZES] + [(16, 256), (256, 16), (24, 192), (192, 24)]
    for dtype in dtypes:
        out = [Call("causal_dot_product", dtype, (1, 2, 8192, E, M)) for E, M in heads]
        out += [Call("causal_dot_product", dtype, (1, 2, 8192, E, M), "options")
                for E, M in heads]  # fmt: skip
        out += [Call("gated_delta_rule", dtype, (1, 2, 2, 512, D, D), v)
                for D in (*DELTA_HEADS, 96, 192) for v in ("options", "options-kda")]  # fmt: skip
        out += [Call("rmsnorm_silu_gate", dtype, ((64, D), None, True)) for D in NORM_SIZES]
        # Qwen3-Next-80B's and Granite 4.0's channels, long sequences, widths to 16
        out += [Call("causal_conv1d", dtype, (1, C, 8192, W), "models")
                for C in (8192, 12544) for W in (4, 16)]  # fmt: skip
        out += [Call("rmsnorm_silu_gate", dtype, ((64, D), 64, False)) for D in NORM_SIZES[:3]]
        for D, F in EXPERT_SIZES:
            # 4096 tokens x 2: enough rows to be tuned (every kept config compiled)
            out += [Call("moe_experts", dtype, (4096, D, F, 8, 2))]
            out += [Call("moe_experts", dtype, (4096, D, F, 8, 2), "float32-weights")]
            out += [Call("routed_experts", dtype, (4096, D, F, 8, 2), "packed")]
        # GPT-OSS's form (clamped SwiGLU, biases, interleaved transposed weights) and the
        # gateless ReLU² of Nemotron-H: their epilogues hold more live tiles
        for D, F in EXPERT_SIZES[::2]:
            out += [Call("routed_experts", dtype, (4096, D, F, 8, 2), "form:gpt-oss")]
            out += [Call("routed_experts", dtype, (4096, D, F, 8, 2), "form:no-gate-relu2")]
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
        if call.variant.startswith("groups:"):
            return _grouped_causal_inputs(call, empty)
        if call.variant == "transposed":
            q, k = (empty(N, L, H, E).transpose(1, 2) for _ in range(2))
            v = empty(N, L, H, M).transpose(1, 2)
        elif call.variant == "mamba2":  # q = C and k = B: one key head shared by every head
            q, k = (empty(N, 1, L, E) for _ in range(2))
            v = empty(N, H, L, M)
        else:
            q, k, v = empty(N, H, L, E), empty(N, H, L, E), empty(N, H, L, M)
        if call.variant in ("gates", "mamba2"):  # the GPU bench's gated cases: log_gates alone
            opts = (None, None, -torch.rand(N, H, L) * 0.1, None, False, None)
            return (q, k, v, *opts), (empty(N, H, L, M), empty(0), q, k, v, *opts)
        if call.variant in ("options", "packed"):
            cu = torch.tensor([0, 10, 10, L]) if call.variant == "packed" else None
            S = N if cu is None else cu.numel() - 1
            opts = (0.5, -torch.rand(H), -torch.rand(N, H, L), torch.randn(S, H, E, M), True, cu)
            g_final = torch.randn(S, H, E, M)
            return (q, k, v, *opts), (empty(N, H, L, M), g_final, q, k, v, *opts)
        return (q, k, v), (empty(N, H, L, M), empty(0), q, k, v)
    if call.op == "gated_delta_rule":
        return _delta_inputs(call, empty)
    if call.op == "causal_conv1d":
        return _conv_inputs(call, empty)
    T, D, F, E, top_k = call.shape
    if call.variant.startswith("form:"):
        return _form_inputs(call, empty)
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


def _delta_inputs(call: Call, empty) -> tuple[tuple, tuple]:
    """``gated_delta_rule``'s kernel arguments: ``options`` gives every option (scale, initial
    and final state, l2norm), ``packed`` packed sequences too, ``models`` the Hugging Face
    layout (``(N, L, H, D)`` transposed views, float32 gates and state), ``kda`` gates per key
    channel."""
    N, H, G, L, K, V = call.shape
    N = 1 if call.variant.startswith("packed") else N
    Hv = H * G
    kda = call.variant.endswith("kda")
    models = call.variant.startswith("models")
    if models:
        q, k = (empty(N, L, H, K).transpose(1, 2) for _ in range(2))
        v = empty(N, L, Hv, V).transpose(1, 2)
        gdt = torch.float32
    else:
        q, k, v = empty(N, H, L, K), empty(N, H, L, K), empty(N, Hv, L, V)
        gdt = call.dtype
    g = -torch.rand(N, Hv, L, *((K,) if kda else ())).to(gdt)
    beta = torch.rand(N, Hv, L).to(call.dtype)
    options = call.variant.startswith(("options", "packed", "models"))
    cu = torch.tensor([0, 10, 10, L]) if call.variant.startswith("packed") else None
    S = N if cu is None else cu.numel() - 1
    init = torch.randn(S, Hv, K, V) if options else None
    opts = (0.5, init, options, cu, options)
    g_final = torch.randn(S, Hv, K, V) if options else empty(0)
    g_out = empty(N, L, Hv, V).transpose(1, 2) if models else empty(N, Hv, L, V)
    return (q, k, v, g, beta, *opts), (g_out, g_final, q, k, v, g, beta, *opts)


def _conv_inputs(call: Call, empty) -> tuple[tuple, tuple]:
    """``causal_conv1d``'s kernel arguments: ``options`` gives a bias, SiLU and both states,
    ``packed`` packed sequences too, ``models`` Hugging Face's ``(N, L, C)`` layout passed as a
    transposed view, with every option."""
    N, C, L, W = call.shape
    if call.variant == "bench":  # the GPU bench's: the models' layout, a bias and SiLU
        x, g_out = empty(N, L, C).transpose(1, 2), empty(N, L, C).transpose(1, 2)
        opts = (torch.randn(C), "silu", None, False, None)
        return (x, torch.randn(C, W), *opts), (g_out, empty(0), x, torch.randn(C, W), *opts)
    models = call.variant == "models"
    x = empty(N, L, C).transpose(1, 2) if models else empty(N, C, L)
    options = call.variant in ("options", "packed", "models")
    cu = torch.tensor([0, 10, 10, L]) if call.variant == "packed" else None
    S = N if cu is None else cu.numel() - 1
    init = torch.randn(S, C, W - 1) if options else None
    opts = (torch.randn(C) if options else None, "silu" if options else None, init, options, cu)
    g_final = torch.randn(S, C, W - 1) if options else empty(0)
    g_out = empty(N, L, C).transpose(1, 2) if models else empty(N, C, L)
    weight = torch.randn(C, W)
    return (x, weight, *opts), (g_out, g_final, x, weight, *opts)


def _form_inputs(call: Call, empty) -> tuple[tuple, tuple]:
    """``routed_experts``' kernel arguments for one of the suite's forms of expert
    (``suite_routed.FORMS``): the weights in the form's layout, its biases and options."""
    T, D, F, E, top_k = call.shape
    options, make = suite_routed.FORMS[call.variant.removeprefix("form:")]
    layout = make.get("layout", "")
    if layout == "interleaved-transposed":
        gate_up = empty(E, D, 2 * F)
        w_gate, w_up = gate_up[..., ::2].transpose(1, 2), gate_up[..., 1::2].transpose(1, 2)
    elif layout == "transposed":
        w_gate, w_up = (empty(E, D, F).transpose(1, 2) for _ in range(2))
    elif layout == "interleaved":
        gate_up = empty(E, 2 * F, D)
        w_gate, w_up = gate_up[:, ::2], gate_up[:, 1::2]
    else:
        w_gate, w_up = empty(E, F, D), empty(E, F, D)
    w_down = empty(E, F, D).transpose(1, 2) if layout.endswith("transposed") else empty(E, D, F)
    gated = make.get("gated", True)
    biases = make.get("biases", False)
    b_gate = empty(E, 2 * F)[:, ::2] if biases is True and gated else None
    b_up, b_down = (empty(E, F), empty(E, D)) if biases else (None, None)
    full = {"activation": "silu", "alpha": 1.0, "limit": None, "up_offset": 0.0, **options}
    gen = torch.Generator().manual_seed(0)
    weights, index = torch.softmax(torch.randn(T, E, generator=gen), -1).topk(top_k, dim=-1)
    args = (empty(T, D), index, weights.to(call.dtype), w_gate if gated else None, w_up, w_down,
            b_gate, b_up, b_down, *full.values())  # fmt: skip
    return args, (empty(T, D), *args)
