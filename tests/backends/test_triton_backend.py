"""The kernel backends' own plumbing on the CPU: what the conformance suite cannot see.

- the spec's row-tile table, sized by an upper bound so building it never waits for the device;
- the 16-bit rounding the kernels emulate under the interpreter (``_common.round_to``), which
  must be what a GPU does: round to nearest even, NaN and infinities kept;
- the compile check's reading of Triton's GPU IR (which ``tl.dot`` lowers to what).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cakeops.helpers import route, row_tiles

HERE = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("block", [1, 2, 4])
def test_row_tiles_cover_each_expert_once_and_pad_past_the_end(block):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(11, 5, generator=gen)
    logits[:, 3] = -30  # expert 3 gets no rows
    routing = route(logits, 2, True, 1.0)
    tile_expert, tile_row, starts, ends = row_tiles(routing, block)
    rows = routing.order.numel()
    assert tile_expert.numel() == -(-rows // block) + 5  # the upper bound, not the count
    covered = torch.zeros(rows, dtype=torch.int64)
    for e, r in zip(tile_expert.tolist(), tile_row.tolist(), strict=True):
        if r >= rows:  # a padding tile: past every expert's end
            continue
        assert starts[e] <= r < ends[e]
        covered[r : min(r + block, int(ends[e]))] += 1
    assert torch.equal(covered, torch.ones(rows, dtype=torch.int64))
    real = (tile_row < rows).sum().item()
    assert real == sum(-(-(int(ends[e]) - int(starts[e])) // block) for e in range(5))
    assert routing.bounds == [
        0,
        *torch.cumsum(torch.bincount(routing.experts.flatten(), minlength=5), 0).tolist(),
    ]


ROUNDING = textwrap.dedent(
    """
    import torch, triton, triton.language as tl
    from cakeops_triton._common import round_to

    @triton.jit
    def k(X, Y, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(Y + i, round_to(tl.load(X + i), Y.dtype.element_ty))

    bits = torch.randint(0, 2**31 - 1, (4096,), generator=torch.Generator().manual_seed(0))
    x = (bits.to(torch.int32).view(torch.float32) * 1.0)
    x = torch.where(torch.isfinite(x), x, 1.0)
    ties = (torch.arange(1, 65, dtype=torch.float32) * 2**-7 + 1) + 2**-9  # halfway cases
    x = torch.cat([x[: 4096 - 64 - 4], ties, torch.tensor([float("nan"), float("inf"),
                   -float("inf"), 3.3895e38])])
    y = torch.empty(4096, dtype=torch.bfloat16)
    k[(1,)](x, y, N=4096)
    want = x.to(torch.bfloat16)
    same = (y.view(torch.int16) == want.view(torch.int16)) | (y.isnan() & want.isnan())
    assert bool(same.all()), x[~same][:5]
    print("ok")
    """
)


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton is not installed"
)
def test_interpreter_rounds_bfloat16_like_a_gpu():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", ROUNDING], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


_DOT_OPERANDS = "tensor<64x32xbf16, #ttg.dot_op<{opIdx = 0}>> * tensor<32x64xbf16, #dop1>"
TTGIR = "\n".join(
    [
        "#mma = #ttg.nvidia_mma<{versionMajor = 2}>",
        '#loc1 = loc("/x/cakeops_triton/_common.py":57:15)',
        '#loc2 = loc("/x/cakeops_triton/moe_experts.py":121:14)',
        "#loc3 = loc(callsite(#loc1 at #loc2))",
        '#loc4 = loc("/x/cakeops_triton/causal_dot_product.py":99:9)',
        f"  %0 = tt.dot %a, %b, %c : {_DOT_OPERANDS} -> tensor<64x64xf32, #mma> loc(#loc3)",
        "  %1 = tt.dot %a, %b, %c : tensor<16x16xf32, #dop0> * tensor<16x16xf32, #dop1>"
        " -> tensor<16x16xf32, #blocked> loc(#loc4)",
        "  %2 = ttng.warp_group_dot %a, %b, %c {isAsync = true} : !ttg.memdesc<64x64xf16, #s>"
        " * !ttg.memdesc<64x32xf16, #s> -> tensor<64x32xf32, #mma1> loc(#loc4)",
    ]
)


def test_compile_check_reads_how_each_dot_lowers(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(HERE / "gpu_compile"))
    from triton_check import dots

    assert dots(TTGIR) == [
        {"lowering": "mma", "operands": "bf16", "source": "moe_experts.py:121"},
        {"lowering": "fma", "operands": "f32", "source": "causal_dot_product.py:99"},
        {"lowering": "wgmma", "operands": "f16", "source": "causal_dot_product.py:99"},
    ]


def test_compile_check_fails_a_max_that_drops_nan(monkeypatch):
    """``tl.maximum``'s default on a GPU (``arith.maxnumf``) returns the other operand for a
    NaN, where the interpreter's NumPy propagates it: only the compiled IR shows it, so the
    compile check fails on it (relu and relu² used it)."""
    monkeypatch.syspath_prepend(str(HERE / "gpu_compile"))
    from report import problems

    row = {"ok": True, "dtype": "float32", "target": "sm_90", "dots": [], "nan_dropping": 2}
    assert any("drop NaN" in p for p in problems(row))
    assert problems({**row, "nan_dropping": 0}) == []


def test_the_tuned_grouped_matmul_zeroes_its_partials_between_configs():
    """The ``<h, u>`` partials of ``routed_experts``' backward: a config writes the rows of its
    own column tiles only, so the autotuner zeroes them before timing each config and before
    the chosen one runs (stale rows of a narrower config would be summed otherwise)."""
    from cakeops_triton.routed_experts import grouped_gemm

    assert grouped_gemm._grouped_mm_tuned.reset_to_zero == ["DWP"]


THREADS = textwrap.dedent(
    """
    import sys, threading, torch, cakeops
    backend = sys.argv[1]
    torch.manual_seed(0)
    x, z, w = torch.randn(64, 64), torch.randn(64, 64), torch.rand(64) + 0.5
    q, v = torch.randn(1, 2, 40, 16) * 0.25, torch.randn(1, 2, 40, 16)
    with cakeops.use_backend(backend):
        ref = (cakeops.rmsnorm_silu_gate(x, z, w), cakeops.causal_dot_product(q, q, v))
    errors, outs = [], []
    def work():
        try:
            with cakeops.use_backend(backend):
                for _ in range(2):
                    outs.append((cakeops.rmsnorm_silu_gate(x, z, w),
                                 cakeops.causal_dot_product(q, q, v)))
        except Exception as exc:
            errors.append(repr(exc))
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(outs) == 8
    assert all(torch.equal(a, ref[0]) and torch.equal(b, ref[1]) for a, b in outs)
    print("ok")
    """
)


@pytest.mark.parametrize(
    "backend, env",
    [("triton", {"TRITON_INTERPRET": "1"}), ("numba", {"NUMBA_ENABLE_CUDASIM": "1"})],
    ids=["triton-interpreter", "numba-simulator"],
)
def test_interpreter_and_simulator_serve_several_threads(backend, env):
    """Their state is process-global: calls from several threads take turns and give the same
    results as one thread."""
    pytest.importorskip(backend)
    done = subprocess.run(
        [sys.executable, "-c", THREADS, backend], env={**os.environ, **env},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


TUNED_PATH = textwrap.dedent(
    """
    import torch
    import cakeops
    from cakeops.ops import SPECS
    from cakeops.testing import assert_matches
    import cakeops_triton.causal_conv1d as conv
    import cakeops_triton.causal_dot_product as causal
    import cakeops_triton.rmsnorm_silu_gate as rmsnorm
    import cakeops_triton.routed_experts.grouped_gemm as routed
    from cakeops.helpers import given_routing
    from cakeops_triton.causal_dot_product import log_grads

    # every problem takes the autotuned, specialised kernels (the GPU path of big shapes), and
    # the untuned kernels take a GPU's tiles (the interpreter's own are smaller)
    causal.TUNE_FROM_POSITIONS = routed.TUNE_FROM_ROWS = rmsnorm.UNTUNED_BELOW = 0
    conv.BL, conv.BC, conv.SPAN = 8, 64, 16
    log_grads.CHUNK, log_grads.STATE_TILE, log_grads.WALK_TILE = 16, 4096, 8192
    for op in ("rmsnorm_silu_gate", "causal_dot_product", "moe_experts", "routed_experts",
               "causal_conv1d"):
        spec = SPECS[op]
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            inputs = spec.example("cpu", dtype)
            wrt = [inputs[name] for name in spec.differentiable_given(inputs)]
            for t in wrt:
                t.requires_grad_()
            got = {}
            for backend in ("triton", "reference"):
                with cakeops.use_backend(backend):
                    out = spec(**inputs)
                    got[backend] = [out, *torch.autograd.grad(out, wrt, torch.ones_like(out))]
            for mine, ref in zip(got["triton"], got["reference"]):
                assert_matches(mine, ref, op)
    # sizes of 16-element multiples: the 128-row tiles of tuned 16-bit products
    torch.manual_seed(0)
    T, D, F, E, k = 24, 16, 32, 4, 2
    x = torch.randn(T, D, dtype=torch.bfloat16, requires_grad=True)
    index = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k), -1).bfloat16().requires_grad_()
    shapes = ((E, F, D), (E, F, D), (E, D, F))
    ws = [(torch.randn(s) * 0.2).bfloat16().requires_grad_() for s in shapes]
    assert routed.rows_per_tile(given_routing(index, weights.float(), E), x, *ws) == 128
    got = {}
    for backend in ("triton", "reference"):
        with cakeops.use_backend(backend):
            out = cakeops.routed_experts(x, index, weights, *ws)
            got[backend] = [out, *torch.autograd.grad(out, [x, weights, *ws], torch.ones_like(out))]
    for mine, ref in zip(got["triton"], got["reference"]):
        assert_matches(mine, ref, "routed_experts")
    # the other forms of expert on the same tiles: biases and tanh-GELU, and no gate with ReLU²
    b = [(torch.randn(s) * 0.2).bfloat16().requires_grad_() for s in ((E, F), (E, F), (E, D))]
    for gate, options in ((ws[0], {"activation": "gelu_tanh", "b_gate": b[0], "b_up": b[1],
                                   "b_down": b[2]}), (None, {"activation": "relu2"})):
        leaves = [x, weights, *(w for w in (gate, *ws[1:]) if w is not None),
                  *(v for v in options.values() if isinstance(v, torch.Tensor))]
        got = {}
        for backend in ("triton", "reference"):
            with cakeops.use_backend(backend):
                out = cakeops.routed_experts(x, index, weights, gate, *ws[1:], **options)
                got[backend] = [out, *torch.autograd.grad(out, leaves, torch.ones_like(out))]
        for mine, ref in zip(got["triton"], got["reference"]):
            assert_matches(mine, ref, "routed_experts " + options["activation"])
    # the gated scan's log-multiplier gradients on a GPU's chunks and column blocks
    torch.manual_seed(0)
    q, k = (torch.randn(1, 2, 40, 16) for _ in "qk")
    v = torch.randn(1, 2, 40, 24)
    gates = -torch.rand(1, 2, 40)
    leaves = [q, k, v, gates]
    for t in leaves:
        t.requires_grad_()
    got = {}
    for backend in ("triton", "reference"):
        with cakeops.use_backend(backend):
            out = cakeops.causal_dot_product(q, k, v, log_gates=gates)
            got[backend] = [out, *torch.autograd.grad(out, leaves, torch.ones_like(out))]
    for mine, ref in zip(got["triton"], got["reference"]):
        assert_matches(mine, ref, "causal_dot_product log_gates")
    # the chunked delta rule on a GPU's chunks and blocks, scalar gates and KDA's: two key
    # blocks of the walks, two column blocks of their states, KDA's C x C x 8 tiles
    from cakeops_triton import gated_delta_rule as delta_rule
    from cakeops_triton.gated_delta_rule import chunk
    chunk.CHUNK, chunk.WALK_KEY_BLOCK, chunk.GRAD_KEY_BLOCK = 16, 32, 32
    torch.manual_seed(0)
    N, H, L, K, V = 1, 2, 40, 64, 48
    for kda in (False, True):
        q, k = (torch.randn(N, H, L, K) for _ in "qk")
        v = torch.randn(N, H, L, V)
        g = -torch.rand(N, H, L, *((K,) if kda else ())) * 0.2
        beta = torch.rand(N, H, L)
        leaves = [q, k, v, g, beta]
        for t in leaves:
            t.requires_grad_()
        got = {}
        for backend in ("triton", "reference"):
            with cakeops.use_backend(backend):
                out = cakeops.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
                got[backend] = [out, *torch.autograd.grad(out, leaves, torch.ones_like(out))]
        for mine, ref in zip(got["triton"], got["reference"]):
            assert_matches(mine, ref, "gated_delta_rule")
    print("ok")
    """
)


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton is not installed"
)
def test_the_tuned_kernels_match_the_reference_too():
    """The conformance suite's small shapes take the untuned kernels; the autotuned ones (a
    GPU's path for big problems) run here, through the interpreter, at the same small shapes."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", TUNED_PATH], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


CHUNK_ROUTES = textwrap.dedent(
    """
    import torch
    from cakeops_triton import gated_delta_rule as gdr
    taken = []
    for name in ("chunk", "fused_recurrent"):
        module = getattr(gdr, name)
        for step in ("forward", "backward"):
            wrap = (lambda f, n: lambda *a: taken.append(n) or f(*a))
            setattr(module, step, wrap(getattr(module, step), name))

    def call(L, K, kda=False):
        q = torch.randn(1, 1, L, K)
        k = torch.nn.functional.normalize(torch.randn(1, 1, L, K), dim=-1)
        v = torch.randn(1, 2, L, 3)
        g = -torch.rand(1, 2, L, *((K,) if kda else ()))
        args = (q, k, v, g, torch.rand(1, 2, L), K**-0.5, None, True, None, True)
        out, final = gdr.forward(*args)
        gdr.backward(torch.randn_like(out), torch.randn_like(final), *args)

    for L, K, kda, want in ((gdr.CHUNKED_FROM, 8, False, "chunk"),
                            (gdr.CHUNKED_FROM - 1, 8, False, "fused_recurrent"),
                            (gdr.CHUNKED_FROM, 8, True, "chunk"),
                            (gdr.CHUNKED_FROM - 1, 8, True, "fused_recurrent"),
                            (gdr.CHUNKED_FROM, gdr.chunk.MAX_K + 1, False, "fused_recurrent")):
        taken.clear()
        call(L, K, kda)
        assert taken == [want, want], (L, K, kda, taken)
    print("ok")
    """
)


def test_the_delta_rule_takes_the_chunked_kernels_where_they_serve():
    """Key heads up to ``chunk.MAX_K`` and at least ``CHUNKED_FROM`` positions, scalar gates or
    KDA's: the chunked kernels, forward and backward (the conformance suite checks their
    results); shorter calls and wider heads: the step kernels. The same rule on a GPU and in the
    interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHUNK_ROUTES], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_the_delta_rule_on_cuda_takes_triton_where_it_chunks_or_decodes():
    """On CUDA, Triton ranks above torch for the gated delta rule (a decode step is one launch
    of its step kernel, against the chunked form's dozen; a training call with key heads up
    to ``chunk.MAX_K``, scalar gates or KDA's, runs chunked both ways) and passes over the
    calls longer than ``DELTA_RULE_POSITIONS`` that only its step kernels take (wider heads),
    whose step-by-step backward loses to torch's chunked one."""
    import cakeops_triton
    from cakeops.ops import SPECS
    from cakeops_torch import backend as torch_backend

    triton_backend = cakeops_triton.backend
    kernels = triton_backend.ops["gated_delta_rule"]
    assert kernels.priority("cuda") > torch_backend.ops["gated_delta_rule"].priority("cuda")
    spec = SPECS["gated_delta_rule"]
    from cakeops_triton import gated_delta_rule as delta_rule
    from cakeops_triton.gated_delta_rule import chunk

    longest = delta_rule.DELTA_RULE_POSITIONS
    wide = chunk.MAX_K + 1
    for L, kda, K, passed in ((1, False, 8, False), (longest, True, 8, False),
                              (longest + 1, False, 8, False), (4096, False, chunk.MAX_K, False),
                              (longest + 1, True, 8, False), (4096, True, chunk.MAX_K, False),
                              (4096, False, wide, True), (4096, True, wide, True),
                              (1, True, wide, False)):  # fmt: skip
        q = torch.randn(1, 2, L, K)
        g = -torch.rand(1, 4, L, *((K,) if kda else ()))
        inputs = spec.inputs(q=q, k=q, v=torch.randn(1, 4, L, 6), g=g, beta=torch.rand(1, 4, L))
        reasons = triton_backend.not_preferred_reasons("gated_delta_rule", inputs)
        assert bool(reasons) == passed, (L, kda, K, reasons)
        assert not reasons or f"up to {longest} positions" in reasons[0]


LOG_GRAD_ROUTES = textwrap.dedent(
    """
    import torch
    from cakeops.helpers import log_multiplier_grads, log_multipliers
    from cakeops_triton.causal_dot_product import log_grads as lg

    helped = []
    lg.log_multiplier_grads = lambda *a: helped.append(a[2].shape[-1]) or log_multiplier_grads(*a)
    gen = torch.Generator().manual_seed(0)
    for E, packed in ((lg.MAX_E, False), (5, True), (lg.MAX_E + 1, False)):
        N, H, L, M = 1, 2, 3 * lg.CHUNK + 3, 40  # several column blocks of both kernels
        q, k = (torch.randn(N, H, L, E, generator=gen) for _ in "qk")
        v, g = (torch.randn(N, H, L, M, generator=gen) for _ in "vg")
        decay, gates = -torch.rand(H, generator=gen), -torch.rand(N, H, L, generator=gen)
        gates[0, 1, lg.CHUNK + 2] = -torch.inf  # a hard reset inside a chunk
        cu = torch.tensor([0, 5, 5, L]) if packed else None
        S = 3 if packed else N
        s0, gf = (torch.randn(S, H, E, M, generator=gen) for _ in "sf")
        lm = log_multipliers(q, decay, gates)
        args = (g, gf, q, k, v, lm, s0, cu, decay, gates)
        helped.clear()
        got = lg.gradients(*args)
        assert helped == ([E] if E > lg.MAX_E else []), (E, helped)
        want = log_multiplier_grads(*args)
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-3), (E, a, b)
    print("ok")
    """
)


def test_the_log_multipliers_gradients_take_two_kernels_up_to_max_e():
    """The gated scan's log multipliers' gradients: Triton's two kernels for key heads up to
    ``log_grads.MAX_E`` (packed sequences, a hard reset, both states given), the spec helper
    for wider ones; the same values either way (the conformance suite checks them against the
    reference)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", LOG_GRAD_ROUTES], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
