"""Whole-model generation with and without ``apply_cakeops``: greedy decoding of small random
models of the families cakeops serves, at batch 1 and batch 8, on the CPU in float32 (#37's
goal: no slower with cakeops).

    python spec/benchmarks/generation.py [--quick] [--markdown docs/bench/cpu/generation.md]

Each family is built from its transformers config at a small size (hidden 256, two layers of
each kind it has), as ``from_config`` builds it (its default experts implementation) and
patched by ``apply_cakeops``; both generate the same tokens (checked) after a 16-token
prompt. Medians of the two timed in alternation. ``--quick`` runs tiny sizes and few tokens:
CI runs it so that the script keeps working.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from cakeops.bench.hf_layers import time_decode

TOKENS = {"vocab_size": 1024, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _families(hidden: int, head: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """family -> (config class, sizes): what each family runs on cakeops in the docs."""
    attention = {"hidden_size": hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": head, "intermediate_size": 2 * hidden}  # fmt: skip
    experts = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": hidden}
    mamba = {"mamba_n_heads": 8, "mamba_d_head": head, "mamba_n_groups": 1,
             "mamba_d_state": head, "mamba_d_conv": 4, "mamba_expand": 2,
             "mamba_chunk_size": 64}  # fmt: skip
    return {
        # the delta rule, its convolution, the gated norm, the experts
        "Qwen3-Next": ("Qwen3NextConfig", {
            **attention, **experts, "num_hidden_layers": 2, "shared_expert_intermediate_size":
            hidden, "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": head,
            "linear_value_head_dim": head, "linear_conv_kernel_dim": 4}),
        # the convolution and the gated norm (the scan is transformers')
        "Mamba2": ("Mamba2Config", {
            "hidden_size": hidden, "num_hidden_layers": 2, "state_size": head, "num_heads": 8,
            "head_dim": head, "n_groups": 1, "expand": 2, "conv_kernel": 4, "chunk_size": 64}),
        # the convolution, the gated norm and the experts
        "Granite-4.0-hybrid": ("GraniteMoeHybridConfig", {
            **attention, **mamba, "num_hidden_layers": 2, "layer_types": ["mamba", "attention"],
            "num_local_experts": 8, "num_experts_per_tok": 2,
            "shared_intermediate_size": hidden}),
        # the experts
        "Qwen3-MoE": ("Qwen3MoeConfig", {**attention, **experts, "num_hidden_layers": 2}),
    }  # fmt: skip


def _pair(config_name: str, sizes: dict[str, Any]):
    import transformers as tf

    from cakeops.integrations.transformers import apply_cakeops

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(getattr(tf, config_name)(**TOKENS, **sizes))
    model.eval()
    return model, apply_cakeops(copy.deepcopy(model)).eval()


def decode_rows(family: str, model, patched, prompt_of: Callable[[int], torch.Tensor],
                new_tokens: int, repeats: int) -> list[dict[str, Any]]:  # fmt: skip
    """Batch 1 and 8 rows of ``family``: a greedy decode of ``new_tokens`` after
    ``prompt_of(batch)`` by the model and the patched one, medians timed in alternation
    (:func:`cakeops.bench.hf_layers.time_decode`), and whether both generated the same
    tokens."""
    rows = []
    for batch in (1, 8):
        seconds, same = time_decode(model, patched, prompt_of(batch), new_tokens, quick=False,
                                    repeats=repeats)  # fmt: skip
        hf, ours = seconds["Hugging Face model"], seconds["cakeops model"]
        rows.append({"family": family, "batch": batch, "hf_ms": hf * 1e3,
                     "cakeops_ms": ours * 1e3, "same": same})  # fmt: skip
        print(f"{family}, batch {batch}: transformers {hf * 1e3:.1f} ms, cakeops "
              f"{ours * 1e3:.1f} ms ({hf / ours:.2f}x), same tokens: {same}")  # fmt: skip
    return rows


def measure(quick: bool) -> list[dict[str, Any]]:
    hidden, head = (64, 16) if quick else (256, 64)
    new_tokens, repeats = (4, 2) if quick else (32, 7)
    rows = []
    for family, (config_name, sizes) in _families(hidden, head).items():
        model, patched = _pair(config_name, sizes)
        rows += decode_rows(family, model, patched, lambda batch: torch.randint(
            3, 1000, (batch, 16), generator=torch.Generator().manual_seed(1)),
            new_tokens, repeats)  # fmt: skip
    return rows


def markdown(rows: list[dict[str, Any]], command: str, what: str, summary: bool = False) -> str:
    """The rows' table (a row with an ``error`` says why its family is not measured), after a
    line saying when, where and ``what``; with ``summary``, the speed-ups' range first."""
    lines = [
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d} on a CPU ({torch.get_num_threads()} "
        f"threads), float32, torch {torch.__version__}, with `{command}`: {what}, medians of "
        "the two models timed in alternation.",
        "",
    ]
    ratios = [r["hf_ms"] / r["cakeops_ms"] for r in rows if "error" not in r]
    if summary and ratios:
        lines += [f"{len(ratios)} rows: speed-up {min(ratios):.2f}x to {max(ratios):.2f}x "
                  f"(median {statistics.median(ratios):.2f}x), "
                  f"{sum(r < 1 for r in ratios)} below 1.00x.", ""]  # fmt: skip
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


def run_script(argv: list[str] | None, doc: str, quick_help: str,
               table: Callable[[bool], str]) -> int:  # fmt: skip
    """A decode benchmark's command line: ``--quick``, ``--markdown PATH``; ``table(quick)``
    measures and gives the markdown. Exits 2 without transformers."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--markdown", metavar="PATH", help="write the table there")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers is not installed (pip install cakeops[transformers])")
        return 2
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    text = table(args.quick)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
        print(f"wrote {args.markdown}")
    return 0


def main(argv: list[str] | None = None) -> int:
    def table(quick: bool) -> str:
        command = "python spec/benchmarks/generation.py" + (" --quick" if quick else "")
        return markdown(measure(quick), command, "greedy generation after a 16-token prompt")

    return run_script(argv, __doc__, "tiny models, few tokens", table)


if __name__ == "__main__":
    raise SystemExit(main())
