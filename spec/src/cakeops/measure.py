"""Measuring what a run costs, for the benchmarks and the conformance suite: wall time (one
timer: contenders in alternation, medians), peak memory allocated and the bytes the autograd
graph keeps for the backward."""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternating_medians(
    steps: Mapping[str, Callable[[], Any]],
    device: torch.device,
    repeats: int,
    warmup: int = 0,
    before: Callable[[], Any] | None = None,
) -> dict[str, float]:
    """Median seconds of each step after ``warmup`` untimed calls of each, the timed calls
    alternating between the steps (rounds of one call of each, in a new order each round) so
    that a shared machine's drifting speed slows every step alike and the ratios stay fair;
    ``before``, untimed, before each timed call."""
    times = alternating_times(steps, device, repeats, warmup, before=before)
    return {label: statistics.median(t) for label, t in times.items()}


def alternating_times(
    steps: Mapping[str, Callable[[], Any]],
    device: torch.device,
    repeats: int,
    warmup: int = 0,
    faults: dict[str, list[int]] | None = None,
    before: Callable[[], Any] | None = None,
) -> dict[str, list[float]]:
    """Every timed call's seconds of each step, timed as :func:`alternating_medians` does;
    given ``faults`` (on a CPU whose OS counts them), each timed call's page faults go there;
    ``before``, untimed, before each timed call (what a model runs between two calls of an op,
    say)."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    counter = fault_counter() if faults is not None and device.type == "cpu" else None
    times: dict[str, list[float]] = {label: [] for label in steps}
    order, shuffle = list(steps.items()), random.Random(0).shuffle
    for _ in range(repeats):
        # each round in a new order: what one step leaves behind (caches, freed memory) slows
        # the next, and no step should always follow the same one
        shuffle(order)
        for label, step in order:
            if before is not None:
                before()
            sync(device)
            faulted = counter() if counter else 0
            start = time.perf_counter()
            step()
            sync(device)
            times[label].append(time.perf_counter() - start)
            if counter and faults is not None:  # (counter implies faults; mypy cannot tell)
                faults.setdefault(label, []).append(counter() - faulted)
    return times


def fault_counter() -> Callable[[], int] | None:
    """A function giving the process's minor page faults so far (memory the OS maps in on first
    touch: fresh allocations), or ``None`` where the OS does not count them (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    return lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def spread(times: list[float]) -> float:
    """How far apart the repeats of one step are: ``(slowest - fastest) / median``."""
    return (max(times) - min(times)) / statistics.median(times) if times else 0.0


def time_it(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in seconds, after ``warmup`` calls."""
    return alternating_medians({"fn": fn}, device, repeats, warmup)["fn"]


class SavedTensors:
    """Records every tensor the autograd graph packs while the block runs."""

    def __init__(self) -> None:
        self.packed: list[torch.Tensor] = []

    def __enter__(self) -> SavedTensors:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packed.append(t)
        return t

    def nbytes(self) -> int:
        """Bytes held, each storage counted once."""
        seen = {}
        for t in self.packed:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())


def saved_bytes(forward: Callable[[], Any]) -> int:
    """Bytes of the tensors the autograd graph keeps from ``forward`` for the backward."""
    with SavedTensors() as saved:
        out = forward()
    del out
    return saved.nbytes()


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """The process's stderr (file descriptor 2) sent to the null device: the profiler's C++
    side prints a line there at every start and stop, which would bury a benchmark's output."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def peak_memory(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes allocated while ``fn`` runs, above what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    # Every allocation and free on the CPU is a raw "[memory]" event with its size.
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _stderr_silenced():
        prof.start()
    try:
        fn()
    finally:
        with _stderr_silenced():
            prof.stop()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return peak
