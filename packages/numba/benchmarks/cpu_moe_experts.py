"""Would a numba CPU kernel for ``moe_experts`` beat the torch backend? (It does not.)

The candidate runs the op's grouped GEMMs as ``njit(parallel)`` loops over the rows sorted by
expert, in tiles of ``TILE`` rows mapped to experts (the layout the GPU kernels use): the
projections against ``nn.Linear``-layout weights as row-by-row dot products (``NT``), the ones
against their transpose as scaled row sums (``NN``), each expert's weight gradient as a fixed-order
sum of outer products. Routing, the SwiGLU's pointwise part, the combine and the dispatch
backward are the spec's helpers, as in the other kernel backends. Timed against the torch
backend's CPU path (MKL/oneDNN matmuls) on the op's benchmark shapes, float32, forward+backward::

    python packages/numba/benchmarks/cpu_moe_experts.py [--quick]

It is not part of the wheel: the backend ships no CPU kernel while this prints ratios above 1.
``--quick``: one tiny shape (CI runs it so that it keeps running).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from numba import njit, prange

from cakeops.helpers import (
    combine,
    dispatch_backward,
    route,
    routing_backward,
    row_tiles,
    row_weights,
    swiglu_backward,
)
from cakeops.measure import alternating_medians
from cakeops_torch import moe_experts as torch_kernels

TILE = 32
FASTMATH = {"reassoc", "contract", "arcp"}


@njit(parallel=True, fastmath=FASTMATH)
def mm_nt(a, src, w, tile_expert, tile_row, ends, out):
    """``out[r] = a[src[r]] @ w[e]^T`` for the rows ``r`` of expert ``e``; ``w`` is (E, N, K)."""
    N = w.shape[1]
    for t in prange(tile_expert.shape[0]):
        e = tile_expert[t]
        r0, r1 = tile_row[t], min(tile_row[t] + TILE, ends[e])
        for n in range(N):
            wn = w[e, n]
            for r in range(r0, r1):
                ar = a[src[r]]
                acc = np.float32(0.0)
                for k in range(wn.shape[0]):
                    acc += ar[k] * wn[k]
                out[r, n] = acc


@njit(parallel=True, fastmath=FASTMATH)
def mm_nn(a, src, w, tile_expert, tile_row, ends, out):
    """``out[r] = a[src[r]] @ w[e]`` for the rows ``r`` of expert ``e``; ``w`` is (E, K, N)."""
    K, N = w.shape[1], w.shape[2]
    for t in prange(tile_expert.shape[0]):
        e = tile_expert[t]
        r0, r1 = tile_row[t], min(tile_row[t] + TILE, ends[e])
        out[r0:r1] = 0.0
        for k in range(K):
            wk = w[e, k]
            for r in range(r0, r1):
                s = a[src[r], k]
                for n in range(N):
                    out[r, n] += s * wk[n]


@njit(parallel=True, fastmath=FASTMATH)
def weight_grad(a, src_a, scale_a, b, src_b, starts, ends, dw):
    """``dw[e] = sum_r (scale_a[r] a[src_a[r]])^T b[src_b[r]]`` over expert ``e``'s rows, in
    row order, ``16`` rows of ``dw[e]`` per parallel job."""
    E, P, Q = dw.shape
    blocks = (P + 15) // 16
    for job in prange(E * blocks):
        e, p0 = job // blocks, (job % blocks) * 16
        p1 = min(P, p0 + 16)
        dw[e, p0:p1] = 0.0
        for r in range(starts[e], ends[e]):
            br = b[src_b[r]]
            for p in range(p0, p1):
                s = a[src_a[r], p] * scale_a[r]
                for q in range(Q):
                    dw[e, p, q] += s * br[q]


def _tables(routing):
    return tuple(t.numpy() for t in row_tiles(routing, TILE))


def forward(x, logits, wg, wu, wd, top_k):
    routing = route(logits, top_k, True, 1.0)
    te, tr, _, ends = _tables(routing)
    rows, F_, D = routing.token.numel(), wg.shape[1], x.shape[1]
    token, ident = routing.token.numpy(), np.arange(rows)
    gate, up = np.empty((rows, F_), np.float32), np.empty((rows, F_), np.float32)
    mm_nt(x.numpy(), token, wg.numpy(), te, tr, ends, gate)
    mm_nt(x.numpy(), token, wu.numpy(), te, tr, ends, up)
    h = torch.nn.functional.silu(torch.from_numpy(gate)).mul_(torch.from_numpy(up)).numpy()
    y = np.empty((rows, D), np.float32)
    mm_nt(h, ident, wd.numpy(), te, tr, ends, y)
    return combine(torch.from_numpy(y), routing)


def backward(g, x, logits, wg, wu, wd, top_k):
    routing = route(logits, top_k, True, 1.0)
    te, tr, starts, ends = _tables(routing)
    rows, (_, F_, D) = routing.token.numel(), wg.shape
    token, ident = routing.token.numpy(), np.arange(rows)
    ones = np.ones(rows, np.float32)
    xn, gn = x.numpy(), g.numpy()
    hg, hu, u = (np.empty((rows, F_), np.float32) for _ in range(3))
    mm_nt(xn, token, wg.numpy(), te, tr, ends, hg)
    mm_nt(xn, token, wu.numpy(), te, tr, ends, hu)
    mm_nn(gn, token, wd.numpy(), te, tr, ends, u)
    h, dweights, dhg, dhu = swiglu_backward(*map(torch.from_numpy, (hg, hu, u)), routing)
    slot_w = row_weights(routing).numpy()
    dw_down, dw_gate, dw_up = (np.empty(w.shape, np.float32) for w in (wd, wg, wu))
    weight_grad(gn, token, slot_w, h.numpy(), ident, starts, ends, dw_down)
    weight_grad(dhg.numpy(), ident, ones, xn, token, starts, ends, dw_gate)
    weight_grad(dhu.numpy(), ident, ones, xn, token, starts, ends, dw_up)
    dx_rows, dx_up = np.empty((rows, D), np.float32), np.empty((rows, D), np.float32)
    mm_nn(dhg.numpy(), ident, wg.numpy(), te, tr, ends, dx_rows)
    mm_nn(dhu.numpy(), ident, wu.numpy(), te, tr, ends, dx_up)
    dx = dispatch_backward(torch.from_numpy(dx_rows + dx_up), routing)
    dlogits = routing_backward(routing, dweights, True, 1.0)
    return dx, dlogits, *map(torch.from_numpy, (dw_gate, dw_up, dw_down))


def compare(T: int, D: int, F_: int, E: int, top_k: int) -> float:
    """Prints and returns numba's time over the torch backend's (forward+backward, float32)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=gen)
    logits = torch.randn(T, E, generator=gen)
    wg, wu = (torch.randn(E, F_, D, generator=gen) * D**-0.5 for _ in range(2))
    wd = torch.randn(E, D, F_, generator=gen) * F_**-0.5
    g = torch.randn(T, D, generator=gen)
    args = (x, logits, wg, wu, wd, top_k)

    def numba_step():
        return forward(*args), *backward(g, *args)

    def torch_step():
        fwd = torch_kernels.forward(x, logits, wg, wu, wd, top_k, True, 1.0)
        grads = torch_kernels.backward(g, x, logits, wg, wu, wd, top_k, True, 1.0)
        return fwd, *grads[:5]  # x, logits and the three weights (the biases are not given)

    for a, b in zip(numba_step(), torch_step(), strict=True):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-3 * float(b.abs().max())), "mismatch"
    seconds = alternating_medians(
        {"numba": numba_step, "torch": torch_step}, torch.device("cpu"), 3, warmup=1
    )
    ms = {name: s * 1e3 for name, s in seconds.items()}
    ratio = ms["numba"] / ms["torch"]
    print(f"T {T} D {D} F {F_} E {E} top {top_k}: numba {ms['numba']:.0f} ms, torch backend "
          f"{ms['torch']:.0f} ms, numba / torch = {ratio:.2f}")  # fmt: skip
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny shape")
    quick = parser.parse_args().quick
    print(f"torch {torch.get_num_threads()} threads, float32, forward+backward")
    for shape in (
        [(64, 32, 64, 4, 2)] if quick else [(4096, 1024, 2816, 8, 2), (4096, 512, 1024, 64, 8)]
    ):
        compare(*shape)


if __name__ == "__main__":
    main()
