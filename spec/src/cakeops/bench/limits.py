"""The machine's limits, measured in the same run as the benchmarks, and what fraction of them a
contender reaches.

Two limits bound the ops: the **copy bandwidth** (``dst.copy_(src)`` of a tensor far bigger than
the caches; bytes read plus bytes written per second) for the memory-bound ones, and the
**matmul rate** (``a @ a`` of square matrices; ``2 n^3`` FLOPs per product) for the
compute-bound ones, in float32 and bfloat16 (a CPU without native bfloat16 products shows a low
bfloat16 rate; the limit for a bfloat16 contender is then the float32 rate, the faster of the two,
since the kernels may compute in float32).

A benchmark row names its work (:class:`Work`): the bytes an ideal forward+backward moves, or the
FLOPs of its products; ``fraction`` is then the time that work takes at the limit over the row's
time. The counts of each op are written down in the docs' benchmark page.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from cakeops.measure import alternating_times

#: limit key -> what the tables call it
NAMES = {
    "copy_bytes_per_s": "copy bandwidth",
    "float32_flop_per_s": "float32 matmul rate",
    "bf16_flop_per_s": "bf16 matmul rate",
}


class Work(NamedTuple):
    """The work of one forward+backward: ``amount`` bytes (``kind="bytes"``) or FLOPs."""

    kind: str
    amount: float


#: the limits of the run in progress (``cakeops bench`` sets them first), for the printed tables
CURRENT: dict[str, float] = {}


def _fastest(fn: Any, device: torch.device, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls (after one untimed): a limit is the best the
    machine does, and a shared machine's interruptions only ever slow a call down."""
    return min(alternating_times({"fn": fn}, device, repeats, warmup=1)["fn"])


def measure_limits(device: torch.device, quick: bool = False) -> dict[str, float]:
    """Copy bandwidth (bytes/s, read + write) and float32 and bfloat16 matmul rates (FLOP/s) of
    ``device``, measured now (``quick``: small sizes, indicative only), each from its probe's
    fastest call."""
    cpu = device.type == "cpu"
    if quick:
        n, size = 1 << 22, 512
    else:
        n, size = (1 << 26, 2048) if cpu else (1 << 28, 8192)
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = _fastest(lambda: dst.copy_(src), device, repeats=7)
    limits = {"copy_bytes_per_s": 2 * src.nbytes / copy_s}
    for dtype, key in ((torch.float32, "float32_flop_per_s"), (torch.bfloat16, "bf16_flop_per_s")):
        a = torch.randn(size, size, device=device).to(dtype)
        limits[key] = 2 * size**3 / _fastest(lambda a=a: a @ a, device, repeats=5)
    return limits


def limit_key(work: Work, dtype: str) -> str:
    """Which limit bounds ``work`` for inputs of ``dtype``: the copy bandwidth for bytes, the
    matmul rate for FLOPs (bfloat16 inputs: the faster of the bfloat16 and float32 rates)."""
    if work.kind == "bytes":
        return "copy_bytes_per_s"
    return "bf16_flop_per_s" if dtype == "bfloat16" else "float32_flop_per_s"


def fraction(work: Work | None, dtype: str, seconds: float, limits: dict[str, Any] | None = None):
    """``(fraction of the limit, the limit's key)`` for a row that did ``work`` in ``seconds``
    (``limits``: the run's by default); ``(None, None)`` without work or limits."""
    limits = CURRENT if limits is None else limits
    if work is None or not limits:
        return None, None
    key = limit_key(work, dtype)
    rate = limits[key]
    if key == "bf16_flop_per_s":
        rate = max(rate, limits["float32_flop_per_s"])
    return work.amount / rate / seconds, key


def describe(limits: dict[str, Any]) -> str:
    """One line: the limits measured in this run."""
    return (
        f"copy bandwidth {limits['copy_bytes_per_s'] / 1e9:.1f} GB/s, float32 matmul "
        f"{limits['float32_flop_per_s'] / 1e9:.0f} GFLOP/s, bfloat16 matmul "
        f"{limits['bf16_flop_per_s'] / 1e9:.0f} GFLOP/s"
    )
