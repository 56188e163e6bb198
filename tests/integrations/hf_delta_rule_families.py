"""Tiny random configs of every transformers family whose layers call the gated delta rule or
KDA (``chunk_gated_delta_rule``, ``chunk_kda`` and their recurrent forms), for the tests and the
docs' table."""

from __future__ import annotations

import transformers as tf

BASE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "layer_types": ["linear_attention", "full_attention"],
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
GDN = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
       "linear_value_head_dim": 8, "linear_conv_kernel_dim": 2, "head_dim": 8}  # fmt: skip
MOE = {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts": 4,
       "num_experts_per_tok": 2, "intermediate_size": 48}  # fmt: skip
KDA = {"linear_attn_config": {"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 2},
       "intermediate_size": 48, "moe_intermediate_size": 16, "num_local_experts": 4,
       "num_experts_per_tok": 2, "n_shared_experts": 1, "qk_rope_head_dim": 4,
       "qk_nope_head_dim": 4, "v_head_dim": 8, "kv_lora_rank": 8, "q_lora_rank": 8}  # fmt: skip


def _config(name: str, sizes: dict):
    cls = getattr(tf, name, None)
    return None if cls is None else (cls, {**BASE, **sizes})


#: family -> (config class, sizes), or None where the installed transformers lacks it
FAMILIES = {
    "Qwen3-Next": _config("Qwen3NextConfig", {**GDN, **MOE}),
    "Qwen3.5": _config("Qwen3_5TextConfig", {**GDN, "intermediate_size": 48}),
    "Qwen3.5-MoE": _config("Qwen3_5MoeTextConfig", {**GDN, **MOE}),
    "OLMo-Hybrid": _config("OlmoHybridConfig", {**GDN, "intermediate_size": 48}),
    "Lara-Mini": _config("LaraMiniConfig", {**GDN, **MOE}),
    "Qwen4-Exp": _config("Qwen4ExpTextConfig", {**GDN, **MOE}),
    "Kimi-Linear": _config("KimiLinearConfig", KDA),
    "Bailing-Hybrid": _config("BailingHybridConfig", {**KDA, "head_dim": 8}),
    "GLM-5-Next": _config("Glm5NextTextConfig", {**KDA, "head_dim": 8, "num_key_value_heads": 4}),
}

#: families whose layers cakeops serves (the class is patched) but whose tiny model these tests
#: do not build, and why
NOT_BUILT = {
    "qwen4_exp": "its full attention's sparse indexer needs a token budget and a compression "
    "ratio, which its config leaves unset and these tests do not choose",
    "glm5_next": "its text config has no AutoModelForCausalLM mapping (a vision-language model)",
}
#: family -> its transformers module
MODULES = {
    "Qwen3-Next": "qwen3_next", "Qwen3.5": "qwen3_5", "Qwen3.5-MoE": "qwen3_5_moe",
    "OLMo-Hybrid": "olmo_hybrid", "Lara-Mini": "lara_mini", "Qwen4-Exp": "qwen4_exp",
    "Kimi-Linear": "kimi_linear", "Bailing-Hybrid": "bailing_hybrid", "GLM-5-Next": "glm5_next",
}  # fmt: skip
BUILT = [f for f, spec in FAMILIES.items() if spec is not None and MODULES[f] not in NOT_BUILT]
