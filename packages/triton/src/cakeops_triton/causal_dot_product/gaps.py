"""A chunk's sums of log multipliers, shared by the scan and the log multipliers' gradients.

Each decay factor is the sum of exactly the steps it spans, never a difference of running sums
(which loses a small gate beside a large one and gives NaN for a gate of -inf): every sum is
<= 0, so a strong decay underflows to zero and nothing overflows.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def two_sum(hi_a, lo_a, hi_b, lo_b):
    """``(hi, lo)`` of ``(hi_a + lo_a) + (hi_b + lo_b)``: ``hi`` the rounded sum of the high
    parts, ``lo`` the low parts plus the error of that rounding (Knuth's TwoSum)."""
    s = hi_a + hi_b
    b = s - hi_a
    err = (hi_a - (s - b)) + (hi_b - b)
    return s, lo_a + lo_b + err


@triton.jit
def floored(lm):
    """Log multipliers with ``-inf`` as ``-1e30`` (both multiply by exactly 0); NaN kept."""
    return tl.where(lm < -1e30, -1e30, lm)


@triton.jit
def chunk_sums(lm_row, pos, end, CHUNK: tl.constexpr):
    """``(hi, lo, tail, last)`` of the chunk at positions ``pos`` (``CHUNK`` of them, those from
    ``end`` on masked): ``hi + lo`` the sums from the chunk's start to each position as pairs
    (``lo`` what rounding ``hi`` lost, so that a difference of two keeps its small steps beside
    a large one), ``tail`` from after each position to the chunk's end, ``last`` the whole
    chunk's. ``-inf`` (a hard reset) counts as ``-1e30``: the same multiplier, and a difference
    of sums then never meets ``-inf - -inf`` (a NaN stays NaN)."""
    t = tl.arange(0, CHUNK)
    pos64 = pos.to(tl.int64)
    lm = floored(tl.load(lm_row + pos64, mask=pos < end, other=0.0))
    hi, lo = tl.associative_scan((lm, tl.zeros_like(lm)), 0, two_sum)
    after = (t + 1 < CHUNK) & (pos + 1 < end)
    tail = tl.cumsum(floored(tl.load(lm_row + pos64 + 1, mask=after, other=0.0)), axis=0,
                     reverse=True)  # fmt: skip
    return hi, lo, tail, tl.sum(lm, axis=0)
