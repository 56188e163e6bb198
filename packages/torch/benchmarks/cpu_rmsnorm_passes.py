"""Where the time of ``rmsnorm_silu_gate`` goes on a CPU, pass by pass, against the copy bound.

    python packages/torch/benchmarks/cpu_rmsnorm_passes.py [--rows 8192] [--dim 4096] [--quick]

Prints, for float32 and bfloat16: the forward and the backward of the ``torch`` backend, each
beside the time its bytes take at the measured copy bandwidth, and the cost of what no kernel
can avoid: a fresh output of ``x``'s size (allocated, first touched) against writing one that
already exists; and the arithmetic alone: the backend's compiled forward and backward block
functions run again and again on one block of ``--hot-rows`` rows, outputs included, that stays
in the last-level cache, scaled to the whole tensor (no memory traffic, no page faults, no op
dispatch). Run it again with glibc told to keep freed memory
(``MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296``, or jemalloc/tcmalloc
preloaded) to see the op without the operating system's page faults. ``--quick``: 256 x 256,
small limit probes (CI runs it so that it keeps running).
"""

from __future__ import annotations

import argparse
import functools

import torch

import cakeops
from cakeops.bench.limits import measure_limits
from cakeops.measure import time_it
from cakeops_torch import rmsnorm_silu_gate as kernels
from cakeops_torch._compile import run_compiled

CPU = torch.device("cpu")


def in_cache(dtype: torch.dtype, shape: tuple[int, int], rows: int) -> tuple[float, float]:
    """Seconds of the backend's compiled forward and backward (the graphs the op runs, rows
    dynamic) on one block of ``rows`` rows, repeated while it stays in cache (outputs written
    in place), times ``shape[0] / rows``."""
    x, z, g, y, dx, dz = (torch.randn(rows, shape[1], dtype=dtype) for _ in range(6))
    w = torch.ones(shape[1], dtype=dtype)
    terms = torch.empty(rows, shape[1])
    args = (w, 1e-6, shape[1], True)
    run = functools.partial(run_compiled, kernels.OP)
    fwd = time_it(lambda: run(kernels._fused_forward, y, x, z, *args), CPU, repeats=21)
    bwd = time_it(lambda: run(kernels._fused_backward, dx, dz, terms, g, x, z, *args), CPU, 21)
    return fwd * shape[0] / rows, bwd * shape[0] / rows


def passes(
    dtype: torch.dtype, shape: tuple[int, int], hot_rows: int
) -> list[tuple[str, float, int]]:
    """``(pass, seconds, bytes it moves at least)`` for inputs of ``shape`` and ``dtype``."""
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    z = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = torch.ones(shape[1], dtype=dtype, requires_grad=True)
    g = torch.randn(shape, dtype=dtype)
    size = x.numel() * x.element_size()
    out = torch.empty_like(x)

    def forward():
        with torch.no_grad():
            return cakeops.rmsnorm_silu_gate(x, z, w, 1e-6)

    def step():
        return torch.autograd.grad(cakeops.rmsnorm_silu_gate(x, z, w, 1e-6), (x, z, w), g)

    fwd_s = time_it(forward, CPU, repeats=7)
    step_s = time_it(step, CPU, repeats=7)
    hot_fwd, hot_bwd = in_cache(dtype, shape, hot_rows)
    return [
        ("forward (reads x, z; writes y)", fwd_s, 3 * size),
        ("backward (reads g, x, z; writes dx, dz)", step_s - fwd_s, 5 * size),
        ("forward+backward", step_s, 8 * size),
        ("a fresh output: empty + fill", time_it(lambda: torch.empty_like(x).fill_(1), CPU, 7),
         size),
        ("an existing output: fill", time_it(lambda: out.fill_(1), CPU, 7), size),
        ("forward arithmetic (in cache)", hot_fwd, 3 * size),
        ("backward arithmetic (in cache)", hot_bwd, 5 * size),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--hot-rows", type=int, default=128, help="rows of the in-cache block")
    parser.add_argument("--quick", action="store_true", help="256 x 256, small limit probes")
    args = parser.parse_args()
    if args.quick:
        args.rows = args.dim = 256
        args.hot_rows = 32
    bandwidth = measure_limits(CPU, args.quick)["copy_bytes_per_s"]
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, {torch.get_num_threads()} threads")
    print(f"{'dtype':<9} {'pass':<40} {'ms':>8} {'bound ms':>9} {'of bound':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        for name, seconds, nbytes in passes(dtype, (args.rows, args.dim), args.hot_rows):
            bound = nbytes / bandwidth
            print(
                f"{str(dtype).removeprefix('torch.'):<9} {name:<40} {seconds * 1e3:8.1f} "
                f"{bound * 1e3:9.1f} {bound / seconds:9.0%}"
            )


if __name__ == "__main__":
    main()
