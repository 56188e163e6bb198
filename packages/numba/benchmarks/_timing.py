"""Timing shared by the CPU candidate scripts: both contenders in alternation, medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(contenders: dict[str, Callable[[], object]], repeats: int = 7) -> dict[str, float]:
    """Median milliseconds per contender, after one warm-up each; the timed calls alternate
    between the contenders so that a drifting machine slows them alike."""
    for fn in contenders.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}
