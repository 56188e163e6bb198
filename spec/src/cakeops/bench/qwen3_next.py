"""Qwen3-Next's Gated DeltaNet layer (transformers' ``Qwen3NextGatedDeltaNet``) as Hugging Face
runs it without flash-linear-attention (nor causal-conv1d) and on cakeops (``apply_cakeops``):
a training step (forward+backward) of a prefill, and a 32-token greedy decode of a two-layer
model (Gated DeltaNet, then full attention) from its cache.

    python -m cakeops.bench.qwen3_next [--quick] [--markdown PATH]

The cakeops side is what ``apply_cakeops`` leaves: the delta rule, the causal convolution and
the gated norm on cakeops; the layer's projections and the model's other layers are Hugging
Face's own in both. Timed in alternation in one run.
Needs ``cakeops[transformers]`` (exits with status 2 without it).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import torch

from cakeops.bench import hf_layers

#: name -> (L, hidden, key heads, value heads, head size) of the training step's layer
SHAPES = {
    "hidden 1024, 8 key and 16 value heads of 64": (2048, 1024, 8, 16, 64),
    "Qwen3-Next-80B's: hidden 2048, 16 key and 32 value heads of 128": (2048, 2048, 16, 32, 128),
}
QUICK_SHAPES = {"hidden 64, 2 key and 4 value heads of 16": (256, 64, 2, 4, 16)}
DECODE_TOKENS = 32
PREFILL = 64


def config(hidden: int, heads: int, value_heads: int, head_dim: int):
    import transformers as tf

    return tf.Qwen3NextConfig(
        vocab_size=256, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=2, head_dim=head_dim, intermediate_size=2 * hidden,
        linear_num_key_heads=heads, linear_num_value_heads=value_heads,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
        layer_types=["linear_attention", "full_attention"], mlp_only_layers=[0, 1],
    )  # fmt: skip


def train_case(L: int, hidden: int, heads: int, value_heads: int, head_dim: int, quick: bool):
    """A training step of one Gated DeltaNet layer, Hugging Face's and on cakeops."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    torch.manual_seed(0)
    hf = Qwen3NextGatedDeltaNet(config(hidden, heads, value_heads, head_dim), layer_idx=0)
    title = (f"\nQwen3-Next Gated DeltaNet layer, fwd+bwd, L {L}, hidden {hidden}, {heads} key "
             f"and {value_heads} value heads of {head_dim}")  # fmt: skip
    return hf_layers.train_case(hf, L, hidden, 2 if quick else 5, title)


def run(quick: bool = False) -> dict[str, Any]:
    return hf_layers.run(QUICK_SHAPES if quick else SHAPES, train_case, config, quick, PREFILL,
                         DECODE_TOKENS)  # fmt: skip


def markdown(record: dict[str, Any]) -> str:
    import platform

    import transformers as tf

    where = f"{platform.processor() or 'a CPU'} ({torch.get_num_threads()} threads)"
    lines = [
        f"Measured {datetime.now(timezone.utc):%Y-%m-%d} on {where}, float32, torch "
        f"{torch.__version__}, transformers {tf.__version__}, with "
        "`python -m cakeops.bench.qwen3_next`: one `Qwen3NextGatedDeltaNet` layer, median "
        "times, the contenders in alternation; Hugging Face's runs its PyTorch fallbacks "
        "(`torch_chunk_gated_delta_rule` and `causal_conv1d_fn`, flash-linear-attention and "
        "causal-conv1d not installed).",
        "",
        *hf_layers.layer_table(record["layers"]),
    ]
    what = (f"greedy decode, {DECODE_TOKENS} tokens after a {PREFILL}-token prompt, two layers "
            f"({record['decode_shape']})")  # fmt: skip
    lines += hf_layers.decode_table(what, record["decode_s"], record["same_tokens"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return hf_layers.main("cakeops.bench.qwen3_next", __doc__, run, markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
