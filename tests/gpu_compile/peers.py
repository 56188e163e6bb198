"""The H200 forecast over flash-linear-attention's own kernels, beside cakeops': the same
compile-only driver notes every Triton launch of the peer's forward and backward at the GPU
benchmark's shapes, and the same :func:`predict.seconds` prices each launch. The peer's kernels
have no hand-written byte/FLOP model (``predict.model``), so every launch gets a generic one:

- **bytes**: every tensor argument once (each read or written once: the streaming kernels'
  unique traffic; nothing is counted for a tile read again from L2);
- **FLOPs**: the launch's ``tl.dot`` products, counted by Triton's interpreter at a small shape
  of the same head sizes and scaled by tokens x heads (a chunked kernel's work per chunk and head
  is fixed); 16-bit products at the bf16 rate, float32 ones at the rate their precision runs
  (TF32 half of it, ``tf32x3`` a sixth, IEEE on FMA); elementwise work is not counted;
- **chain**: the kernels whose programs walk over the chunks (named in :data:`WALKS`), one
  chunk after another at :data:`predict.WALK_LATENCY`;
- **programs** from the launch's grid, two programs a multiprocessor at 4 warps (as
  ``predict.model``); every config the autotuner tried is priced, the fastest taken.

The same generic model runs over cakeops' kernels too (the *generic* column), so that the two
are compared under one model; the *hand* column is ``predict.py``'s. Needs ``fla-core`` (a test
oracle only; ``pip install fla-core einops``) and Triton >= 3.7.1 (fla refuses its gated
backward on Hopper with older Triton).

    python tests/gpu_compile/peers.py [--docs docs/content/gpu.md]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import predict  # noqa: E402  (beside this file)

#: (N, L, H key heads, Hv value heads, head size) of the delta rule: the GPU benchmark's
#: (``cakeops.bench.gpu``), and the interpreter's (the same head sizes and group, 4 chunks of 64)
BENCH_DELTA = (4, 4096, 16, 32, 128)
SMALL_DELTA = (1, 256, 1, 2, 128)
#: (N, H, L, E, M) of the causal scans: the GPU benchmark's, and the interpreter's
BENCH_CAUSAL = (8, 16, 4096, 128, 128)
SMALL_CAUSAL = (1, 1, 256, 128, 128)
#: fla's chunk size: the walks' steps
CHUNK = 64
#: peer kernels whose programs walk over the chunks one after another (the states' passes)
WALKS = (
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
    "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64",
    "chunk_fwd_kernel_h",
    "chunk_bwd_kernel_dh",
)
START, END = "<!-- gpu-peers:start -->", "<!-- gpu-peers:end -->"


def fake_hopper() -> None:
    """What fla reads of the device at import (name, capability, shared memory, SM count),
    answered as an H200 would: its Hopper code paths and configs, compiled for sm_90."""
    import triton_check
    from triton.runtime.driver import driver

    driver.set_active(triton_check.CompileOnly(90))
    props = {"multiprocessor_count": 132, "max_shared_mem": 232448, "max_num_regs": 65536}
    driver.active.utils = types.SimpleNamespace(get_device_properties=lambda i=0: props)
    cuda = torch.cuda
    cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    cuda.get_device_capability = lambda *a, **k: (9, 0)
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
        shared_memory_per_block_optin=232448)  # fmt: skip


def _rand(gen, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()


def _delta(kda: bool, small: bool) -> tuple[Callable, Callable]:
    """fla's gated delta rule (KDA: a gate per key channel) as the GPU benchmark calls cakeops':
    the models' ``(N, L, heads, D)``, float32 gates, initial and final state, the l2 norm of q
    and k in the kernels: ``(forward, backward)``."""
    N, L, H, Hv, D = SMALL_DELTA if small else BENCH_DELTA
    gen = torch.Generator().manual_seed(0)
    q, k, v = _rand(gen, N, L, H, D), _rand(gen, N, L, H, D), _rand(gen, N, L, Hv, D)
    g = (-torch.rand(N, L, Hv, *((D,) if kda else ()), generator=gen) * 0.1).requires_grad_()
    beta = torch.rand(N, L, Hv, generator=gen).to(torch.bfloat16).requires_grad_()
    h0 = _rand(gen, N, Hv, D, D, dtype=torch.float32)
    if kda:
        from fla.ops.kda import chunk_kda as fn
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    seeds = [torch.ones(N, L, Hv, D, dtype=torch.bfloat16), torch.ones(N, Hv, D, D)]
    done = {}

    def forward() -> None:
        done["out"] = fn(q, k, v, g, beta, scale=D**-0.5, initial_state=h0,
                         output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip

    def backward() -> None:  # the gradients of both outputs, made beforehand (not counted)
        torch.autograd.backward(done["out"], seeds)

    return forward, backward


def _causal(gated: bool, small: bool) -> tuple[Callable, Callable]:
    """fla's chunked linear attention (``chunk_linear_attn``, unnormalised as cakeops' op) or,
    ``gated``, its scalar-gated form (``chunk_simple_gla``: a log gate per head and position,
    as the bench's ``log_gates``), in fla's ``(N, L, H, D)`` layout."""
    N, H, L, E, M = SMALL_CAUSAL if small else BENCH_CAUSAL
    gen = torch.Generator().manual_seed(0)
    q, k, v = _rand(gen, N, L, H, E), _rand(gen, N, L, H, E), _rand(gen, N, L, H, M)
    g = (-torch.rand(N, L, H, generator=gen) * 0.1).requires_grad_()
    seed = torch.ones(N, L, H, M, dtype=torch.bfloat16)
    done = {}

    def forward() -> None:
        if gated:
            from fla.ops.simple_gla import chunk_simple_gla

            done["out"] = chunk_simple_gla(q, k, v, g, scale=1.0)[0]
        else:
            from fla.ops.linear_attn import chunk_linear_attn

            done["out"] = chunk_linear_attn(q, k, v, scale=1.0, normalize=False)[0]

    def backward() -> None:
        done["out"].backward(seed)

    return forward, backward


#: each op's fla counterpart at the bench or the small shape, and the bench's tokens x value
#: heads over the small shape's (a chunked kernel's work per chunk and head is fixed)
CALLS = {
    "gated_delta_rule": (lambda small: _delta(False, small), "chunk_gated_delta_rule"),
    "gated_delta_rule, KDA": (lambda small: _delta(True, small), "chunk_kda"),
    "causal_dot_product": (lambda small: _causal(False, small), "chunk_linear_attn"),
    "causal_dot_product, log_gates": (lambda small: _causal(True, small), "chunk_simple_gla"),
}
SCALE = {
    "gated_delta_rule": math.prod(BENCH_DELTA[:2])
    * BENCH_DELTA[3]
    / (math.prod(SMALL_DELTA[:2]) * SMALL_DELTA[3]),
    "causal_dot_product": math.prod(BENCH_CAUSAL[:3]) / math.prod(SMALL_CAUSAL[:3]),
}
SCALE["gated_delta_rule, KDA"] = SCALE["gated_delta_rule"]
SCALE["causal_dot_product, log_gates"] = SCALE["causal_dot_product"]
CHUNKS = {op: BENCH_DELTA[1] // CHUNK if op.startswith("gated") else BENCH_CAUSAL[2] // CHUNK
          for op in CALLS}  # fmt: skip


def _tensor_range(*args):
    """``range`` whose items are int32 scalars of the interpreter, as a compiled loop's are."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    bounds = (int(a.handle.data[0]) if hasattr(a, "handle") else a for a in args)
    for i in range(*bounds):
        yield tl.core.tensor(TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)


@contextlib.contextmanager
def counted_dots() -> Iterator[list[dict]]:
    """Under Triton's interpreter: notes each launch (kernel name) made inside, with its
    ``tl.dot`` FLOPs in bf16-rate units. One config per autotuned kernel, none benchmarked (each
    config makes the same products)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import autotuner, interpreter
    from triton.runtime.interpreter import GridExecutor

    weights = {"tf32": 2.0, "tf32x3": predict.TF32X3,
               "ieee": predict.BF16_RATE / predict.FP32_FMA_RATE}  # fmt: skip
    counted: list[dict] = []
    builder = interpreter.InterpreterBuilder
    saved = (GridExecutor.__call__, builder.create_dot, autotuner.Autotuner.prune_configs,
             autotuner.Autotuner._bench)  # fmt: skip
    original_call, original_dot = saved[:2]

    def call(executor, *args, **kwargs):
        counted.append({"kernel": executor.fn.__name__, "flops": 0.0})
        # fla's loops call .to() on their index, a Python int in the interpreter: the kernel's
        # module sees a range of interpreter scalars while it runs
        names = executor.fn.__globals__
        before = names.get("range")
        names["range"] = _tensor_range
        try:
            return original_call(executor, *args, **kwargs)
        finally:
            if before is None:
                del names["range"]
            else:
                names["range"] = before

    def dot(self, a, b, d, precision, max_imprecise):
        flops = 2 * math.prod(a.data.shape) * b.data.shape[-1]
        if a.dtype.primitive_bitwidth == 32:
            flops *= weights[str(precision).rsplit(".", 1)[-1].lower()]
        counted[-1]["flops"] += flops
        return original_dot(self, a, b, d, precision, max_imprecise)

    def bf16(self, value):  # a bfloat16 scalar (missing from the interpreter): its top 16 bits
        bits = np.array([value], dtype=np.float32).view(np.uint32) >> 16
        return interpreter.TensorHandle(bits.astype(np.uint16), tl.bfloat16)

    had_bf16 = hasattr(builder, "get_bf16")
    if not had_bf16:
        builder.get_bf16 = bf16
    GridExecutor.__call__, builder.create_dot = call, dot
    autotuner.Autotuner.prune_configs = lambda tuner, kwargs: tuner.configs[:1]
    autotuner.Autotuner._bench = lambda tuner, *args, **kwargs: [1.0, 1.0, 1.0]
    try:
        yield counted
    finally:
        (GridExecutor.__call__, builder.create_dot, autotuner.Autotuner.prune_configs,
         autotuner.Autotuner._bench) = saved  # fmt: skip
        if not had_bf16:
            del builder.get_bf16


def count_dots(op: str) -> list[dict]:
    """:func:`counted_dots` of ``op``'s peer forward and backward at the small shape."""
    with counted_dots() as counted:
        forward, backward = CALLS[op][0](True)
        forward()
        backward()
    return counted


def _counts_in_interpreter() -> dict[str, list[dict]]:
    """:func:`count_dots` for every op, in a child process with ``TRITON_INTERPRET=1``."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    argv = [sys.executable, __file__, "--count"]
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def generic(kernel: str, args: dict, flops: float, chunks: int) -> dict:
    """A launch's work by the generic model (the module's docstring)."""

    seen, nbytes = set(), 0
    for value in args.values():
        if isinstance(value, torch.Tensor) and value.numel():
            key = (value.untyped_storage().data_ptr(), value.storage_offset(), value.numel())
            if key not in seen:
                seen.add(key)
                nbytes += value.numel() * value.element_size()
    walk = kernel in WALKS
    return {"bytes": nbytes, "flops": flops, "l2": 0, "chain": chunks if walk else 0,
            "programs": math.prod(args["_grid"]), "per_sm": max(1, 8 // args.get("num_warps", 4)),
            **({"latency": predict.WALK_LATENCY} if walk else {})}  # fmt: skip


def forecast(op: str, counts: list[dict]) -> list[dict]:
    """Each launch of ``op``'s peer at the bench shape, priced as ``predict.predict`` prices
    cakeops' (rows of the same form)."""

    forward, backward = CALLS[op][0](False)
    with predict.Launches() as noted:
        forward()
        noted.state["phase"] = "backward"
        backward()
    launches = [r for r in noted.rows if "args" in r]
    got, want = [r["kernel"] for r in launches], [c["kernel"] for c in counts]
    if got != want:
        raise RuntimeError(f"{op}: the bench shape launched {got}, the small shape {want}")
    rows = []
    for launch, count in zip(launches, counts, strict=True):
        flops = count["flops"] * SCALE[op]
        options = [(predict.seconds(w), w, c["args"]) for c in launch["candidates"]
                   for w in [generic(launch["kernel"], c["args"], flops, CHUNKS[op])]]  # fmt: skip
        (low, high), work, args = min(options, key=lambda o: o[0][0] + o[0][1])
        rows.append({"op": op, "kernel": launch["kernel"], "phase": launch["phase"],
                     "config": predict._config_name(args), "bytes": work["bytes"],
                     "flops": work["flops"], "low": low, "high": high,
                     "conservative": predict.seconds(work, conservative=True)[1]})  # fmt: skip
    for r in noted.rows:
        if "args" not in r:  # the host code's PyTorch ops, as predict.py counts cakeops'
            seconds = r["bytes"] / predict.BANDWIDTH
            rows.append({"op": op, "kernel": "PyTorch ops", "phase": r["phase"], "config": "",
                         "name": r["name"],
                         "bytes": r["bytes"], "flops": 0, "low": seconds, "high": seconds,
                         "conservative": seconds / predict.MEMORY_EFFICIENCY})  # fmt: skip
    return rows


def table(peers: list[dict], own: list[dict]) -> str:
    """The peer's launches (predict.py's table's form), then each op's totals side by side."""

    text = predict.table(peers, summary=False)
    text = text.replace("Forecast for an", "flash-linear-attention's kernels forecast for an", 1)
    lines = [text, "", "| op | cakeops forecast (ms) | conservative | flash-linear-attention "
             "(fla-core " + _fla_version() + ") | conservative | cakeops / fla, conservative |",
             "|---|--:|--:|---|--:|--:|"]  # fmt: skip
    for op, (_, name) in CALLS.items():
        ours = [predict._total(own, op, k) * 1e3 for k in ("low", "high", "conservative")]
        theirs = [predict._total(peers, op, k) * 1e3 for k in ("low", "high", "conservative")]
        lines.append(f"| {op} | {ours[0]:.2f}-{ours[1]:.2f} | {ours[2]:.2f} | `{name}` "
                     f"{theirs[0]:.2f}-{theirs[1]:.2f} | {theirs[2]:.2f} | "
                     f"{ours[2] / theirs[2]:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def _fla_version() -> str:
    from importlib.metadata import version

    return version("fla-core")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", action="store_true", help="(child) count the dots")
    parser.add_argument("--docs", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.count:
        fake_hopper()
        print(json.dumps({op: count_dots(op) for op in CALLS}))
        return

    # cakeops' rows first: predict installs the compile-only recorder (each kernel compiled,
    # none launched), and fake_hopper then answers fla's questions on the same driver
    own = [r for r in predict.predict() if r["op"] in CALLS]
    fake_hopper()
    counts = _counts_in_interpreter()
    peers = [row for op in CALLS for row in forecast(op, counts[op])]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"peers": peers, "cakeops": own}, indent=1))
    text = table(peers, own)
    print(text)
    if args.docs:
        doc = args.docs.read_text()
        head, rest = doc.split(START, 1)
        args.docs.write_text(f"{head}{START}\n{text}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    main()
