"""Where does the numba CPU kernel for ``rmsnorm_silu_gate`` beat the torch backend's?

The backend ships the kernel (:mod:`cakeops_numba.cpu.rmsnorm_silu_gate`) as the implicit CPU
choice for inputs of up to ``CPU_NORM_ELEMENTS`` elements, a decode step's: this script times
both backends' kernels, called directly, on the same inputs (float32 unless ``--dtype``), from
one row of a model's width to the benchmark shapes, and says which one implicit selection
takes::

    python packages/numba/benchmarks/cpu_rmsnorm_silu_gate.py [--quick] [--dtype bfloat16]

Medians of the two timed in alternation, forward and forward+backward, numba's time over
torch's. ``--quick``: two tiny shapes (CI runs it so that it keeps running).
"""

from __future__ import annotations

import argparse

import torch

from cakeops.measure import alternating_medians
from cakeops_numba.cpu import rmsnorm_silu_gate as numba_kernels
from cakeops_numba.rmsnorm_silu_gate import CPU_NORM_ELEMENTS
from cakeops_torch import rmsnorm_silu_gate as torch_kernels

EPS = 1e-6


def compare(rows: int, D: int, repeats: int, dtype: torch.dtype) -> None:
    """Prints both kernels' medians at ``(rows, D)`` and numba's over torch's."""
    x, z, g = (torch.randn(rows, D, dtype=dtype) for _ in range(3))
    w = torch.rand(D, dtype=dtype) + 0.5
    options = (EPS, D, True)
    contenders = {}
    for name, kernels in (("numba", numba_kernels), ("torch", torch_kernels)):
        contenders[f"{name} fwd"] = lambda k=kernels: k.forward(x, z, w, *options)
        contenders[f"{name} fwd+bwd"] = lambda k=kernels: (
            k.forward(x, z, w, *options),
            k.backward(g, x, z, w, *options),
        )
    for a, b in zip(
        contenders["numba fwd+bwd"]()[1], contenders["torch fwd+bwd"]()[1], strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-4 if dtype == torch.float32 else 1e-2, atol=1e-4)
    us = {
        k: t * 1e6
        for k, t in alternating_medians(contenders, torch.device("cpu"), repeats, warmup=2).items()
    }
    chosen = "numba" if rows * D <= CPU_NORM_ELEMENTS else "torch"
    print(
        f"| {rows} x {D} | {us['numba fwd']:.0f} | {us['torch fwd']:.0f} | "
        f"{us['numba fwd'] / us['torch fwd']:.2f} | {us['numba fwd+bwd']:.0f} | "
        f"{us['torch fwd+bwd']:.0f} | {us['numba fwd+bwd'] / us['torch fwd+bwd']:.2f} | {chosen} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two tiny shapes")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = parser.parse_args()
    quick, dtype = args.quick, getattr(torch, args.dtype)
    print(f"torch {torch.get_num_threads()} threads, {args.dtype}, microseconds (medians)\n")
    print("| rows x D | numba fwd | torch fwd | ratio | numba fwd+bwd | torch fwd+bwd | ratio "
          "| implicit choice |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    shapes = [(1, 64), (4, 64)] if quick else [
        (1, 1024), (8, 1024), (16, 1024), (32, 1024), (64, 1024), (1, 4096), (4, 4096),
        (8, 4096), (512, 1024), (8192, 4096), (32768, 128),
    ]  # fmt: skip
    for rows, D in shapes:
        compare(rows, D, repeats=5 if quick or rows * D > 1 << 22 else 200, dtype=dtype)


if __name__ == "__main__":
    main()
