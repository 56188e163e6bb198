"""GPU benchmarks: each op on every installed backend and beside its peers, against the device's
own limits measured in the same run.

``python -m cakeops.bench.gpu [--quick] [--device cuda] [--out DIR] [--budget SECONDS]``
measures the device's copy bandwidth and matrix rates, then times forward+backward of each op
per backend and per peer (eager code, ``torch.compile`` of it, ``torch._grouped_mm``,
flash-linear-attention when it imports). On CUDA each row has three times:

- *kernels*: one step captured in a CUDA graph and replayed (no host work at all), when the op
  can be captured; otherwise the back-to-back time;
- *back to back*: steps queued one after another between two CUDA events, no synchronisation
  between them (what a training loop sees; above *kernels* when the host cannot keep up);
- *host*: the CPU time to queue one step (Python, dispatch, launches).

Every row is written to ``DIR/gpu-rows.jsonl`` as soon as it is measured and ``DIR/gpu.json`` /
``DIR/gpu.md`` are rewritten after each, so a run cut short keeps what it measured; each
Triton row also profiles one step (``DIR/gpu-profile.md``: its launches and busiest kernels). Past
``--budget`` the remaining contenders are listed as not timed: every op's Triton row comes
first (the ops in the order of :data:`ORDER`: rmsnorm, moe, routed, causal), then ``torch``'s,
then the other backends', then the peers, the ``torch.compile`` ones, numba's matrix products
last; a slow contender takes fewer repeats (about :data:`ROW_SECONDS` of timed steps),
numba's matrix-product kernels one timed step (:func:`schedule`). ``--quick`` takes small shapes
and runs on any device (the CPU too: Triton's interpreter, numba's simulator), to check the
script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

import cakeops
from cakeops import registry
from cakeops.bench.limits import NAMES as LIMIT_NAMES
from cakeops.bench.limits import measure_limits
from cakeops.bench.timing import step_of
from cakeops.measure import peak_memory, sync
from cakeops.ops import SPECS

FULL = {
    "causal_conv1d": (4, 8192, 4096, 4),  # (N, C, L, W): Qwen3-Next-80B's q, k and v channels
    "rmsnorm_silu_gate": (32768, 4096),
    "causal_dot_product": (8, 16, 4096, 128, 128),
    "gated_delta_rule": (4, 4096, 16, 32, 128),  # (N, L, H, Hv, D): Qwen3-Next-80B's heads
    "moe_experts": (16384, 2048, 1408, 64, 6),
    "routed_experts": (16384, 2048, 1408, 64, 6),
}
# tiny: on a CPU these run in Triton's interpreter and numba's simulator (a Python call per
# simulated thread), only to check the script itself
QUICK = {
    "causal_conv1d": (1, 16, 20, 4),
    "rmsnorm_silu_gate": (8, 64),
    "causal_dot_product": (1, 2, 32, 16, 16),
    "gated_delta_rule": (1, 20, 1, 2, 16),
    "moe_experts": (8, 16, 16, 4, 2),
    "routed_experts": (8, 16, 16, 4, 2),
}


class GpuCase(NamedTuple):
    """One GPU benchmark case of an op: its inputs, and optionally the useful work of a
    forward+backward (bytes moved or FLOPs) with the device limit it is a fraction of."""

    name: str
    inputs: Any
    work: float = 0.0
    limit: str = "copy_bytes_per_s"


def _backends_for(op: str, inputs) -> list[str]:
    names = []
    for name, backend in registry.backends().items():
        usable = registry.why_unavailable(backend) is None
        usable = usable and not registry.asked(backend, "not_supported_reasons", op, inputs)
        if name != "reference" and usable:
            names.append(name)
    return names


def _cases(op: str, device: torch.device, quick: bool) -> list[GpuCase]:
    """The op's GPU cases: its bench module's ``gpu_cases(device, shape)`` at the shape of
    ``QUICK``/``FULL``, or else the spec's example inputs in bfloat16 (no device-limit column)."""
    shape = (QUICK if quick else FULL).get(op)
    try:
        module = importlib.import_module(f"cakeops.bench.{op}")
    except ModuleNotFoundError:
        module = None
    if shape is not None and hasattr(module, "gpu_cases"):
        return module.gpu_cases(device, shape)
    return [GpuCase("bfloat16", SPECS[op].example(device, torch.bfloat16))]


def _peers(op: str, inputs) -> dict[str, Callable[[], Any] | str]:
    """``label -> forward`` of the op's peers, or ``label -> why not compared``."""
    module = sys.modules.get(f"cakeops.bench.{op}")
    return getattr(module, "gpu_peers", lambda _: {})(inputs)


def time_step(step: Callable[[], Any], device: torch.device, repeats: int) -> dict[str, Any]:
    """Seconds per step: ``back_to_back`` (queued without synchronising), ``host`` (the CPU time
    to queue one) and ``kernels`` (a CUDA graph of one step replayed, or ``None`` with the
    reason in ``graph``). On a CPU the first two are the same wall time and there is no graph."""
    for _ in range(2 if repeats > 1 else 1):  # warm-up: compiles, autotunes, fills caches
        warm = time.perf_counter()
        step()
        sync(device)
        warm = time.perf_counter() - warm
    # a slow contender takes fewer repeats: about ROW_SECONDS of timed steps, at least one
    repeats = max(1, min(repeats, int(ROW_SECONDS / max(warm, 1e-9))))
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        seconds = (time.perf_counter() - start) / repeats
        return {"back_to_back": seconds, "host": seconds, "kernels": None, "graph": "no GPU",
                "repeats": repeats}  # fmt: skip
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_ev.record()
    host0 = time.perf_counter()
    for _ in range(repeats):
        step()
    host = (time.perf_counter() - host0) / repeats
    end_ev.record()
    torch.cuda.synchronize(device)
    result = {"back_to_back": start_ev.elapsed_time(end_ev) / 1e3 / repeats, "host": host,
              "repeats": repeats}  # fmt: skip
    result.update(_graph_time(step, device, repeats))
    return result


#: Kernels (or, on a CPU, operators) listed per profiled row.
PROFILE_TOP = 8


def profile_step(step: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """One step under ``torch.profiler``: ``launches`` (kernels a CUDA step launches; operators
    on a CPU), ``host_ms`` (the step's wall time, profiled), and ``top``, the busiest
    :data:`PROFILE_TOP` kernels by device time (CPU operators by their own time on a CPU) as
    ``[name, calls, ms]``: where a row's time goes, for the run after (a row far from its
    forecast says which kernel or which host ops to look at)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        sync(device)
        host_ms = (time.perf_counter() - start) * 1e3
    totals: dict[str, list[float]] = {}
    if cuda:
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                entry = totals.setdefault(event.name, [0, 0.0])
                entry[0] += 1
                entry[1] += event.time_range.elapsed_us() / 1e3
    else:
        for item in prof.key_averages():
            if item.self_cpu_time_total > 0:
                totals[item.key] = [item.count, item.self_cpu_time_total / 1e3]
    top = sorted(totals.items(), key=lambda kv: -kv[1][1])[:PROFILE_TOP]
    return {"launches": int(sum(n for n, _ in totals.values())), "host_ms": host_ms,
            "top": [[name[:80], int(n), ms] for name, (n, ms) in top]}  # fmt: skip


def profile_summary(record: dict[str, Any]) -> str:
    """The profiled rows (:func:`profile_step`) as markdown, one table per row."""
    lines = [f"Profiles of one step, {record['device']}, torch {record['torch']}", ""]
    for r in record["rows"]:
        if "profile" not in r:
            continue
        prof = r["profile"]
        lines += [f"### {r['op']}, {r['case']}, {r['impl']}", "",
                  f"{prof['launches']} launches, {prof['host_ms']:.3f} ms profiled", "",
                  "| kernel | calls | ms |", "| --- | ---: | ---: |"]  # fmt: skip
        lines += [f"| `{name}` | {n} | {ms:.3f} |" for name, n, ms in prof["top"]]
        lines.append("")
    return "\n".join(lines)


def _graph_time(step: Callable[[], Any], device: torch.device, repeats: int) -> dict[str, Any]:
    """A CUDA graph of one step, replayed ``repeats`` times: the kernels' time alone."""
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()  # the graph's allocations come from its own pool after a warm-up here
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        del graph
        return {"kernels": start.elapsed_time(end) / 1e3 / repeats, "graph": "yes"}
    except Exception as exc:  # an op that synchronises, or a peer that cannot be captured
        torch.cuda.synchronize(device)
        why = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
        return {"kernels": None, "graph": f"not capturable: {type(exc).__name__}: {why}"}


class Recorder:
    """The run's record, rewritten under ``out`` after every row (``None``: printed only)."""

    def __init__(self, out: Path | None, record: dict[str, Any]):
        self.out, self.record = out, record
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "gpu-rows.jsonl").write_text("")

    def add(self, row: dict[str, Any]) -> None:
        self.record["rows"].append(row)
        print(_row_line(row), flush=True)
        if self.out is not None:
            with (self.out / "gpu-rows.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            self.save()

    def save(self) -> None:
        if self.out is not None:
            _add_ratios(self.record["rows"])
            (self.out / "gpu.json").write_text(json.dumps(self.record, indent=2))
            (self.out / "gpu.md").write_text(summary(self.record) + "\n")
            (self.out / "gpu-profile.md").write_text(profile_summary(self.record) + "\n")


#: The order the ops are timed in, what must be shown first: rmsnorm (the plainest target,
#: copy bandwidth), the two expert ops, then causal (the slowest to time).
ORDER = ("rmsnorm_silu_gate", "moe_experts", "routed_experts", "causal_dot_product")
#: The backends of each op in the order they are timed: Triton first (the row a GPU run must
#: show), numba last (its matrix products run on FMA: slow).
BACKEND_ORDER = ("triton", "torch")
#: The backend whose rows are profiled too (:func:`profile_step`): the GPU's default.
PROFILED = "triton"
#: Seconds of timed steps a row aims at: a slow contender takes fewer repeats.
ROW_SECONDS = 1.0
#: Ops whose numba-cuda kernels are matrix products on FMA: one timed step there.
NUMBA_MATMUL = ("causal_dot_product", "moe_experts", "routed_experts")


class Contender(NamedTuple):
    """One row to time: ``fn`` (or why it is not compared) on ``backend`` (None: a peer)."""

    op: str
    case: GpuCase
    inputs: Any
    label: str
    fn: Callable[[], Any] | str
    backend: str | None


def _inputs(op: str, case: GpuCase):
    spec = SPECS[op]
    return spec.inputs(
        **{
            k: v.detach().requires_grad_(k in spec.differentiable)
            if isinstance(v, torch.Tensor)
            else v
            for k, v in case.inputs.items()
        }
    )


def _contenders(op: str, case: GpuCase) -> tuple[list[Contender], list[Contender]]:
    """``(cakeops rows, peers)`` of a case: a row per usable backend; the peers as the op's
    bench module lists them (:func:`schedule` orders them)."""
    spec, inputs = SPECS[op], _inputs(op, case)
    ours = [Contender(op, case, inputs, f"cakeops [{n}]", lambda: spec(**inputs), n)
            for n in _backends_for(op, case.inputs)]  # fmt: skip
    # the peers' own leaves (the same memory): a view a peer keeps of a leaf keeps the leaf's
    # gradient node alive, on the stream it was made on, and a CUDA graph captured on a side
    # stream then fails at that node (cakeops' SSD-scan row on the first H200 run)
    theirs = _inputs(op, case)
    peers = [Contender(op, case, theirs, label, fn, None)
             for label, fn in _peers(op, theirs).items()]  # fmt: skip
    return ours, peers


def schedule(cases: list[tuple[str, GpuCase]]) -> list[Contender]:
    """Every row in the order it is timed: every op's Triton row (the ops in :data:`ORDER`),
    then every op's ``torch`` row, then the other backends', then the peers, the
    ``torch.compile`` ones (minutes of compiling) after them, and numba's matrix-product rows
    (FMA kernels, the slowest and the least telling) last: a run out of time loses those,
    never an op's Triton row."""
    # tiers: Triton, torch, other backends, peers, torch.compile peers, numba's FMA products
    tiers: list[list[Contender]] = [[] for _ in range(len(BACKEND_ORDER) + 4)]
    rank = {n: i for i, n in enumerate(BACKEND_ORDER)}
    for op, case in cases:
        ours, peers = _contenders(op, case)
        for c in ours:
            tiers[-1 if _fma_products(c) else rank.get(c.backend, len(rank))].append(c)
        for c in peers:
            tiers[len(rank) + 1 + ("torch.compile" in c.label)].append(c)
    return [c for tier in tiers for c in tier]


def _fma_products(contender: Contender) -> bool:
    """Whether it is numba's matrix-product kernels: FMA, not tensor cores (seconds a step)."""
    return contender.backend == "numba" and contender.op in NUMBA_MATMUL


def _time_contender(contender: Contender, device, repeats, limits, recorder, deadline,
                    skip: dict[str, str] | None = None) -> None:  # fmt: skip
    op, case, inputs, label, fn, backend = contender
    row: dict[str, Any] = {"op": op, "case": case.name, "impl": label}
    if backend in (skip or {}):
        fn = f"skipped: {skip[backend]}"  # type: ignore[index]
    if isinstance(fn, str):
        recorder.add({**row, "skipped": fn})
        return
    if time.monotonic() > deadline:
        recorder.add({**row, "skipped": "out of time (--budget)"})
        return
    if device.type == "cpu" and _fma_products(contender):
        # the simulator runs every thread's every product in Python: tens of seconds a step
        recorder.add({**row, "skipped": "numba's CUDA simulator: too slow to time (the "
                      "conformance step runs these kernels)"})  # fmt: skip
        return
    try:
        with cakeops.use_backend(backend) if backend else contextlib.nullcontext():
            step = step_of(op, inputs, fn)
            timed = time_step(step, device, 1 if _fma_products(contender) else repeats)
            row.update({f"{k}_s" if k not in ("graph", "repeats") else k: v
                        for k, v in timed.items()})  # fmt: skip
            # on a CPU the profiler it takes would cost more than these tiny steps
            row["peak_bytes"] = peak_memory(step, device) if device.type == "cuda" else None
            if backend == PROFILED:
                row["profile"] = profile_step(step, device)
    except Exception as exc:  # a peer's failure is a row, not the end of the run
        recorder.add({**row, "skipped": f"failed: {type(exc).__name__}: {exc}"[:300]})
        return
    seconds = row["kernels_s"] or row["back_to_back_s"]
    row["time_s"] = seconds
    if case.work:
        row["fraction"] = case.work / seconds / limits[case.limit]
        row["of"] = LIMIT_NAMES[case.limit]
    recorder.add(row)


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        base = next(
            (
                r
                for r in rows
                if (r["op"], r["case"], r["impl"]) == (row["op"], row["case"], "cakeops [torch]")
                and "time_s" in r
            ),
            None,
        )
        ok = base is not None and "time_s" in row
        row["speedup_vs_torch"] = base["time_s"] / row["time_s"] if ok else None


def run(
    device: torch.device,
    quick: bool,
    out: Path | None = None,
    budget_s: float = float("inf"),
    ops: list[str] | None = None,
    skip: dict[str, str] | None = None,
) -> dict[str, Any]:
    deadline = time.monotonic() + budget_s
    record: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shapes": QUICK if quick else FULL,
        "rows": [],
    }
    recorder = Recorder(out, record)
    record["limits"] = measure_limits(device, quick)
    recorder.save()
    print(_limits_line(record), flush=True)
    # a quick run on a CPU may be Triton's interpreter or numba's simulator: one timed step
    repeats = (1 if device.type == "cpu" else 3) if quick else 20
    chosen = ops or list(SPECS)
    ordered = [op for op in ORDER if op in chosen] + [op for op in chosen if op not in ORDER]
    cases = [(op, case) for op in ordered for case in _cases(op, device, quick)]
    for contender in schedule(cases):
        _time_contender(contender, device, repeats, record["limits"], recorder, deadline, skip)
    recorder.save()
    return record


def _limits_line(record: dict[str, Any]) -> str:
    lim = record["limits"]
    return (
        f"device {record['device']}, torch {record['torch']}: copy "
        f"{lim['copy_bytes_per_s'] / 1e9:.0f} GB/s, bf16 matmul "
        f"{lim['bf16_flop_per_s'] / 1e12:.1f} TFLOP/s (measured in this run)"
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _row_line(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"  {r['op']} {r['case']} {r['impl']}: not compared ({r['skipped']})"
    return (
        f"  {r['op']} {r['case']} {r['impl']}: {_ms(r['time_s'])} ms (back to back "
        f"{_ms(r['back_to_back_s'])}, host {_ms(r['host_s'])}, graph {r['graph']})"
    )


def summary(record: dict[str, Any]) -> str:
    lines = [
        _limits_line(record) if "limits" in record else f"device {record['device']}",
        "",
        "| op | case | implementation | kernels (ms) | back to back (ms) | host (ms) "
        "| launches | of the device limit | vs cakeops [torch] | peak (MiB) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    rank = {op: i for i, op in enumerate(ORDER)}
    # grouped by op (and case) for reading, in the order they were timed within each
    cases = list(dict.fromkeys((r["op"], r["case"]) for r in record["rows"]))
    rows = sorted(record["rows"], key=lambda r: (rank.get(r["op"], len(rank)),
                                                 cases.index((r["op"], r["case"]))))  # fmt: skip
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['op']} | {r['case']} | {r['impl']} | not compared: "
                         f"{r['skipped']} | | | | | | |")  # fmt: skip
            continue
        frac = f"{100 * r['fraction']:.0f}% {r['of']}" if "fraction" in r else "-"
        vs = f"{r['speedup_vs_torch']:.2f}x" if r.get("speedup_vs_torch") else "-"
        peak = "-" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**20:.0f}"
        # one step's kernel launches (a CPU's operators), where the row was profiled
        launches = r["profile"]["launches"] if "profile" in r else "-"
        lines.append(
            f"| {r['op']} | {r['case']} | {r['impl']} | {_ms(r['kernels_s'])} | "
            f"{_ms(r['back_to_back_s'])} | {_ms(r['host_s'])} | {launches} | {frac} | {vs} "
            f"| {peak} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cakeops.bench.gpu", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small shapes (any device)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--op", action="append", choices=sorted(SPECS), help="op (repeatable)")
    parser.add_argument("--out", metavar="DIR", type=Path, help="write rows here as they come")
    parser.add_argument("--json", metavar="PATH", help="also write the whole record here")
    parser.add_argument("--budget", type=float, default=float("inf"), metavar="SECONDS",
                        help="time no contender after this many seconds")  # fmt: skip
    parser.add_argument("--skip", action="append", default=[], metavar="BACKEND=WHY",
                        help="list this backend's rows as not compared, and why")  # fmt: skip
    args = parser.parse_args(argv)
    skip = dict(item.split("=", 1) for item in args.skip if "=" in item)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to benchmark", file=sys.stderr)
        return 2
    record = run(device, args.quick, args.out, args.budget, args.op, skip)
    print(summary(record))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
