"""The H200 forecast, without a GPU: each op at the H200 benchmark shapes (``cakeops.bench.gpu``)
runs through the compile-only driver, which notes every Triton launch the host code makes (its
kernel, grid and arguments); for an autotuned launch every config the pruning keeps is modelled
and the fastest taken, as the autotuner would. Each launch's time is a range:

- **low**: the largest of its unique HBM bytes at the copy bandwidth, its FLOPs at the matrix
  rate, its tiles' operand traffic from L2 at the faster L2 bandwidth, and its serial chain
  (``causal_dot_product``: one chunk after another per program) at the shorter chunk latency;
- **high**: the same limits at the slower L2 bandwidth and the longer chunk latency, added
  rather than overlapped (memory, then compute), times the waves' quantisation (a last,
  partial wave of programs costs a whole one);
- **conservative**: the longest of memory at :data:`MEMORY_EFFICIENCY` of the copy bandwidth,
  products at :data:`MATMUL_EFFICIENCY` of the matrix rate (what published kernels of the kind
  reach, their overlap losses included), the slow L2 and the long chain, over the last wave's
  fill (the range assumes every kernel at the measured rates, which none has shown).

Rates are those measured on an H200 (copy about 4.3 TB/s, dense bf16 about 790 TFLOP/s), not
the datasheet's; the PyTorch ops of the host code (routing, casts, partial sums) count by the
bytes of their operands and results. Written as a table into ``docs/content/gpu.md``.

    python tests/gpu_compile/predict.py --docs docs/content/gpu.md
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import triton_check
from shapes import Call, inputs

from cakeops.bench import gpu as bench_gpu

DEVICE = "H200 (measured rates: copy 4.3 TB/s, dense bf16 790 TFLOP/s; 132 SMs)"
BANDWIDTH = 4.3e12
BF16_RATE = 790e12
#: float32 products on FMA (no tensor cores): the H200's datasheet 67 TFLOP/s
FP32_FMA_RATE = 67e12
SMS = 132
#: The conservative column: the fractions of the measured rates that published kernels of the
#: same kind reach on Hopper (fused memory-bound norms about 80% of the copy bandwidth; grouped
#: GEMMs of MoE layers, with their partial tiles per expert, about 45% of the dense rate)
MEMORY_EFFICIENCY = 0.80
MATMUL_EFFICIENCY = 0.45
#: L2 -> SM operand bandwidth, (fast, slow) bytes/s: what a tile's re-read operands cost
L2_BANDWIDTH = (10e12, 7e12)
#: one chunk of the causal scan after the other, (short, long) seconds per chunk
CHUNK_LATENCY = (0.4e-6, 1.0e-6)
#: one step of the gated delta rule's recurrence after the other (its loads, three reductions
#: across warps), (short, long) seconds per step
STEP_LATENCY = (0.3e-6, 0.8e-6)
#: one chunk of the chunked gated delta rule's walks after the other (its loads of the state's
#: key blocks from L2, their products, a barrier, the stores), (short, long) seconds per chunk
WALK_LATENCY = (1.0e-6, 3.0e-6)
#: a float32 product as three TF32 products (``tf32x3``, for 16-bit inputs), in bf16-rate FLOPs:
#: TF32 runs at half the bf16 rate, three times
TF32X3 = 6
#: FMA-unit operations per term of KDA's ``sum_c x_tc y_jc exp(E_tjc)``: the running sum, the
#: ``exp`` (on the special-function units, counted as two), two products, the masked add
KDA_TERM_FLOPS = 6
START, END = "<!-- gpu-predict:start -->", "<!-- gpu-predict:end -->"
GATED = "causal_dot_product, log_gates"
DELTA = "gated_delta_rule"
KDA = "gated_delta_rule, KDA"
SHORT = {"forward": "fwd", "backward": "bwd"}


def _size(t) -> int:
    return t.element_size() if isinstance(t, torch.Tensor) else 0


def model(kernel: str, a: dict) -> dict:
    """What one launch must do, from its arguments and config (``a``): ``bytes`` (unique HBM
    traffic), ``flops``, ``l2`` (operand bytes its tiles read from L2), ``chain`` (serial steps
    per program), ``programs`` and ``per_sm`` (programs a multiprocessor holds at once)."""
    warps = a.get("num_warps", 4)
    per_sm = max(1, 8 // warps)
    if kernel == "_forward_kernel":  # rmsnorm: read x, z, w; write y
        R, D, es = a["R"], a["D"], _size(a["X"])
        return {"bytes": 3 * R * D * es + D * _size(a["W"]), "flops": 12 * R * D, "l2": 0,
                "chain": 0, "programs": a["_grid"][0], "per_sm": 4}  # fmt: skip
    if kernel == "_backward_kernel":  # read g, x, z (row blocks again from L2), w; write dx, dz
        R, D, es = a["R"], a["D"], _size(a["X"])
        partial = 2 * a["PROGRAMS"] * D * 4  # each program's float32 dweight row
        # persistent: PROGRAMS_PER_SM programs on each multiprocessor of the GPU
        return {"bytes": 5 * R * D * es + D * _size(a["W"]) + partial, "flops": 30 * R * D,
                "l2": 2 * R * D * es, "chain": 0, "programs": 4 * SMS,
                "per_sm": 4}  # fmt: skip
    if kernel == "_causal_kernel":
        L, E, M = a["L"], a["E"], a["M"]
        # float32 runs (the log multipliers' side runs) multiply on FMA, not tensor cores
        rate = FP32_FMA_RATE if _size(a["A"]) == 4 and a.get("PRECISION") == "ieee" else None
        NH = a["_grid"][0]
        es, bl, bm = _size(a["A"]), a["BLOCK_L"], a["BLOCK_M"]
        m_blocks = math.ceil(M / bm)
        chunks = math.ceil(L / bl)
        per_chunk = 2 * bl * (bl * E + bl * bm + 2 * E * bm)  # scores, scores@v, a@S, S update
        # a and b are read once per column block (the second and later from L2)
        l2 = NH * (m_blocks - 1) * L * 2 * E * es
        return {"bytes": NH * L * (2 * E + 2 * M) * es, "flops": NH * m_blocks * chunks * per_chunk,
                "l2": l2, "chain": chunks, "programs": NH * m_blocks, "per_sm": per_sm,
                **({"rate": rate} if rate else {})}  # fmt: skip
    if kernel in ("_entering_states_kernel", "_crossing_sums_kernel"):
        # the gated scan's log multipliers' gradients (causal_dot_product/log_grads.py): a walk
        # over chunks per (sequence, head, column block); q and k re-read per block from L2
        L, E, M, C, bm = a["L"], a["E"], a["M"], a["CHUNK"], a["BLOCK_M"]
        NH, blocks = a["_grid"]
        es, chunks = _size(a["V"]), math.ceil(L / C)
        states = NH * chunks * E * M * _size(a["STATES"])
        fma = BF16_RATE / FP32_FMA_RATE
        if kernel == "_entering_states_kernel":  # read k, v; write the states
            nbytes, keys = NH * L * (E + M) * es + states, 1
            flops = NH * blocks * chunks * 2 * C * E * bm
        else:  # read q, k, v, g, the states; write each block's sums
            nbytes, keys = NH * L * (2 * E + 2 * M) * es + states + NH * blocks * L * 4, 2
            per_chunk = 2 * C * C * (E + bm) + 3 * 2 * C * E * bm + 2 * C**3 * fma
            flops = NH * blocks * chunks * per_chunk
        return {"bytes": nbytes, "flops": flops, "l2": NH * (blocks - 1) * L * keys * E * es,
                "chain": chunks, "programs": NH * blocks, "per_sm": per_sm}  # fmt: skip
    if kernel == "_grouped_mm":
        rows, N, K, mode = a["ROWS"], a["N"], a["K"], a["MODE"]
        bm, bn = a["BLOCK_M"], a["BLOCK_N"]
        es, wes = _size(a["A"]), _size(a["W"])
        experts = a["W"].shape[0]
        n_a, n_w, outs = {0: (1, 1, 1), 1: (1, 2, 1), 2: (2, 3, 3), 3: (2, 2, 1)}[mode]
        if a.get("U_GIVEN"):  # the SwiGLU backward reading u (float32 rows) instead of g W_down
            n_a, n_w = 1, 2
        row_tiles = math.ceil(rows / bm) + experts  # each expert's last tile is partial
        col_tiles = math.ceil(N / bn)
        nbytes = (
            rows * K * es * n_a + experts * N * K * wes * n_w + rows * N * _size(a["OUT"]) * outs
        )
        # every program reads its rows' K-wide A tiles and its columns' weight tiles
        l2 = row_tiles * col_tiles * K * (bm * es * n_a + bn * wes * n_w)
        return {"bytes": nbytes, "flops": 2 * row_tiles * bm * N * K * n_w, "l2": l2, "chain": 0,
                "programs": row_tiles * col_tiles, "per_sm": per_sm}  # fmt: skip
    if kernel == "_grouped_weight_grad":
        experts = a["_grid"][0]
        P, Q, bp, bq = a["P"], a["Q"], a["BLOCK_P"], a["BLOCK_Q"]
        rows = a["A"].shape[0] if not a["GATHER_A"] else a["IDX_A"].numel()
        es = max(_size(a["A"]), _size(a["B"]))
        tiles = math.ceil(P / bp) * math.ceil(Q / bq)
        l2 = rows * (math.ceil(Q / bq) * P + math.ceil(P / bp) * Q) * es
        return {"bytes": rows * (P + Q) * es + experts * P * Q * _size(a["DW"]),
                "flops": 2 * rows * P * Q, "l2": l2, "chain": 0, "programs": experts * tiles,
                "per_sm": per_sm}  # fmt: skip
    if kernel in ("_delta_forward", "_delta_backward"):
        # the recurrence, step by step: a program per (sequence, value head, column block);
        # 2 programs a multiprocessor (about 240 registers a thread on 4 warps)
        L, K, V, es = a["L"], a["K"], a["V"], _size(a["Q"])
        heads, columns = a["_grid"]
        gates = heads * L * (K if a["sg_k"] else 1) * 4 + heads * L * es  # g (float32), beta
        keys = heads // a["GROUP"] * L * 2 * K * es  # q, k: read by every program from L2
        if kernel == "_delta_forward":
            saved = a["SAVE"] * heads * math.ceil(L / 64) * K * V * 4  # the chunk states
            out = (1 - a["SAVE"]) * heads * L * V * es
            return {"bytes": keys + gates + heads * L * V * es + out + saved,
                    "flops": 6 * heads * L * K * V, "l2": heads * columns * L * 2 * K * es,
                    "chain": L, "programs": heads * columns, "per_sm": 2,
                    "latency": STEP_LATENCY}  # fmt: skip
        blocks = a["BLOCKS"]
        turns = math.ceil(blocks / columns)  # blocks a program takes one after the other
        # per block: v, dout, dv and the float32 sums of dq, dk and dg read and written back
        sums = blocks * heads * L * K * 4 * 2 * (3 if a["KDA"] else 2)
        states = heads * math.ceil(L / 64) * K * V * 4
        return {"bytes": keys + gates + 3 * heads * L * V * es + sums + states,
                "flops": 16 * heads * L * K * V, "l2": heads * blocks * L * 2 * K * es,
                "chain": 2 * L * turns, "programs": heads * columns, "per_sm": 2,
                "latency": STEP_LATENCY}  # fmt: skip
    if kernel.startswith("_chunk_"):
        return _chunk_model(kernel, a, per_sm)
    if kernel == "_slot_sum_kernel":  # read the float32 slots, write each token's sum
        tokens, D, k = a["_grid"][0], a["D"], a["TOP_K"]
        return {"bytes": tokens * D * (k * 4 + _size(a["OUT"])), "flops": tokens * D * k,
                "l2": 0, "chain": 0, "programs": tokens * a["_grid"][1], "per_sm": 8}  # fmt: skip
    raise KeyError(f"no byte/FLOP model for kernel {kernel}")


def _chunk_model(kernel: str, a: dict, per_sm: int) -> dict:
    """The chunked gated delta rule's launches (``cakeops_triton/gated_delta_rule/chunk.py``):
    16-bit products at the bf16 rate, float32 ones as three TF32 products (16-bit inputs) or
    on FMA (``ieee``), expressed in bf16-rate FLOPs."""
    K, V, C = a["K"], a.get("V", 0), a["C"]
    Hv = a["_grid"][1]
    es = _size(a["K_"] if "K_" in a else a["V_"])  # the inputs' dtype
    fma = BF16_RATE / FP32_FMA_RATE  # one FMA-unit FLOP in bf16-rate FLOPs
    x3 = TF32X3 if a.get("STATE_PRECISION") == "tf32x3" else 1
    # KDA: a gate per key column (read as a C x K block where a scalar gate is C numbers), and
    # each C x C score matrix formed on FMA over C x C x K terms (running sum, exp, products)
    kda = kernel == "_chunk_grads_kda" or bool(a.get("KDA"))
    gate_bytes = C * K * _size(a["G"]) if kda and "G" in a else 0
    scores = KDA_TERM_FLOPS * C * C * K * fma
    if kernel in ("_chunk_states", "_chunk_states_bwd"):
        sequences, _, blocks = a["_grid"]
        L = a["L"] if not a["PACKED"] else (a["CU"][1:] - a["CU"][:-1]).max().item()
        chunks = math.ceil(L / C)
        tiles = sequences * Hv * chunks  # (sequence, head, chunk)
        bv = a["BV"]
        keys = tiles * blocks * C * K * (4 + es * (2 if kernel == "_chunk_states_bwd" else 1))
        if kernel == "_chunk_states":  # read U~, W, k; write U, the chunk states
            nbytes = tiles * (2 * C * V * 4 + C * K * (4 + es) + K * V * _size(a["STATES"]))
            flops = tiles * blocks * 2 * (2 * C * K * bv) * x3
        else:  # read W, P, k, q, dO; write dS per chunk, dU
            nbytes = tiles * (C * K * (4 + 2 * es) + C * C * 4 + C * V * (es + 4) + K * V * 4)
            flops = tiles * blocks * 2 * (3 * C * K * bv + C * C * bv) * x3
        nbytes += tiles * gate_bytes
        return {"bytes": nbytes, "flops": flops, "l2": keys + 3 * tiles * blocks * K * bv * 4,
                "chain": chunks, "programs": sequences * Hv * blocks, "per_sm": per_sm,
                "latency": WALK_LATENCY}  # fmt: skip
    slots = a["_grid"][0]
    tiles = slots * Hv
    if kernel == "_chunk_wy":  # k (q), g, beta, v in; W, U (T, P) out, float32
        back = bool(a["BACKWARD"])
        nbytes = tiles * (C * K * es * (2 if back else 1) + C * V * es + C * (K + V) * 4
                          + (2 * C * C * 4 if back else 0))  # fmt: skip
        flops = tiles * (2 * C * C * K + (C**3 + 2 * C * C * (K + V)) * fma
                         + (2 * C * C * K * TF32X3 if back else 0))  # fmt: skip
        if kda:  # A (and P) as sums of gated terms
            nbytes += tiles * gate_bytes
            flops += tiles * scores * (2 if back else 1)
        return {"bytes": nbytes, "flops": flops, "l2": 0, "chain": 0, "programs": tiles,
                "per_sm": per_sm}  # fmt: skip
    if kernel == "_chunk_output":  # q, k, the chunk states, U in; O out
        blocks = a["_grid"][2]
        nbytes = tiles * (K * V * _size(a["STATES"]) + C * V * (4 + es)) + tiles * 2 * C * K * es
        flops = tiles * blocks * 2 * (C * C * K + C * K * a["BV"] + C * C * a["BV"])
        if kda:  # each column block forms the scores again
            nbytes += tiles * gate_bytes
            flops += tiles * blocks * scores
        return {"bytes": nbytes, "flops": flops, "l2": tiles * blocks * 2 * C * K * es,
                "chain": 0, "programs": tiles * blocks, "per_sm": per_sm}  # fmt: skip
    if kernel == "_chunk_grads_v":  # the states and their gradients, U, dU, dO, v in
        nbytes = tiles * (2 * K * V * 4 + C * V * (2 * 4 + 3 * es) + 3 * C * K * 4 + 2 * C * C * 4)
        flops = tiles * 2 * (3 * C * K * V + 3 * C * C * V) * x3
        return {"bytes": nbytes, "flops": flops, "l2": tiles * C * V * (2 * 4 + es), "chain": 0,
                "programs": tiles, "per_sm": per_sm}  # fmt: skip
    if kernel == "_chunk_grads_k":  # q, k, the sums in; dq, dk, dbeta, dg out (FMA products)
        nbytes = tiles * (2 * C * K * es + 5 * C * K * 4 + 4 * C * C * 4)
        flops = tiles * 2 * (9 * C * C * K + 4 * C**3) * fma
        return {"bytes": nbytes, "flops": flops, "l2": tiles * 6 * C * K * (es + 4), "chain": 0,
                "programs": tiles, "per_sm": per_sm}  # fmt: skip
    if kernel == "_chunk_grads_kda":  # as _chunk_grads_k, with A's scores and their
        # gradients over C x C x K terms (pass 2: about four times the scores' work)
        nbytes = tiles * (2 * C * K * es + 5 * C * K * 4 + 4 * C * C * 4 + gate_bytes)
        flops = tiles * (2 * (3 * C * C * K + 4 * C**3) * fma + 5 * scores)
        return {"bytes": nbytes, "flops": flops, "l2": tiles * 6 * C * K * (es + 4), "chain": 0,
                "programs": tiles, "per_sm": per_sm}  # fmt: skip
    raise KeyError(f"no byte/FLOP model for kernel {kernel}")


def seconds(work: dict, conservative: bool = False) -> tuple[float, float]:
    """``(low, high)`` seconds of a launch's ``work`` (see the module's docstring); with
    ``conservative``, the high end is the longest of memory at :data:`MEMORY_EFFICIENCY` of the
    copy bandwidth, products at :data:`MATMUL_EFFICIENCY` of the matrix rate (the fractions
    published kernels of the kind reach, overlap losses included), the slow L2 and the long
    chain, over the last wave's fill."""
    memory, compute = work["bytes"] / BANDWIDTH, work["flops"] / work.get("rate", BF16_RATE)
    slots = SMS * work["per_sm"]
    waves = math.ceil(work["programs"] / slots) if work["programs"] else 1
    fill = work["programs"] / (waves * slots) if work["programs"] else 1.0
    latency = work.get("latency", CHUNK_LATENCY)
    chain_low = work["chain"] * latency[0] * waves
    chain_high = work["chain"] * latency[1] * waves
    low = max(memory, compute, work["l2"] / L2_BANDWIDTH[0], chain_low)
    high = max(memory + compute, work["l2"] / L2_BANDWIDTH[1], chain_high) / max(fill, 1e-9)
    if conservative:
        derated = max(memory / MEMORY_EFFICIENCY, compute / MATMUL_EFFICIENCY,
                      work["l2"] / L2_BANDWIDTH[1], chain_high) / max(fill, 1e-9)  # fmt: skip
        return low, max(low, derated)
    return low, max(low, high)


def candidates(kernel: str, args: dict) -> list[dict]:
    """Every config the autotuner could pick for this launch (the config it ran with, for an
    untuned kernel): ``args`` merged with each."""
    if kernel == "_causal_kernel":
        module = importlib.import_module("cakeops_triton.causal_dot_product")
        kept = module._prune(module._CONFIGS, args, BLOCK_E=args["BLOCK_E"])
    elif kernel == "_grouped_mm":
        module = importlib.import_module("cakeops_triton.routed_experts.grouped_gemm")
        kept = module._prune(module._CONFIGS, args, **args)
    elif kernel == "_grouped_weight_grad":
        module = importlib.import_module("cakeops_triton.routed_experts.grouped_gemm")
        kept = module._prune_grad(module._GRAD_CONFIGS, args, **args)
    else:
        return [args]
    out = []
    for config in kept:
        merged = {**args, **config.all_kwargs()}
        if kernel == "_causal_kernel":
            merged["BLOCK_M"] = module._block_m(merged)
        out.append(merged)
    return out or [args]


class HostOps:
    """A dispatch mode noting the bytes each PyTorch op of the host code reads and writes
    (views and allocations move nothing)."""

    FREE = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
            "lift_fresh", "alias")  # fmt: skip

    def __init__(self, noted: list[dict], state: dict):
        from torch.utils._python_dispatch import TorchDispatchMode

        notes = noted

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                if not func.is_view and name not in HostOps.FREE:
                    tensors = [t for t in _flat((args, kwargs, out)) if isinstance(t, torch.Tensor)]
                    nbytes = sum(t.numel() * t.element_size() for t in tensors)
                    notes.append({"kernel": "PyTorch ops", "phase": state["phase"],
                                  "bytes": nbytes, "name": name})  # fmt: skip
                return out

        self.mode = Mode()


def _flat(tree):
    if isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _flat(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _flat(item)
    else:
        yield tree


class Launches:
    """Notes every Triton launch (kernel name, arguments, grid, :attr:`phase`) while installed,
    and the PyTorch ops of the host code (:class:`HostOps`); the configs an autotuner tries
    are noted as the candidates of the launch that follows them."""

    def __init__(self):
        self.rows: list[dict] = []
        self.tried: list[dict] = []
        self.state = {"tuning": False, "phase": "forward"}

    def __enter__(self) -> Launches:
        from triton.runtime import autotuner
        from triton.runtime.jit import JITFunction

        self._saved = JITFunction.run, autotuner.Autotuner._bench
        original_run, original_bench = self._saved
        notes, state = self, self.state

        def run(fn, *args, grid, warmup, **kwargs):
            kernel = original_run(fn, *args, grid=grid, warmup=warmup, **kwargs)
            if not warmup:
                named = dict(zip(fn.arg_names, args, strict=False)) | kwargs
                named["_grid"] = tuple(grid(named) if callable(grid) else grid)
                row = {"kernel": fn.fn.__name__, "args": named, "phase": state["phase"]}
                if state["tuning"]:
                    notes.tried.append(row)
                else:
                    notes.rows.append({**row, "candidates": notes.tried or [row]})
                    notes.tried = []
            return kernel

        def bench(tuner, *args, **kwargs):
            state["tuning"] = True
            try:
                return original_bench(tuner, *args, **kwargs)
            finally:
                state["tuning"] = False

        JITFunction.run, autotuner.Autotuner._bench = run, bench
        self._host = HostOps(self.rows, state).mode
        self._host.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime import autotuner
        from triton.runtime.jit import JITFunction

        self._host.__exit__(*exc)
        JITFunction.run, autotuner.Autotuner._bench = self._saved


def launches(call: Call) -> list[dict]:
    """Every Triton launch the op's forward and backward make at ``call``, with its arguments,
    and every PyTorch op of the host code, with its bytes."""
    module = importlib.import_module(f"cakeops_triton.{call.op}")
    fwd, bwd = inputs(call)
    with Launches() as noted:
        module.forward(*fwd)
        noted.state["phase"] = "backward"
        module.backward(*bwd)
    return noted.rows


def predict() -> list[dict]:
    recorder = triton_check.Recorder()
    recorder.install()
    from triton.runtime.driver import driver

    driver.set_active(triton_check.CompileOnly(90))
    full = bench_gpu.FULL
    causal = tuple(full["causal_dot_product"])
    N, L, H, Hv, D = full["gated_delta_rule"]
    calls = {
        "rmsnorm_silu_gate": Call("rmsnorm_silu_gate", torch.bfloat16,
                                  (tuple(full["rmsnorm_silu_gate"]), None, True)),
        "causal_dot_product": Call("causal_dot_product", torch.bfloat16, causal),
        GATED: Call("causal_dot_product", torch.bfloat16, causal, "gates"),
        "moe_experts": Call("moe_experts", torch.bfloat16, tuple(full["moe_experts"])),
        DELTA: Call("gated_delta_rule", torch.bfloat16, (N, H, Hv // H, L, D, D), "models"),
        KDA: Call("gated_delta_rule", torch.bfloat16, (N, H, Hv // H, L, D, D), "models-kda"),
    }  # fmt: skip
    rows = []
    for op, call in calls.items():
        for launch in launches(call):
            if "args" in launch:
                options = [(seconds(model(launch["kernel"], c)), c)
                           for c in candidates(launch["kernel"], launch["args"])]  # fmt: skip
                (low, high), chosen = min(options, key=lambda o: o[0][0] + o[0][1])
                work = model(launch["kernel"], chosen)
                config = _config_name(chosen)
                careful = seconds(work, conservative=True)[1]
            else:
                low = high = launch["bytes"] / BANDWIDTH
                work, config = {"bytes": launch["bytes"], "flops": 0}, ""
                careful = high / MEMORY_EFFICIENCY
            rows.append({"op": op, **{k: launch[k] for k in ("kernel", "phase")}, "config": config,
                         "bytes": work["bytes"], "flops": work["flops"], "low": low,
                         "high": high, "conservative": careful})  # fmt: skip
    return rows


def _config_name(args: dict) -> str:
    blocks = [f"{k.removeprefix('BLOCK_')}{v}" for k, v in args.items() if k.startswith("BLOCK_")]
    return " ".join(blocks) + (f" w{args['num_warps']}" if "num_warps" in args else "")


def _total(rows: list[dict], op: str, key: str) -> float:
    return sum(r[key] for r in rows if r["op"] == op)


def targets(rows: list[dict]) -> dict[str, str]:
    """Each op's forecast against its H200 target, the range and the conservative figure."""
    full = bench_gpu.FULL

    def fractions(op: str, useful: float, rate: float) -> str:
        low, high, careful = (_total(rows, op, k) for k in ("low", "high", "conservative"))
        return (f"{useful / high / rate:.0%}-{useful / low / rate:.0%} (conservative "
                f"{useful / careful / rate:.0%})")  # fmt: skip

    R, D = full["rmsnorm_silu_gate"]
    minimal = 8 * R * D * 2  # the bench's count: 8 tensors of x's size, bf16
    T, Dm, F, _, k = full["moe_experts"]
    useful = 2 * T * k * Dm * F * 9  # forward 3 GEMMs, backward 6 (the bench's count)
    causal = "target: no slower than flash-linear-attention's chunk kernel (GPU only)"
    return {
        "rmsnorm_silu_gate": fractions("rmsnorm_silu_gate", minimal, BANDWIDTH)
        + " of the copy bandwidth (target 80%)",
        "causal_dot_product": causal,
        GATED: causal.replace("chunk kernel", "chunk_simple_gla"),
        "moe_experts": fractions("moe_experts", useful, BF16_RATE) + " of the bf16 rate "
        "(target 50%)",
        DELTA: "target: no slower than flash-linear-attention's chunk_gated_delta_rule (GPU "
        "only); chunked: the two walks over the chunks (their chains times the waves of "
        "programs) dominate",
        KDA: "target: no slower than flash-linear-attention's chunk_kda (GPU only); the same "
        "walks, and the C x C x K gated terms on FMA",
    }


def table(rows: list[dict], summary: bool = True) -> str:
    """The launches' rows grouped by op, pass and kernel; with ``summary``, each op's total
    against its H200 target."""
    lines = [
        f"Forecast for an {DEVICE}, bfloat16, per op, pass (forward, backward) and kernel: the"
        " config the model picks, a range of times and a conservative time (the assumptions"
        " are above).",
        "",
        "| op | pass | kernel | config | launches | GB | GFLOP | forecast (ms) "
        "| conservative (ms) |",
        "|---|---|---|---|--:|--:|--:|--:|--:|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["phase"], r["kernel"]), []).append(r)
    for (op, phase, kernel), g in sorted(groups.items(), key=lambda kv: kv[0][2].startswith("P")):
        nbytes, flops = sum(r["bytes"] for r in g), sum(r["flops"] for r in g)
        low, high = sum(r["low"] for r in g) * 1e3, sum(r["high"] for r in g) * 1e3
        careful = sum(r["conservative"] for r in g) * 1e3
        configs = "; ".join(dict.fromkeys(r["config"] for r in g if r["config"])) or "-"
        name = "host ops" if kernel == "PyTorch ops" else f"`{kernel}`"
        cells = [op, SHORT[phase], name, configs, str(len(g)), f"{nbytes / 1e9:.2f}",
                 f"{flops / 1e9:.0f}", f"{low:.2f}-{high:.2f}", f"{careful:.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    if not summary:
        return "\n".join(lines)
    lines += ["", "| op | forecast (ms) | conservative (ms) | against the H200 target |",
              "|---|--:|--:|---|"]  # fmt: skip
    for op, text in targets(rows).items():
        low, high = _total(rows, op, "low") * 1e3, _total(rows, op, "high") * 1e3
        careful = _total(rows, op, "conservative") * 1e3
        lines.append(f"| {op} | {low:.2f}-{high:.2f} | {careful:.2f} | {text} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=Path)
    args = parser.parse_args()
    text = table(predict())
    print(text)
    if args.docs:
        doc = args.docs.read_text()
        head, rest = doc.split(START, 1)
        args.docs.write_text(f"{head}{START}\n{text}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    main()
