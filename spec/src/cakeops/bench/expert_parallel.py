"""Expert parallelism on the CPU: ``cakeops.distributed.routed_experts`` on 2 processes of one
thread each (gloo), each holding half the tokens and half the experts, against
``cakeops.routed_experts`` on 1 process of 2 threads holding everything, and against the
layout before #38 (one row per (token, slot), :func:`_by_slot`); forward+backward at the
``moe_experts`` bench shape and at top-4 of 16 experts::

    python -m cakeops.bench.expert_parallel [--quick] [--markdown PATH]

Reported per configuration: the median step time (the configurations alternate, each timed
``REPEATS`` times), the bytes each rank sends in the exchanges of one step (counted at the
exchanges: token rows, their expert ids and weights out, the results back, and the gradients
of both; the counts' exchange is a few bytes), and the peak memory each rank allocates during a
step beyond its inputs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

#: name -> (T, D, F, E, top_k): the first moe_experts bench case, #38's (top-4 of 16 experts),
#: and the quick one
CASES = {"T4096 D1024 F2816 E8 top2": (4096, 1024, 2816, 8, 2),
         "T4096 D1024 F1408 E16 top4": (4096, 1024, 1408, 16, 4)}  # fmt: skip
QUICK_CASES = {"T512 D128 F256 E16 top4": (512, 128, 256, 16, 4)}
WORLD, REPEATS, QUICK_REPEATS = 2, 5, 3


def problem(T: int, D: int, F: int, E: int, k: int, seed: int = 0):
    """The whole problem (float32): tokens, routing (softmax top-k), experts, a gradient."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    probs = torch.softmax(torch.randn(T, E, generator=g), -1)
    weights, index = torch.topk(probs, k, dim=-1)
    experts = [
        torch.randn(s, generator=g) * s[-1] ** -0.5 for s in ((E, F, D), (E, F, D), (E, D, F))
    ]
    return (
        x,
        index,
        weights / weights.sum(-1, keepdim=True),
        experts,
        torch.randn(T, D, generator=g),
    )


def _step(op, x, index, weights, experts, grad):
    leaves = [t.detach().requires_grad_() for t in (x, weights, *experts)]

    def step():
        out = op(leaves[0], index, leaves[1], *leaves[2:])
        return torch.autograd.grad(out, leaves, grad)

    return step


def _by_slot(x, top_k_index, top_k_weights, w_gate, w_up, w_down, group=None):
    """The layout before #38, kept to compare: one row per kept (token, slot), sent to the rank
    of its expert with its local id and weight, each slot's output back, summed at home."""
    import torch.distributed as dist

    from cakeops import distributed as cd
    from cakeops import routed_experts

    world = dist.get_world_size(group)
    local, (T, k) = w_up.shape[0], top_k_index.shape
    ids = top_k_index.reshape(-1)
    dest = torch.where((ids >= 0) & (ids < local * world), ids // local, world)
    order = torch.sort(dest, stable=True).indices
    counts = torch.bincount(dest, minlength=world + 1)[:world]
    theirs = torch.empty_like(counts)
    dist.all_to_all_single(theirs, counts, group=group)
    split_in, split_out = counts.tolist(), theirs.tolist()
    sent = order[: sum(split_in)]
    rows = cd._exchange(x.index_select(0, sent // k), split_in, split_out, group)
    ids_in = cd._exchange((ids[sent] - dest[sent] * local).unsqueeze(1), split_in, split_out,
                          group)  # fmt: skip
    w_in = cd._exchange(top_k_weights.reshape(-1)[sent].unsqueeze(1), split_in, split_out, group)
    y = routed_experts(rows, ids_in, w_in, w_gate, w_up, w_down)
    back = cd._exchange(y, split_out, split_in, group)
    slots = x.new_zeros((T * k, x.shape[1])).index_copy(0, sent, back)
    return slots.view(T, k, -1).sum(1)


def _counting(sent: list[int], rank: int):
    """Wraps the exchanges of :mod:`cakeops.distributed` to add the bytes leaving ``rank``."""
    from cakeops import distributed as cd

    exchange = cd._all_to_all

    def counted(rows, split_in, split_out, group):
        row_bytes = rows[:1].numel() * rows.element_size()
        sent[0] += (sum(split_in) - split_in[rank]) * row_bytes
        return exchange(rows, split_in, split_out, group)

    cd._all_to_all = counted


def _worker(rank: int, world: int, init: str, out: str, case: tuple, repeats: int, turn: str):
    import torch.distributed as dist

    from cakeops import distributed as cd
    from cakeops.measure import peak_memory

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    T, _, _, E, _ = case
    x, index, weights, experts, grad = problem(*case)
    mine, block = slice(rank * T // world, (rank + 1) * T // world), E // world
    local = [w[rank * block : (rank + 1) * block] for w in experts]
    steps = {name: _step(op, x[mine], index[mine], weights[mine], local, grad[mine])
             for name, op in (("tokens", cd.routed_experts), ("slots", _by_slot))}  # fmt: skip
    sent: dict[str, int] = {}
    counter = [0]
    _counting(counter, rank)
    for name, step in steps.items():  # warm-up, and the bytes of one step
        counter[0] = 0
        step()
        sent[name] = counter[0]
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(repeats):  # the one-process run takes its turn between these
        _wait_for(turn, f"ep {i}", dist)
        for name in list(steps) if i % 2 == 0 else list(steps)[::-1]:
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
        if rank == 0:
            Path(turn).write_text(f"done {i}")
    peak = {name: peak_memory(step, torch.device("cpu")) for name, step in steps.items()}
    torch.save({"times": times, "peak": peak, "sent": sent}, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _wait_for(turn: str, text: str, dist=None) -> None:
    """Wait for the turn file to say ``text`` (in the workers, rank 0 waits and every rank
    then starts together)."""
    if dist is None or dist.get_rank() == 0:
        while Path(turn).read_text() != text:
            time.sleep(0.005)
    if dist is not None:
        dist.barrier()


def run(quick: bool) -> list[dict[str, Any]]:
    """One row per (case, configuration)."""
    import torch.multiprocessing as mp

    from cakeops import routed_experts
    from cakeops.measure import peak_memory

    repeats = QUICK_REPEATS if quick else REPEATS
    rows = []
    for name, case in (QUICK_CASES if quick else CASES).items():
        with tempfile.TemporaryDirectory() as tmp:
            turn, out = os.path.join(tmp, "turn"), os.path.join(tmp, "rank")
            Path(turn).write_text("one")
            threads = torch.get_num_threads()
            torch.set_num_threads(WORLD)
            x, index, weights, experts, grad = problem(*case)
            one = _step(routed_experts, x, index, weights, experts, grad)
            one()
            context = mp.spawn(_worker, args=(WORLD, os.path.join(tmp, "init"), out, case, repeats,
                                              turn), nprocs=WORLD, join=False)  # fmt: skip
            times = []
            for i in range(repeats):
                start = time.perf_counter()
                one()
                times.append(time.perf_counter() - start)
                Path(turn).write_text(f"ep {i}")  # the two processes' turn
                _wait_for(turn, f"done {i}")
            while not context.join(timeout=1):
                pass
            one_peak = peak_memory(one, torch.device("cpu"))
            torch.set_num_threads(threads)
            ranks = [torch.load(f"{out}.{r}") for r in range(WORLD)]
        one_time = statistics.median(times)
        rows.append({"case": name, "config": f"1 process x {WORLD} threads",
                     "time_s": one_time, "sent": 0, "peak": one_peak, "ratio": 1.0})  # fmt: skip
        labels = {"tokens": "a token once per rank", "slots": "a row per slot, before #38"}
        for layout, label in labels.items():
            ep_time = statistics.median(
                max(ts) for ts in zip(*(r["times"][layout] for r in ranks), strict=True)
            )
            rows.append({"case": name, "config": f"{WORLD} processes x 1 thread: {label}",
                         "time_s": ep_time, "sent": max(r["sent"][layout] for r in ranks),
                         "peak": max(r["peak"][layout] for r in ranks),
                         "ratio": one_time / ep_time})  # fmt: skip
    return rows


def markdown(rows: list[dict[str, Any]], quick: bool) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    flag = " --quick" if quick else ""
    head = (
        f"Measured {when} on cpu ({platform.machine()}, {os.cpu_count()} cores, "
        f"{platform.platform()}), torch {torch.__version__}, float32, with "
        f"`python -m cakeops.bench.expert_parallel{flag}`. *time*: median forward+backward "
        f"step (the two configurations alternate); *speed-up*: the one process's time over the "
        f"row's; *sent per rank*: bytes a rank sends in one step's exchanges; *peak per rank*: "
        f"memory a rank allocates during a step beyond its inputs."
    )
    lines = [head, ""]
    for case in dict.fromkeys(r["case"] for r in rows):
        header = (
            "| configuration | time (ms) | speed-up | sent per rank (MiB) | peak per rank (MiB) |"
        )
        lines += [f"**{case}**", "", header, "| --- | ---: | ---: | ---: | ---: |"]
        for r in (r for r in rows if r["case"] == case):
            lines.append(
                f"| {r['config']} | {r['time_s'] * 1e3:.1f} | {r['ratio']:.2f}x | "
                f"{r['sent'] / 2**20:.1f} | {r['peak'] / 2**20:.1f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cakeops.bench.expert_parallel", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="a small shape, 3 repeats")
    parser.add_argument("--markdown", metavar="PATH", help="write the table there")
    args = parser.parse_args(argv)
    rows = run(args.quick)
    text = markdown(rows, args.quick)
    print(text)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text + "\n")
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
