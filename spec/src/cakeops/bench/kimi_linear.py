"""Kimi Linear's KDA layer (transformers' ``KimiLinearDeltaAttention``) as Hugging Face runs it
without flash-linear-attention and on cakeops (``apply_cakeops``): a training step
(forward+backward) of a prefill, and a 32-token greedy decode of a two-layer model (KDA, then
full attention) from its cache.

    python -m cakeops.bench.kimi_linear [--quick] [--markdown PATH]

The cakeops side is what ``apply_cakeops`` leaves: KDA, the short convolution and the gated
norm on cakeops; the projections, the gate's low-rank projections and the model's other layers
are Hugging Face's own in both. Timed in alternation in one run.
Needs ``cakeops[transformers]`` (exits with status 2 without it).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import torch

from cakeops.bench import hf_layers

#: name -> (L, hidden, heads, head size) of the training step's layer. Hugging Face's KDA keeps
#: the ``C x C x K`` decay factors of every chunk at once (11.5 GB at L 2048 with Kimi
#: Linear's 32 heads of 128): that size runs at L 1024.
SHAPES = {
    "hidden 1024, 8 heads of 64": (2048, 1024, 8, 64),
    "Kimi Linear 48B's: hidden 2304, 32 heads of 128": (1024, 2304, 32, 128),
}
QUICK_SHAPES = {"hidden 64, 2 heads of 16": (256, 64, 2, 16)}
DECODE_TOKENS = 32
PREFILL = 64


def config(hidden: int, heads: int, head_dim: int):
    import transformers as tf

    return tf.KimiLinearConfig(
        vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_size=hidden,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=head_dim, intermediate_size=2 * hidden,
        linear_attn_config={"head_dim": head_dim, "num_heads": heads,
                            "short_conv_kernel_size": 4},
        layer_types=["linear_attention", "full_attention"], num_local_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=hidden // 2, n_shared_experts=1,
        qk_rope_head_dim=head_dim // 2, qk_nope_head_dim=head_dim // 2, v_head_dim=head_dim,
        kv_lora_rank=head_dim, q_lora_rank=None,
    )  # fmt: skip


def train_case(L: int, hidden: int, heads: int, head_dim: int, quick: bool):
    """A training step of one KDA layer, Hugging Face's and on cakeops."""
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    torch.manual_seed(0)
    hf = KimiLinearDeltaAttention(config(hidden, heads, head_dim), layer_idx=0)
    title = f"\nKimi Linear KDA layer, fwd+bwd, L {L}, hidden {hidden}, {heads} heads of {head_dim}"
    return hf_layers.train_case(hf, L, hidden, 2 if quick else 3, title)


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
        "`python -m cakeops.bench.kimi_linear`: one `KimiLinearDeltaAttention` layer, median "
        "times, the contenders in alternation; Hugging Face's runs its PyTorch fallbacks "
        "(`chunk_kimi_delta_attention` and its short convolution; flash-linear-attention not "
        "installed).",
        "",
        *hf_layers.layer_table(record["layers"]),
    ]
    what = (f"greedy decode, {DECODE_TOKENS} tokens after a {PREFILL}-token prompt, two layers "
            f"({record['decode_shape']})")  # fmt: skip
    lines += hf_layers.decode_table(what, record["decode_s"], record["same_tokens"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return hf_layers.main("cakeops.bench.kimi_linear", __doc__, run, markdown, argv)


if __name__ == "__main__":
    raise SystemExit(main())
