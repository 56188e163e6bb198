"""One experts call of a generation, transformers' against cakeops', on the CPU in float32: the
experts module of a family's tiny model called with the inputs it got inside a greedy decode
(a decode step at batch 1 and 8, the batch-8 prompt's prefill), hot and with caches cold.

    python spec/benchmarks/experts_calls.py [--quick] [--markdown docs/bench/cpu/experts_calls.md]

``family_decode.py`` times whole generations, where an experts call is a few percent of a
token and this machine's noise about as much; this isolates the call. The models are the tests'
(``tests/integrations/hf_families.py``, run from a checkout): the default SwiGLU with a packed
gate/up (Qwen3-MoE), separate gate and up (Mixtral), gpt-oss's form (biases, a clamped SiLU with a
slope, an up offset, gate and up interleaved in one tensor), MiniMax's. Medians of the two
modules timed in alternation; "cold": each call after a matrix product of 32 MiB of weights,
as a model's projections run between two experts calls. ``--quick``: one family, few repeats.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from generation import run_script  # (this script's folder)

from cakeops.measure import alternating_medians

TESTS = Path(__file__).resolve().parents[2] / "tests" / "integrations"
FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "minimax")


def calls(name: str) -> tuple[torch.nn.Module, torch.nn.Module, dict[str, tuple[Any, ...]]]:
    """The family's first experts module, its patched copy, and the inputs the module got in a
    greedy decode: ``case -> (hidden_states, top_k_index, top_k_weights)``."""
    sys.path.insert(0, str(TESTS))
    import hf_families

    from cakeops.integrations.transformers import apply_cakeops

    model = hf_families.build_model(hf_families.family(name)).eval()
    patched = apply_cakeops(copy.deepcopy(model)).eval()

    def first_experts(m: torch.nn.Module) -> torch.nn.Module:
        return next(mod for mod in m.modules() if hasattr(type(mod), "_apply_gate"))

    cases = {}
    for batch in (1, 8):
        seen: list[tuple[Any, ...]] = []
        hook = first_experts(model).register_forward_pre_hook(lambda _, a, s=seen: s.append(a))
        prompt = torch.randint(3, 64, (batch, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        hook.remove()
        cases[f"decode, batch {batch}"] = seen[2]
        if batch == 8:
            cases["prefill, batch 8"] = seen[0]
    return first_experts(model), first_experts(patched), cases


def measure(quick: bool) -> list[dict[str, Any]]:
    repeats, cold_repeats = (20, 5) if quick else (2001, 301)
    weight, row = torch.randn((1 if quick else 8) << 10, 1024), torch.randn(1, 1024)
    rows = []
    for name in FAMILIES[:1] if quick else FAMILIES:
        hf, ours, cases = calls(name)
        for case, args in cases.items():
            steps = {"hf": lambda a=args, m=hf: m(*a), "cakeops": lambda a=args, m=ours: m(*a)}
            with torch.no_grad():
                same = torch.allclose(hf(*args), ours(*args), rtol=1e-4, atol=1e-5)
                hot = alternating_medians(steps, torch.device("cpu"), repeats, warmup=10)
                cold = alternating_medians(steps, torch.device("cpu"), cold_repeats, warmup=3,
                                           before=lambda: F.linear(row, weight))  # fmt: skip
            rows.append({"family": name, "case": case, "rows": args[1].numel(), "same": same,
                         "hot": hot, "cold": cold})  # fmt: skip
            print(f"{name}, {case}: hot {hot['hf'] * 1e6:.0f} / {hot['cakeops'] * 1e6:.0f} us, "
                  f"cold {cold['hf'] * 1e6:.0f} / {cold['cakeops'] * 1e6:.0f} us")  # fmt: skip
    return rows


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    from datetime import datetime, timezone

    lines = [
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d} on a CPU ({torch.get_num_threads()} "
        f"threads), float32, torch {torch.__version__}, with `{command}`: microseconds per "
        "experts call, medians of transformers' module and the patched one timed in "
        "alternation (speed-up: transformers' time over cakeops').",
        "",
        "| family | call | (token, slot) rows | transformers (us) | cakeops (us) | speed-up "
        "| caches cold: transformers (us) | cakeops (us) | speed-up | same output |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        hot, cold = r["hot"], r["cold"]
        lines.append(
            f"| {r['family']} | {r['case']} | {r['rows']} | {hot['hf'] * 1e6:.0f} | "
            f"{hot['cakeops'] * 1e6:.0f} | {hot['hf'] / hot['cakeops']:.2f}x | "
            f"{cold['hf'] * 1e6:.0f} | {cold['cakeops'] * 1e6:.0f} | "
            f"{cold['hf'] / cold['cakeops']:.2f}x | {'yes' if r['same'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    def table(quick: bool) -> str:
        command = "python spec/benchmarks/experts_calls.py" + (" --quick" if quick else "")
        return markdown(measure(quick), command)

    return run_script(argv, __doc__, "one family, few repeats", table)


if __name__ == "__main__":
    raise SystemExit(main())
