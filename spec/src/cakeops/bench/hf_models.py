"""A training step (forward+backward) of small Hugging Face MoE models, per family: the model's
eager experts, transformers' ``grouped_mm`` and cakeops, timed in alternation in one run.

    python -m cakeops.bench.hf_models [--quick] [--device cuda] [--markdown PATH]

Needs ``cakeops[transformers]`` (exits with status 2 and says so without it). Sizes are small
(CPU-friendly), the routing is each model's. On a GPU the models run in bfloat16 (the dtype
``grouped_mm`` takes there), on the CPU in float32.
"""

from __future__ import annotations

import argparse
import copy
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from cakeops.bench.tables import format_table
from cakeops.bench.timing import measure

COMMON = {"vocab_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 1024}  # fmt: skip
#: family -> (transformers config class, sizes): 8 experts, top-2
FAMILIES = {
    "Qwen3-MoE": ("Qwen3MoeConfig", {"hidden_size": 256, "intermediate_size": 512,
                  "moe_intermediate_size": 256, "num_experts": 8, "num_experts_per_tok": 2,
                  "head_dim": 64}),
    "Mixtral": ("MixtralConfig", {"hidden_size": 256, "intermediate_size": 256,
                "num_local_experts": 8, "num_experts_per_tok": 2}),
    "OLMoE": ("OlmoeConfig", {"hidden_size": 256, "intermediate_size": 256, "num_experts": 8,
              "num_experts_per_tok": 2, "eos_token_id": 1, "pad_token_id": 0}),
}  # fmt: skip
IMPLEMENTATIONS = ("eager", "grouped_mm", "cakeops")


#: exit status when transformers is not installed (``nox -s gpu`` reports it and goes on)
NO_TRANSFORMERS = 2


def model_dtype(device: torch.device) -> torch.dtype:
    """float32 on the CPU; bfloat16 on accelerators, where ``grouped_mm`` needs it."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def run(
    quick: bool = False, device: torch.device | str = "cpu", on_row: Any = None
) -> list[dict[str, Any]]:
    """Every family's row; ``on_row(rows)`` is called after each (a run cut short keeps them)."""
    import transformers as tf

    import cakeops.integrations.transformers  # noqa: F401  (registers "cakeops")

    device = torch.device(device)
    dtype = model_dtype(device)
    batch, seq = (1, 64) if quick else (2, 256)
    rows = []
    for family, (config_name, sizes) in FAMILIES.items():
        torch.manual_seed(0)
        config = getattr(tf, config_name)(**COMMON, **sizes)
        base = tf.AutoModelForCausalLM.from_config(config).to(device, dtype)
        ids = torch.randint(0, COMMON["vocab_size"], (batch, seq), device=device)
        contenders = {}
        for impl in IMPLEMENTATIONS:
            model = copy.deepcopy(base)
            model.set_experts_implementation(impl)

            def forward(model=model, ids=ids):
                return model(ids, labels=ids).loss

            def step(forward=forward, model=model):
                model.zero_grad(set_to_none=True)
                forward().backward()

            contenders[f"experts: {impl}"] = (forward, step)
        results = measure(contenders, device, repeats=2 if quick else 5)
        print(format_table(f"\n{family}, batch {batch} x {seq} tokens", results, "experts: eager"))
        rows.append({"family": family, "tokens": batch * seq, "results": results})
        if on_row is not None:
            on_row(rows)
    return rows


def _machine(device: torch.device) -> str:
    import platform

    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, bfloat16"
    return f"{platform.processor() or 'a CPU'} ({torch.get_num_threads()} threads), float32"


def markdown(rows: list[dict[str, Any]], device: torch.device | str = "cpu") -> str:
    import transformers as tf

    device = torch.device(device)
    flag = "" if device.type == "cpu" else f" --device {device.type}"
    lines = [
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d} on {_machine(device)}, torch "
        f"{torch.__version__}, transformers {tf.__version__}, with "
        f"`python -m cakeops.bench.hf_models{flag}`: a training step "
        "(forward+backward) of the whole tiny model, median time, the implementations in "
        "alternation; *peak* is the memory allocated during the step, *saved* what the autograd "
        "graph holds between forward and backward.",
        "",
        "| family | tokens | experts | time (ms) | vs eager | peak (MiB) | saved (MiB) |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        base = row["results"]["experts: eager"]["time_s"]
        for label, r in row["results"].items():
            lines.append(
                f"| {row['family']} | {row['tokens']} | {label.removeprefix('experts: ')} | "
                f"{r['time_s'] * 1e3:.1f} | {base / r['time_s']:.2f}x | "
                f"{r['peak_bytes'] / 2**20:.1f} | {r['saved_bytes'] / 2**20:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cakeops.bench.hf_models", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short sequences")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--markdown", metavar="PATH", help="write the table there")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("cakeops.bench.hf_models: transformers is not installed (pip install "
              "cakeops[transformers]); nothing measured")  # fmt: skip
        return NO_TRANSFORMERS

    def write(rows: list[dict[str, Any]]) -> None:
        if args.markdown:
            Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(args.markdown).write_text(markdown(rows, args.device))

    run(args.quick, args.device, on_row=write)
    if args.markdown:
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
