"""Would a numba CPU kernel for ``rmsnorm_silu_gate`` beat the torch backend? (It does not.)

The issue asks for a CPU kernel only where it wins on the op's benchmark shapes. This script
holds the candidate -- one fused ``njit(parallel, fastmath)`` pass per row for the forward, three
for the backward with the sigmoid kept in a row buffer, ``dweight`` in per-chunk float32 partials
-- and times it against the torch backend's CPU path on the same inputs, float32::

    python packages/numba/benchmarks/cpu_rmsnorm_silu_gate.py [--quick]

It is not part of the wheel: the backend ships no CPU kernel while this prints ratios above 1.
``--quick``: one tiny shape (CI runs it so that it keeps running).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from numba import get_num_threads, njit, prange

from cakeops.measure import alternating_medians
from cakeops_torch import rmsnorm_silu_gate as torch_kernels

ONE = np.float32(1.0)


@njit(parallel=True, fastmath=True)
def forward(x, z, w, y, eps, G, norm_before_gate):
    rows, D = x.shape
    inv_g = ONE / np.float32(G)
    for r in prange(rows):
        for s in range(0, D, G):
            ss = np.float32(0.0)
            for c in range(s, s + G):
                v = x[r, c]
                if not norm_before_gate:
                    v = v * z[r, c] / (ONE + np.exp(-z[r, c]))
                ss += v * v
            rstd = ONE / np.sqrt(ss * inv_g + eps)
            for c in range(s, s + G):
                gate = z[r, c] / (ONE + np.exp(-z[r, c]))
                y[r, c] = x[r, c] * gate * rstd * w[c]


@njit(parallel=True, fastmath=True)
def backward(x, z, w, g, dx, dz, partials, eps, G, norm_before_gate):
    rows, D = x.shape
    chunks = partials.shape[0]
    inv_g = ONE / np.float32(G)
    per = (rows + chunks - 1) // chunks
    for k in prange(chunks):
        sig = np.empty(D, np.float32)
        for r in range(k * per, min(rows, (k + 1) * per)):
            for c in range(D):
                sig[c] = ONE / (ONE + np.exp(-z[r, c]))
            for s in range(0, D, G):
                ss = np.float32(0.0)
                for c in range(s, s + G):
                    v = x[r, c] if norm_before_gate else x[r, c] * z[r, c] * sig[c]
                    ss += v * v
                rstd = ONE / np.sqrt(ss * inv_g + eps)
                dot = np.float32(0.0)
                for c in range(s, s + G):
                    gate = z[r, c] * sig[c]
                    v = x[r, c] if norm_before_gate else x[r, c] * gate
                    gy = g[r, c] * gate if norm_before_gate else g[r, c]
                    dot += gy * w[c] * v * rstd
                mean = dot * inv_g
                for c in range(s, s + G):
                    zv, sg = z[r, c], sig[c]
                    gate = zv * sg
                    dsilu = sg * (ONE + zv * (ONE - sg))
                    v = x[r, c] if norm_before_gate else x[r, c] * gate
                    n = v * rstd
                    gy = g[r, c] * gate if norm_before_gate else g[r, c]
                    partials[k, c] += gy * n
                    dv = rstd * (gy * w[c] - n * mean)
                    if norm_before_gate:
                        dx[r, c] = dv
                        dz[r, c] = g[r, c] * n * w[c] * dsilu
                    else:
                        dx[r, c] = dv * gate
                        dz[r, c] = dv * x[r, c] * dsilu


def compare(rows: int, D: int, eps: float = 1e-6) -> float:
    """Prints and returns numba's time over the torch backend's (forward+backward, gate last)."""
    x, z, g = (torch.randn(rows, D) for _ in range(3))
    w = torch.rand(D) + 0.5
    xn, zn, gn, wn = x.numpy(), z.numpy(), g.numpy(), w.numpy()

    def numba_step():
        y = np.empty_like(xn)
        forward(xn, zn, wn, y, np.float32(eps), D, True)
        dx, dz = np.empty_like(xn), np.empty_like(xn)
        partials = np.zeros((get_num_threads(), D), np.float32)
        backward(xn, zn, wn, gn, dx, dz, partials, np.float32(eps), D, True)
        return y, dx, dz, partials.sum(0)

    def torch_step():
        y = torch_kernels.forward(x, z, w, eps, D, True)
        return y, *torch_kernels.backward(g, x, z, w, eps, D, True)

    for a, b in zip(numba_step(), torch_step(), strict=True):
        assert np.allclose(a, b.numpy(), rtol=1e-4, atol=1e-3)
    seconds = alternating_medians(
        {"numba": numba_step, "torch": torch_step}, torch.device("cpu"), 7, warmup=1
    )
    ms = {name: s * 1e3 for name, s in seconds.items()}
    numba_ms, torch_ms = ms["numba"], ms["torch"]
    ratio = numba_ms / torch_ms
    print(f"rows {rows} x D {D}: numba {numba_ms:.1f} ms, torch backend {torch_ms:.1f} ms, "
          f"numba / torch = {ratio:.2f}")  # fmt: skip
    return ratio


def main() -> None:
    print(f"numba {get_num_threads()} threads, torch {torch.get_num_threads()} threads, float32")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny shape")
    quick = parser.parse_args().quick
    for rows, D in [(64, 128)] if quick else [(8192, 4096), (32768, 128)]:
        compare(rows, D)


if __name__ == "__main__":
    main()
