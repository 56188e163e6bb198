"""The numba CPU ``causal_dot_product`` kernels alone, against the float32 matmul rate.

    python packages/numba/benchmarks/cpu_causal_kernels.py

Times the backend's ``forward`` and ``backward`` (the njit kernels and their host code, no
autograd, no op dispatch) at the benchmark shapes, float32 and bfloat16, in alternation, and
prints each step's fraction of the float32 matmul rate measured first (recurrent-form work,
``12 N H L E M`` FLOPs). Beside ``cakeops bench``'s rows for the whole op, this says how much
of a step is the kernels.
"""

from __future__ import annotations

import torch

from cakeops.bench.limits import measure_limits
from cakeops.measure import alternating_medians
from cakeops_numba.cpu import causal_dot_product as kernels

CPU = torch.device("cpu")
SHAPES = ((2, 4, 2048, 64), (1, 8, 8192, 64), (8, 8, 512, 128))


def main() -> None:
    rate = measure_limits(CPU)["float32_flop_per_s"]
    print(f"float32 matmul {rate / 1e9:.0f} GFLOP/s, {torch.get_num_threads()} threads")
    print(f"{'shape':<22} {'dtype':<9} {'forward ms':>10} {'backward ms':>11} {'of rate':>8}")
    for N, H, L, E in SHAPES:
        steps = {}
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, g = (torch.randn(N, H, L, E).to(dtype) for _ in range(4))
            steps[dtype, "forward"] = lambda q=q, k=k, v=v: kernels.forward(q, k, v)
            steps[dtype, "backward"] = lambda q=q, k=k, v=v, g=g: kernels.backward(g, q, k, v)
        times = alternating_medians(steps, CPU, repeats=9)
        for dtype in (torch.float32, torch.bfloat16):
            fwd, bwd = times[dtype, "forward"], times[dtype, "backward"]
            fraction = 12 * N * H * L * E * E / (fwd + bwd) / rate
            print(
                f"N{N} H{H} L{L} E=M={E:<5} {str(dtype).removeprefix('torch.'):<9} "
                f"{fwd * 1e3:10.1f} {bwd * 1e3:11.1f} {fraction:8.0%}"
            )


if __name__ == "__main__":
    main()
