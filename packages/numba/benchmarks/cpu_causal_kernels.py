"""The numba CPU ``causal_dot_product`` kernels alone and inside the op, against the float32
matmul rate.

    python packages/numba/benchmarks/cpu_causal_kernels.py [--quick]

Times, at the benchmark shapes, float32 and bfloat16, in alternation: the backend's ``forward``
and ``backward`` (the njit kernels and their host code: no autograd, no op dispatch), and the
whole op's step as ``cakeops bench`` times it (``torch.autograd.grad`` of
``cakeops.causal_dot_product``). Prints each one's fraction of the float32 matmul rate measured
first (recurrent-form work, ``12 N H L E M`` FLOPs) and the page faults a step of the op takes
(fresh outputs the allocator had to ask the system for), so the gap between the kernels and the
op is seen pass by pass.

``--quick``: one tiny shape, two repeats (CI runs it so that it keeps running).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import cakeops
from cakeops.bench.limits import measure_limits
from cakeops.measure import alternating_times
from cakeops_numba.cpu import causal_dot_product as kernels

CPU = torch.device("cpu")
SHAPES = ((2, 4, 2048, 64), (1, 8, 8192, 64), (8, 8, 512, 128))
QUICK_SHAPES = ((1, 2, 64, 16),)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny shape, two repeats")
    quick = parser.parse_args().quick
    rate = measure_limits(CPU, quick)["float32_flop_per_s"]
    print(f"float32 matmul {rate / 1e9:.0f} GFLOP/s, {torch.get_num_threads()} threads")
    print(
        f"{'shape':<22} {'dtype':<9} {'forward ms':>10} {'backward ms':>11} {'kernels':>8} "
        f"{'op step ms':>10} {'op':>5} {'faults/step':>11}"
    )
    for N, H, L, E in QUICK_SHAPES if quick else SHAPES:
        steps = {}
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, g = (torch.randn(N, H, L, E).to(dtype) for _ in range(4))
            leaves = tuple(t.requires_grad_() for t in (q.clone(), k.clone(), v.clone()))
            steps[dtype, "forward"] = lambda q=q, k=k, v=v: kernels.forward(q, k, v)
            steps[dtype, "backward"] = lambda q=q, k=k, v=v, g=g: kernels.backward(g, q, k, v)
            steps[dtype, "op"] = lambda leaves=leaves, g=g: torch.autograd.grad(
                cakeops.causal_dot_product(*leaves), leaves, g
            )
        faults: dict = {}
        times = alternating_times(steps, CPU, 2 if quick else 9, warmup=1, faults=faults)
        for dtype in (torch.float32, torch.bfloat16):
            fwd, bwd, step = (
                statistics.median(times[dtype, s]) for s in ("forward", "backward", "op")
            )
            flops = 12 * N * H * L * E * E
            per_step = statistics.median_low(faults[dtype, "op"])
            print(
                f"N{N} H{H} L{L} E=M={E:<5} {str(dtype).removeprefix('torch.'):<9} "
                f"{fwd * 1e3:10.1f} {bwd * 1e3:11.1f} {flops / (fwd + bwd) / rate:8.0%} "
                f"{step * 1e3:10.1f} {flops / step / rate:5.0%} {per_step:11d}"
            )


if __name__ == "__main__":
    main()
