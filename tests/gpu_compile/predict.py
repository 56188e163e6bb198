"""A predicted GPU table, without a GPU: each op at the H200 benchmark shapes
(``cakeops.bench.gpu``) runs through the compile-only driver, which notes every Triton launch
the host code makes (its kernel, grid, arguments and the config the launch would use); a model
per kernel gives the bytes it must move and the FLOPs it performs, and a roofline at the
device's limits gives the time. Written as a table into ``docs/content/gpu.md`` beside an empty
"measured" column.

    python tests/gpu_compile/predict.py --docs docs/content/gpu.md

Bytes are the unique bytes a launch reads and writes (tiles re-read by neighbouring programs are
assumed to hit L2); the PyTorch ops of the host code (routing, slot sums, partial sums, casts)
are counted apart, by the bytes of their operands and results.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import triton_check
from shapes import Call, inputs

from cakeops.bench import gpu as bench_gpu

# H200 SXM: HBM3e bandwidth and dense bfloat16 tensor-core rate (datasheet figures).
DEVICE = "H200 SXM (datasheet: 4.8 TB/s HBM3e, 989 TFLOP/s dense bf16)"
BANDWIDTH = 4.8e12
BF16_RATE = 989e12
START, END = "<!-- gpu-predict:start -->", "<!-- gpu-predict:end -->"


def _size(t) -> int:
    return t.element_size() if isinstance(t, torch.Tensor) else 0


def model(kernel: str, a: dict) -> tuple[float, float]:
    """``(bytes, flops)`` of one launch from its arguments (``a``: name -> value, with the
    config's meta-parameters)."""
    if kernel == "_forward_kernel":  # rmsnorm: read x, z, w; write y
        R, D, es = a["R"], a["D"], _size(a["X"])
        return 3 * R * D * es + D * _size(a["W"]), 12 * R * D
    if kernel == "_backward_kernel":  # read g, x, z (row blocks again from L2), w; write dx, dz
        R, D, es = a["R"], a["D"], _size(a["X"])
        partial = 2 * a["PROGRAMS"] * D * 4  # each program's float32 dweight row, read + written
        return 5 * R * D * es + D * _size(a["W"]) + partial, 30 * R * D
    if kernel == "_causal_kernel":
        L, E, M = a["L"], a["E"], a["M"]
        NH, m_blocks = a["_grid"][0], a["_grid"][1]
        es, bl, bm = _size(a["A"]), a["BLOCK_L"], a["BLOCK_M"]
        nbytes = NH * L * (2 * E + 2 * M) * es  # a, b (shared by the column blocks), c, out
        chunks = math.ceil(L / bl)
        per_chunk = 2 * bl * (bl * E + bl * bm + 2 * E * bm)  # scores, scores@v, a@S, S update
        return nbytes, NH * m_blocks * chunks * per_chunk
    if kernel == "_grouped_mm":
        rows, N, K, mode = a["ROWS"], a["N"], a["K"], a["MODE"]
        es = _size(a["A"])
        experts = a["W"].shape[0]
        n_a, n_w, outs = {0: (1, 1, 1), 1: (1, 2, 1), 2: (2, 3, 3), 3: (2, 2, 1)}[mode]
        out_es = _size(a["OUT"])
        nbytes = (
            rows * K * es * n_a + experts * N * K * _size(a["W"]) * n_w + rows * N * out_es * outs
        )
        return nbytes, 2 * rows * N * K * n_w
    if kernel == "_grouped_weight_grad":
        experts = a["_grid"][0]
        P, Q = a["P"], a["Q"]
        rows = a["A"].shape[0] if not a["GATHER_A"] else a["IDX_A"].numel()
        es = max(_size(a["A"]), _size(a["B"]))
        return rows * (P + Q) * es + experts * P * Q * _size(a["DW"]), 2 * rows * P * Q
    if kernel == "_slot_sum_kernel":  # read the float32 slots, write each token's sum
        tokens, D, k = a["_grid"][0], a["D"], a["TOP_K"]
        return tokens * D * (k * 4 + _size(a["OUT"])), tokens * D * k
    raise KeyError(f"no byte/FLOP model for kernel {kernel}")


class HostOps:
    """A dispatch mode noting the bytes each PyTorch op of the host code reads and writes
    (views and allocations move nothing)."""

    FREE = ("empty", "empty_like", "empty_strided", "detach", "lift_fresh", "alias")

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


def launches(call: Call) -> list[dict]:
    """Every Triton launch the op's forward and backward make at ``call``, with its arguments,
    and every PyTorch op of the host code, with its bytes."""
    from triton.runtime import autotuner
    from triton.runtime.jit import JITFunction

    noted: list[dict] = []
    state = {"tuning": False}
    original_run, original_bench = JITFunction.run, autotuner.Autotuner._bench

    def run(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=warmup, **kwargs)
        if not state["tuning"] and not warmup:
            named = dict(zip(self.arg_names, args, strict=False)) | kwargs
            named["_grid"] = grid(named) if callable(grid) else grid
            noted.append({"kernel": self.fn.__name__, "phase": state["phase"], "args": named})
        return kernel

    def bench(self, *args, **kwargs):
        state["tuning"] = True
        try:
            return original_bench(self, *args, **kwargs)
        finally:
            state["tuning"] = False

    JITFunction.run, autotuner.Autotuner._bench = run, bench
    try:
        import importlib

        module = importlib.import_module(f"cakeops_triton.{call.op}")
        fwd, bwd = inputs(call)
        with HostOps(noted, state).mode:
            state["phase"] = "forward"
            module.forward(*fwd)
            state["phase"] = "backward"
            module.backward(*bwd)
    finally:
        JITFunction.run, autotuner.Autotuner._bench = original_run, original_bench
    return noted


def predict() -> list[dict]:
    recorder = triton_check.Recorder()
    recorder.install()
    from triton.runtime.driver import driver

    driver.set_active(triton_check.CompileOnly(90))
    full = bench_gpu.FULL
    shapes = {
        "rmsnorm_silu_gate": (tuple(full["rmsnorm_silu_gate"]), None, True),
        "causal_dot_product": tuple(full["causal_dot_product"]),
        "moe_experts": tuple(full["moe_experts"]),
    }
    calls = {op: Call(op, torch.bfloat16, shape) for op, shape in shapes.items()}
    rows = []
    for op, call in calls.items():
        for launch in launches(call):
            if "args" in launch:
                nbytes, flops = model(launch["kernel"], launch["args"])
            else:
                nbytes, flops = launch["bytes"], 0
            seconds = max(nbytes / BANDWIDTH, flops / BF16_RATE)
            rows.append({"op": op, **{k: launch[k] for k in ("kernel", "phase")},
                         "bytes": nbytes, "flops": flops, "seconds": seconds})  # fmt: skip
    return rows


def targets(rows: list[dict]) -> dict[str, str]:
    """The fraction of each op's H200 target the predicted times imply."""
    full = bench_gpu.FULL
    out = {}
    total = {op: sum(r["seconds"] for r in rows if r["op"] == op) for op in {r["op"] for r in rows}}
    R, D = full["rmsnorm_silu_gate"]
    # the bench counts forward x, z, w -> y and backward g, x, z, w -> dx, dz, dw (bf16)
    minimal = (3 * R * D + 5 * R * D) * 2
    share = minimal / total["rmsnorm_silu_gate"] / BANDWIDTH
    out["rmsnorm_silu_gate"] = f"{share:.0%} of bandwidth (target 80%)"
    out["causal_dot_product"] = "vs flash-linear-attention's chunk kernel: measured on the GPU only"
    T, Dm, F, _, k = full["moe_experts"]
    useful = 2 * T * k * Dm * F * 3 * 3  # forward 3 GEMMs, backward 6 (the bench's count)
    out["moe_experts"] = (
        f"{useful / total['moe_experts'] / BF16_RATE:.0%} of the bf16 rate (target 50%)"
    )
    return out


def table(rows: list[dict]) -> str:
    lines = [
        f"Predicted on {DEVICE}: per launch, the time is max(bytes / bandwidth, FLOPs / rate).",
        "",
        "| op | phase | kernel | launches | GB moved | GFLOP | roofline (ms) | measured (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["phase"], r["kernel"]), []).append(r)
    for (op, phase, kernel), g in sorted(groups.items(), key=lambda kv: kv[0][2].startswith("P")):
        nbytes, flops = sum(r["bytes"] for r in g), sum(r["flops"] for r in g)
        ms = sum(r["seconds"] for r in g) * 1e3
        name = f"`{kernel}`" if kernel.startswith("_") else "PyTorch ops of the host code"
        lines.append(
            f"| {op} | {phase} | {name} | {len(g)} | {nbytes / 1e9:.2f} | {flops / 1e9:.1f} "
            f"| {ms:.3f} | |"
        )
    lines += ["", "| op | roofline total (ms) | implied share of the H200 target | measured |"]
    lines += ["|---|---|---|---|"]
    for op, text in targets(rows).items():
        ms = sum(r["seconds"] for r in rows if r["op"] == op) * 1e3
        lines.append(f"| {op} | {ms:.3f} | {text} | |")
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
