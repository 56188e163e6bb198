"""Measuring: the contenders of a case timed in alternation, their peak and saved memory, and
the record each case leaves (what the tables and plots read)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from cakeops.bench.limits import Work
from cakeops.bench.tables import format_table
from cakeops.measure import alternating_times, peak_memory, saved_bytes, spread, sync
from cakeops.registry import explain_inputs


def cakeops_rows(fn: Callable[..., Any], backend: str) -> list[tuple[str, Callable[..., Any]]]:
    """The op's rows: on the backend the automatic choice picks, and on ``torch`` beside it when
    that is another one (so a kernel backend is compared with the portable one in the same run).
    """
    rows = [(f"cakeops [{backend}]", fn)]
    if backend != "torch":

        def on_torch(*args, **kwargs):
            from cakeops import use_backend

            with use_backend("torch"):  # the backward follows the forward's choice
                return fn(*args, **kwargs)

        rows.append(("cakeops [torch]", on_torch))
    return rows


def fwd_bwd(fn: Callable[..., Any], leaves, upstream) -> tuple[Callable[[], Any], ...]:
    """``(forward, forward+backward)`` of ``fn(*leaves)``, what :func:`measure` times: the
    backward for ``upstream`` into every leaf."""

    def forward():
        return fn(*leaves)

    def step():
        return torch.autograd.grad(forward(), leaves, upstream)

    return forward, step


def result_row(
    case: str, dtype: torch.dtype | str, backend: str, baseline: str, results,
    work: Work | None = None, **extra,
):  # fmt: skip
    """One case of an op's record: what ``op_markdown`` and ``write_plots`` read; ``work`` (bytes
    moved or FLOPs of a forward+backward) gives each row its fraction of the machine's limit."""
    dtype = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    row = {"case": case, "dtype": dtype, "backend": backend, "baseline": baseline,
           "results": results, **extra}  # fmt: skip
    if work is not None:
        row["work"] = work._asdict()
    return row


def step_of(op: str, inputs, forward: Callable[[], Any]) -> Callable[[], Any]:
    """Forward+backward of ``forward``, gradients for the inputs the spec differentiates (not
    integer ids, for one), against a fixed random incoming gradient."""
    from cakeops.ops import SPECS

    spec = SPECS[op]
    wrt = tuple(inputs[name] for name in spec.differentiable_given(inputs))
    like = spec.output_like(inputs)
    # drawn on the CPU: a device generator left mid-capture by a peer's failed CUDA graph (seen
    # on an H200) refuses every later draw, and would fail every row after it
    cpu = torch.Generator().manual_seed(0)
    g = torch.randn(like.shape, generator=cpu, dtype=torch.float32).to(like.device, like.dtype)

    def step():
        out = forward()
        return torch.autograd.grad(out, wrt, g.view_as(out))

    return step


def example_run(op: str, device: torch.device) -> list[dict[str, Any]]:
    """The benchmark of an op without a module here: the op on the spec's example inputs, on
    the backend the automatic choice picks (and ``torch`` beside it)."""
    from cakeops.ops import SPECS

    spec = SPECS[op]
    inputs = spec.example(device)
    for name in spec.differentiable_given(inputs):
        inputs[name].requires_grad_()
    backend = explain_inputs(op, spec.validate(tuple(inputs.values()))).backend or "torch"
    contenders = {
        label: (fn, step_of(op, inputs, fn))
        for label, fn in cakeops_rows(lambda: spec(**inputs), backend)
    }
    results = measure(contenders, device, repeats=3)
    baseline = f"cakeops [{backend}]"
    print(format_table(f"\n{op} fwd+bwd, example inputs", results, baseline))
    return [result_row("example inputs", "float32", backend, baseline, results)]


def measure(
    contenders: dict[str, tuple[Callable[[], Any], Callable[[], Any]]],
    device: torch.device,
    repeats: int,
    slow_s: float = 3.0,
) -> dict[str, dict[str, float]]:
    """``contenders``: label -> (forward only, forward+backward).

    Timed steps alternate between the contenders (round-robin, median per contender), so that a
    shared machine's drifting speed shifts every contender alike and the ratios stay fair. On a
    CPU the page faults of each timed step are counted too (median per contender): the cost of
    fresh memory from the operating system, which no kernel controls. Peak memory is measured
    after all timing, so the profiler it needs on CPU never overlaps a timed step. A contender
    whose second warm-up step still takes over ``slow_s`` seconds (the first may compile) is
    timed once more, alone (not under the profiler that measures its peak memory: its overhead
    grows with the number of ops, which differs between contenders).
    """
    slow, fast = {}, []
    for label, (_forward, step) in contenders.items():
        # Two warm-up steps (the first may compile or populate caches); a contender is slow
        # when its second step still takes over slow_s.
        for _ in range(2):
            start = time.perf_counter()
            step()
            sync(device)
        if time.perf_counter() - start > slow_s:
            slow[label] = None
        else:
            fast.append(label)
    faults: dict[str, list[int]] = {}
    steps = {label: contenders[label][1] for label in fast}
    times = alternating_times(steps, device, repeats, faults=faults)
    results = {}
    for label, (forward, step) in contenders.items():
        if label in slow:
            start = time.perf_counter()
            step()
            sync(device)
            seconds, repeats_spread = time.perf_counter() - start, 0.0
            peak = peak_memory(step, device)
        else:
            seconds, repeats_spread = statistics.median(times[label]), spread(times[label])
            peak = peak_memory(step, device)
        results[label] = {
            "time_s": seconds,
            "spread": repeats_spread,
            "repeats": len(times.get(label, [])) or 1,
            "peak_bytes": peak,
            "saved_bytes": saved_bytes(forward),
        }
        if label in faults:  # timed steps on a CPU: their median page faults
            results[label]["faults"] = statistics.median_low(faults[label])
    return results
