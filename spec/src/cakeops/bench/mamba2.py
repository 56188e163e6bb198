"""Mamba2 as Hugging Face runs it without mamba-ssm (nor causal-conv1d) and on cakeops
(``apply_cakeops``): the SSD scan alone (transformers' ``mamba_chunk_scan_combined`` fallback
against cakeops' adapter on ``causal_dot_product``), a training step (forward+backward) of one
``Mamba2Mixer``, and a 32-token greedy decode of a two-layer Mamba2 model from its cache.

    python -m cakeops.bench.mamba2 [--quick] [--markdown PATH]

The cakeops side is what ``apply_cakeops`` leaves: the scan, the causal convolution and the
gated norm on cakeops; the mixer's projections and the model's other layers are Hugging Face's
own in both. Timed in alternation in one run, with peak memory.
Needs ``cakeops[transformers]`` (exits with status 2 without it).
"""

from __future__ import annotations

import importlib
from datetime import datetime, timezone
from typing import Any

import torch

from cakeops.bench import hf_layers
from cakeops.bench.hf_layers import on_cakeops
from cakeops.bench.tables import format_table
from cakeops.bench.timing import fwd_bwd, measure

#: (L, hidden, heads, head size, state size, groups): Mamba2-shaped (the issue's)
SHAPE = (4096, 1024, 32, 64, 128, 1)
QUICK_SHAPE = (256, 64, 4, 16, 16, 1)
DECODE_TOKENS = 32
PREFILL = 64


def config(hidden: int, heads: int, head_dim: int, state: int, groups: int, layers: int = 1):
    import transformers as tf

    return tf.Mamba2Config(
        vocab_size=256, hidden_size=hidden, num_hidden_layers=layers, num_heads=heads,
        head_dim=head_dim, expand=heads * head_dim // hidden, state_size=state,
        n_groups=groups, chunk_size=256,
    )  # fmt: skip


def scan_case(L: int, hidden: int, heads: int, head_dim: int, state: int, groups: int,
              quick: bool):  # fmt: skip
    """The SSD scan's forward+backward: transformers' fallback against cakeops' adapter."""
    from cakeops.integrations.transformers.hub_kernels import _hf_mamba_chunk_scan

    module = importlib.import_module("transformers.models.mamba2.modeling_mamba2")
    fallback = module.mamba2_chunk_scan.__wrapped__
    gen = torch.Generator().manual_seed(0)
    leaves = {
        "hidden_states": torch.randn(1, L, heads, head_dim, generator=gen),
        "dt": torch.randn(1, L, heads, generator=gen),
        "A": -torch.arange(1, heads + 1, dtype=torch.float32) / 2,
        "B": torch.randn(1, L, groups, state, generator=gen),
        "C": torch.randn(1, L, groups, state, generator=gen),
        "D": torch.ones(heads),
        "dt_bias": torch.randn(heads, generator=gen) * 0.1,
    }
    leaves = {n: t.requires_grad_() for n, t in leaves.items()}
    g = torch.randn(1, L, heads, head_dim, generator=gen)
    names = list(leaves)

    def call(fn):
        return lambda *values: fn(**dict(zip(names, values, strict=True)), chunk_size=256,
                                  dt_softplus=True)  # fmt: skip

    contenders = {label: fwd_bwd(call(fn), list(leaves.values()), g)
                  for label, fn in (("transformers' fallback", fallback),
                                    ("cakeops", _hf_mamba_chunk_scan))}  # fmt: skip
    results = measure(contenders, torch.device("cpu"), repeats=2 if quick else 5)
    title = (f"\nMamba2's SSD scan, fwd+bwd, L {L}, {heads} heads of {head_dim}, state {state}, "
             f"{groups} group(s)")  # fmt: skip
    print(format_table(title, results, "transformers' fallback"))
    return results


def mixer_case(L: int, hidden: int, heads: int, head_dim: int, state: int, groups: int,
               quick: bool):  # fmt: skip
    """A training step of one ``Mamba2Mixer``, Hugging Face's and on cakeops."""
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    torch.manual_seed(0)
    hf = Mamba2Mixer(config(hidden, heads, head_dim, state, groups), layer_idx=0).train()
    ours = on_cakeops(hf)
    x = torch.randn(1, L, hidden, requires_grad=True)
    g = torch.randn(1, L, hidden)
    contenders = hf_layers.layer_steps({"Hugging Face mixer": hf, "cakeops mixer": ours}, x, g)
    results = measure(contenders, torch.device("cpu"), repeats=2 if quick else 5)
    title = (f"\nMamba2Mixer, fwd+bwd, L {L}, hidden {hidden}, {heads} heads of {head_dim}, "
             f"state {state}")  # fmt: skip
    print(format_table(title, results, "Hugging Face mixer"))
    return results


def decode_case(L: int, hidden: int, heads: int, head_dim: int, state: int, groups: int,
                quick: bool):  # fmt: skip
    """32 greedy tokens of a two-layer Mamba2 model after a prompt, Hugging Face's and on
    cakeops: ``(median seconds per contender, same tokens)``."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = config(hidden, heads, head_dim, state, groups, layers=2)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    patched = on_cakeops(model)
    prompt = torch.randint(0, 256, (1, PREFILL), generator=torch.Generator().manual_seed(1))
    return hf_layers.time_decode(model, patched, prompt, DECODE_TOKENS, quick)


def run(quick: bool = False) -> dict[str, Any]:
    shape = QUICK_SHAPE if quick else SHAPE
    scan = scan_case(*shape, quick)
    mixer = mixer_case(*shape, quick)
    decode_s, same = decode_case(*shape, quick)
    return {"shape": shape, "scan": scan, "mixer": mixer, "decode_s": decode_s,
            "same_tokens": same}  # fmt: skip


def markdown(record: dict[str, Any]) -> str:
    import platform

    import transformers as tf

    L, hidden, heads, head_dim, state, groups = record["shape"]
    where = f"{platform.processor() or 'a CPU'} ({torch.get_num_threads()} threads)"
    lines = [
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d} on {where}, float32, torch "
        f"{torch.__version__}, transformers {tf.__version__}, with "
        "`python -m cakeops.bench.mamba2`: median times, the contenders in alternation; "
        "Hugging Face's runs its PyTorch fallbacks (`mamba_chunk_scan_combined`, "
        "`selective_state_update`, `causal_conv1d_fn` and `causal_conv1d_update`; mamba-ssm and "
        f"causal-conv1d not installed). Shape: L {L}, hidden {hidden}, {heads} heads of "
        f"{head_dim}, state {state}, {groups} group(s).",
        "",
        "| forward+backward | time (ms) | vs Hugging Face | peak (MiB, vs Hugging Face) | "
        "saved (MiB) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for case, base_label in (("scan", "transformers' fallback"), ("mixer", "Hugging Face mixer")):
        r = record[case]
        base = r[base_label]
        what = "SSD scan" if case == "scan" else "Mamba2Mixer"
        for label, x in r.items():
            peak = f"{x['peak_bytes'] / 2**20:.1f} ({x['peak_bytes'] / base['peak_bytes']:.2f}x)"
            lines.append(f"| {what}: {label} | {x['time_s'] * 1e3:.1f} | "
                         f"{base['time_s'] / x['time_s']:.2f}x | {peak} | "
                         f"{x['saved_bytes'] / 2**20:.1f} |")  # fmt: skip
    what = f"greedy decode, {DECODE_TOKENS} tokens after a {PREFILL}-token prompt, two layers"
    lines += hf_layers.decode_table(what, record["decode_s"], record["same_tokens"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return hf_layers.main("cakeops.bench.mamba2", __doc__, run, markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
