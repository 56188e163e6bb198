"""Causal linear attention in Triton, chunked.

One kernel computes ``out_i = sum_{j in causal(i)} (a_i . b_j) c_j`` over chunks of
``BLOCK_L`` positions: within a chunk a masked ``tl.dot`` of scores and values, across chunks one
float32 ``E x BLOCK_M`` state in registers. ``causal(i)`` is ``j <= i`` (forward in time) or
``j >= i`` (``REVERSE``: chunks walked from the end). The forward is ``(q, k, v)``; the backward is
three more runs of the same kernel: ``dq = (g, v, k)`` forward, ``dk = (v, g, q)`` and
``dv = (k, q, g)`` in reverse. Inputs are read through their strides (no copies of transposed
views) and partial tiles are masked, not padded.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cakeops.ops.causal_dot_product import backward_by_scans

INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"
# Chunk length and warps tuned per (E, M, direction, precision) -- never per sequence length.
if INTERPRET:
    _CONFIGS = [triton.Config({"BLOCK_L": 16})]
else:
    _CONFIGS = [
        triton.Config({"BLOCK_L": bl}, num_warps=w, num_stages=st)
        for bl, w, st in ((16, 4, 2), (32, 4, 2), (64, 4, 2), (64, 8, 2), (32, 8, 3))
    ]


@triton.autotune(configs=_CONFIGS, key=["E", "M", "REVERSE", "UPCAST", "PRECISION"])
@triton.heuristics({"BLOCK_M": lambda args: max(16, min(64, triton.next_power_of_2(args["M"])))})
@triton.jit(do_not_specialize=["L"])
def _causal_kernel(
    A, B, C, OUT,
    L, H,
    sa_n, sa_h, sa_l, sb_n, sb_h, sb_l, sc_n, sc_h, sc_l,
    E: tl.constexpr, M: tl.constexpr,
    REVERSE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    pid_nh = tl.program_id(0)
    pid_m = tl.program_id(1)
    n = (pid_nh // H).to(tl.int64)
    h = (pid_nh % H).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = tl.arange(0, BLOCK_L)
    a_base = A + n * sa_n + h * sa_h
    b_base = B + n * sb_n + h * sb_h
    c_base = C + n * sc_n + h * sc_h
    out_base = OUT + (n * H + h) * L * M
    state = tl.zeros((BLOCK_E, BLOCK_M), dtype=tl.float32)
    if REVERSE:
        keep = t[:, None] <= t[None, :]
    else:
        keep = t[:, None] >= t[None, :]
    chunks = tl.cdiv(L, BLOCK_L)
    for i in range(0, chunks):
        if REVERSE:
            start = (chunks - 1 - i) * BLOCK_L
        else:
            start = i * BLOCK_L
        pos = start + t
        pos64 = pos.to(tl.int64)
        ok = pos < L
        ae = ok[:, None] & (e < E)[None, :]
        cm = ok[:, None] & (m < M)[None, :]
        a = tl.load(a_base + pos64[:, None] * sa_l + e[None, :], mask=ae, other=0.0)
        b = tl.load(b_base + pos64[:, None] * sb_l + e[None, :], mask=ae, other=0.0)
        v = tl.load(c_base + pos64[:, None] * sc_l + m[None, :], mask=cm, other=0.0)
        if UPCAST:
            a, b, v = a.to(tl.float32), b.to(tl.float32), v.to(tl.float32)
        scores = tl.dot(a, tl.trans(b), input_precision=PRECISION)
        scores = tl.where(keep, scores, 0.0).to(v.dtype)
        out = tl.dot(scores, v, input_precision=PRECISION)
        out += tl.dot(a.to(tl.float32), state, input_precision=PRECISION)
        tl.store(out_base + pos64[:, None] * M + m[None, :], out.to(OUT.dtype.element_ty), mask=cm)
        state += tl.dot(tl.trans(b), v, input_precision=PRECISION).to(tl.float32)


def _strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous last dim (a copy only when it has none)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _run(a, b, c, reverse: bool) -> torch.Tensor:
    a, b, c = _strides(a), _strides(b), _strides(c)
    N, H, L, E = a.shape
    M = c.shape[-1]
    out = torch.empty((N, H, L, M), dtype=c.dtype, device=c.device)
    interpret = a.device.type == "cpu"
    upcast = interpret or a.dtype == torch.float32
    tf32 = a.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and not interpret
    block_e = max(16, triton.next_power_of_2(E))

    def grid(meta):
        return (N * H, triton.cdiv(M, meta["BLOCK_M"]))

    _causal_kernel[grid](
        a, b, c, out,
        L, H,
        a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
        E=E, M=M, REVERSE=reverse, UPCAST=upcast, PRECISION="tf32" if tf32 else "ieee",
        BLOCK_E=block_e,
    )  # fmt: skip
    return out


def forward(q, k, v):
    return _run(q, k, v, reverse=False)


def backward(g, q, k, v):
    return backward_by_scans(_run, g, q, k, v)
