"""A 32-token greedy decode of every transformers family ``apply_cakeops`` patches, with and
without it (#37's goal: no family slower with cakeops), on the CPU in float32.

    python spec/benchmarks/family_decode.py [--quick] [--markdown docs/bench/cpu/family_decode.md]

The families and their models are the tests' (run from a checkout): every family of the docs'
sequence-mixer tables that builds a tiny model (``tests/integrations/hf_conv_families.py``,
with the delta rule's), and every family whose experts go through transformers' experts
interface and whose ``*ForCausalLM`` builds and runs from a tiny config
(``tests/integrations/hf_families.py``). Tiny models
(hidden 32 to 64, two layers) are the hardest case for cakeops: a token's time is then mostly
the per-call cost of each layer's ops, which larger models spread over more arithmetic
(``generation.py`` runs four families at hidden 256). Batch 1 and 8, a 9-token prompt; both
models generate the same tokens (checked); medians of the two timed in alternation. A family
that does not build or run is a row saying why. ``--quick``: one family of each table, 4 tokens.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from generation import decode_rows, markdown, run_script  # (this script's folder)

TESTS = Path(__file__).resolve().parents[2] / "tests" / "integrations"


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
        rows += decode_rows(family, model, patched, lambda batch, vocab=vocab: torch.randint(
            3, vocab, (batch, 9), generator=torch.Generator().manual_seed(1)),
            new_tokens, repeats)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    def table(quick: bool) -> str:
        command = "python spec/benchmarks/family_decode.py" + (" --quick" if quick else "")
        what = "greedy decode of the tests' tiny models after a 9-token prompt"
        return markdown(measure(quick), command, what, summary=True)

    return run_script(argv, __doc__, "one family per table, 4 tokens", table)


if __name__ == "__main__":
    raise SystemExit(main())
