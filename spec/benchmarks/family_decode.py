"""A 32-token greedy decode of every transformers family ``apply_cakeops`` patches, with and
without it (#37's goal: no family slower with cakeops), on the CPU in float32.

    python spec/benchmarks/family_decode.py [--quick] [--markdown docs/bench/cpu/family_decode.md]

The families and their models are the tests' (run from a checkout): every family of the docs'
sequence-mixer tables that builds a tiny model (``tests/hf_conv_families.py``, with the delta
rule's), and every family whose experts go through transformers' experts interface and whose
``*ForCausalLM`` builds and runs from a tiny config (``tests/hf_families.py``). Tiny models
(hidden 32 to 64, two layers) are the hardest case for cakeops: a token's time is then mostly
the per-call cost of each layer's ops, which larger models spread over more arithmetic
(``generation.py`` runs four families at hidden 256). Batch 1 and 8, a 9-token prompt; both
models generate the same tokens (checked); medians of the two timed in alternation. A family
that does not build or run is a row saying why. ``--quick``: one family of each table, 4 tokens.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from cakeops.measure import alternating_times

CPU = torch.device("cpu")
TESTS = Path(__file__).resolve().parents[2] / "tests"


def families(quick: bool) -> dict[str, Callable[[], torch.nn.Module]]:
    """family -> its tiny model's builder (seeded): the mixer tables' families first, then the
    experts table's that are not among them."""
    sys.path.insert(0, str(TESTS))
    import hf_conv_families as mixers
    import hf_families as experts

    def mixer(name: str) -> torch.nn.Module:
        import transformers as tf

        config_class, sizes = mixers.FAMILIES[name]
        torch.manual_seed(0)
        return tf.AutoModelForCausalLM.from_config(config_class(**sizes))

    built: dict[str, Callable[[], torch.nn.Module]] = {}
    modules = set()
    for name in mixers.BUILT[:1] if quick else mixers.BUILT:
        built[name] = lambda name=name: mixer(name)
        modules.add(mixers.MODULES[name])
    moe = [f for f in experts.families()
           if f.name not in modules and experts.level(f.name) == "model"]  # fmt: skip
    for fam in moe[:1] if quick else moe:
        built[fam.name] = lambda fam=fam: experts.build_model(fam)
    return built


def measure(quick: bool) -> list[dict[str, Any]]:
    from cakeops.integrations.transformers import apply_cakeops

    new_tokens, repeats = (4, 2) if quick else (32, 7)
    rows = []
    for family, build in families(quick).items():
        try:
            model = build().eval()
            patched = apply_cakeops(copy.deepcopy(model)).eval()
        except Exception as exc:  # a family whose tiny model does not build, or is refused
            rows.append({"family": family, "error": f"{type(exc).__name__}: {exc}"[:160]})
            print(f"{family}: not measured ({rows[-1]['error']})")
            continue
        vocab = min(model.config.vocab_size, 64)
        for batch in (1, 8):
            prompt = torch.randint(3, vocab, (batch, 9), generator=torch.Generator().manual_seed(1))

            def generate(m, prompt=prompt):
                def run():
                    with torch.no_grad():
                        return m.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                                          min_new_tokens=new_tokens)  # fmt: skip

                return run

            same = torch.equal(generate(model)(), generate(patched)())
            times = alternating_times({"transformers": generate(model),
                                       "cakeops": generate(patched)}, CPU, repeats,
                                      warmup=1)  # fmt: skip
            hf, ours = (statistics.median(times[k]) for k in ("transformers", "cakeops"))
            rows.append({"family": family, "batch": batch, "hf_ms": hf * 1e3,
                         "cakeops_ms": ours * 1e3, "same": same})  # fmt: skip
            print(f"{family}, batch {batch}: transformers {hf * 1e3:.1f} ms, cakeops "
                  f"{ours * 1e3:.1f} ms ({hf / ours:.2f}x), same tokens: {same}")  # fmt: skip
    return rows


def markdown(rows: list[dict[str, Any]], quick: bool) -> str:
    command = "python spec/benchmarks/family_decode.py" + (" --quick" if quick else "")
    timed = [r for r in rows if "error" not in r]
    ratios = [r["hf_ms"] / r["cakeops_ms"] for r in timed]
    lines = [
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d} on a CPU ({torch.get_num_threads()} "
        f"threads), float32, torch {torch.__version__}, with `{command}`: greedy decode of the "
        "tests' tiny models after a 9-token prompt, medians of the two models timed in "
        "alternation.",
        "",
    ]
    if ratios:
        slower = sum(r < 1 for r in ratios)
        lines += [f"{len(timed)} rows: speed-up {min(ratios):.2f}x to {max(ratios):.2f}x "
                  f"(median {statistics.median(ratios):.2f}x), {slower} below 1.00x.",
                  ""]  # fmt: skip
    lines += [
        "| family | batch | transformers (ms) | cakeops (ms) | speed-up | same tokens |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | - | - | - | not measured: {r['error']} | - |")
            continue
        lines.append(f"| {r['family']} | {r['batch']} | {r['hf_ms']:.1f} | "
                     f"{r['cakeops_ms']:.1f} | {r['hf_ms'] / r['cakeops_ms']:.2f}x | "
                     f"{'yes' if r['same'] else 'NO'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one family per table, 4 tokens")
    parser.add_argument("--markdown", metavar="PATH", help="write the table there")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("family_decode.py: transformers is not installed (pip install cakeops[transformers])")
        return 2
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    rows = measure(args.quick)
    table = markdown(rows, args.quick)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
