"""Tiny random configs of every transformers family whose layers call the causal convolution
(``causal_conv1d_fn`` / ``causal_conv1d_update``), for the tests and the docs' table: the
Gated DeltaNet and KDA families of ``hf_delta_rule_families``, and the Mamba, Mamba2 and
short-convolution families."""

from __future__ import annotations

import transformers as tf
from hf_delta_rule_families import FAMILIES as DELTA_FAMILIES
from hf_delta_rule_families import MODULES as DELTA_MODULES
from hf_delta_rule_families import NOT_BUILT as DELTA_NOT_BUILT

TOKENS = {"vocab_size": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
          "tie_word_embeddings": False}  # fmt: skip
#: Mamba2's mixer as the hybrids name it: 8 heads of 8, one group, a state of 8, width 4
MAMBA2 = {"mamba_n_heads": 8, "mamba_d_head": 8, "mamba_n_groups": 1, "mamba_d_state": 8,
          "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8}  # fmt: skip
ATTENTION = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 32, "max_position_embeddings": 64}  # fmt: skip


def _config(name: str, sizes: dict):
    cls = getattr(tf, name, None)
    return None if cls is None else (cls, {**TOKENS, **sizes})


#: family -> (config class, sizes), or None where the installed transformers lacks it
FAMILIES = {
    **DELTA_FAMILIES,
    "Mamba": _config("MambaConfig", {"hidden_size": 32, "state_size": 8, "num_hidden_layers": 2,
                                     "expand": 2, "conv_kernel": 4, "time_step_rank": 4}),
    "Falcon-Mamba": _config("FalconMambaConfig", {"hidden_size": 32, "state_size": 8,
                                                  "num_hidden_layers": 2, "expand": 2,
                                                  "conv_kernel": 4, "time_step_rank": 4}),
    "Mamba2": _config("Mamba2Config", {"hidden_size": 32, "state_size": 8, "num_heads": 8,
                                       "head_dim": 8, "expand": 2, "n_groups": 1,
                                       "num_hidden_layers": 2, "conv_kernel": 4,
                                       "chunk_size": 8}),
    "Bamba": _config("BambaConfig", {**ATTENTION, **MAMBA2, "num_hidden_layers": 2,
                                     "attn_layer_indices": [1]}),
    "Granite-4.0-hybrid": _config("GraniteMoeHybridConfig", {
        **ATTENTION, **MAMBA2, "num_hidden_layers": 2, "layer_types": ["mamba", "attention"],
        "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 32}),
    "LFM2": _config("Lfm2Config", {**ATTENTION, "num_hidden_layers": 2,
                                   "layer_types": ["conv", "full_attention"]}),
    "LFM3": _config("Lfm3Config", {**ATTENTION, "num_hidden_layers": 2, "head_dim": 8,
                                   "layer_types": ["conv", "full_attention"]}),
    "LFM2-MoE": _config("Lfm2MoeConfig", {
        **ATTENTION, "num_hidden_layers": 2, "layer_types": ["conv", "full_attention"],
        "num_dense_layers": 1, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16}),
    "Jamba": _config("JambaConfig", {
        **ATTENTION, "num_hidden_layers": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
        "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 4,
        "num_experts_per_tok": 2, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2,
        "mamba_dt_rank": 4, "use_mamba_kernels": False}),
    "Nemotron-H": _config("NemotronHConfig", {
        **ATTENTION, "head_dim": 8, "layers_block_type": ["mamba", "attention"],
        "mamba_num_heads": 8, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 2,
        "conv_kernel": 4, "chunk_size": 8, "use_mamba_kernels": False}),
    "Falcon-H1": _config("FalconH1Config", {
        **ATTENTION, **MAMBA2, "num_hidden_layers": 2, "head_dim": 8, "mamba_d_ssm": 64}),
    "Zamba2": _config("Zamba2Config", {
        **ATTENTION, "num_hidden_layers": 2, "hybrid_layer_ids": [1], "mamba_d_state": 8,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1, "n_mamba_heads": 8,
        "mamba_headdim": 8, "attention_hidden_size": 64, "attention_head_dim": 16,
        "use_mamba_kernels": False, "chunk_size": 8,
        "layers_block_type": ["linear_attention", "hybrid"]}),
    "Zamba": _config("ZambaConfig", {
        **ATTENTION, "num_hidden_layers": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
        "attention_hidden_size": 64, "attention_head_dim": 16, "n_mamba_heads": 2,
        "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 4,
        "use_mamba_kernels": False, "layers_block_type": ["mamba", "hybrid"]}),
    **{name: _config(f"{cls}TextConfig", {
        **ATTENTION, "num_hidden_layers": 2, "head_dim": 8, "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2, "swa_head_dim": 8, "moe_intermediate_size": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "d_rel": 4,
        "rel_extent": 16, "sliding_window_size": 8, "unpadded_vocab_size": 64})
       for name, cls in (("Inkling", "Inkling"), ("Inkling2", "Inkling2"),
                         ("Inkling2-Loop", "Inkling2Loop"))},
}  # fmt: skip

#: families whose layers cakeops serves (the class is patched) but whose tiny model these tests
#: do not build, and why
NOT_BUILT = {
    **DELTA_NOT_BUILT,
    **dict.fromkeys(
        ("inkling2", "inkling2_loop"),
        "apply_cakeops refuses the model: its "
        "experts' softcapped SwiGLU is none of cakeops' expert forms (the "
        "convolution itself is served)",
    ),
}
#: family -> its transformers module
MODULES = {
    **DELTA_MODULES,
    "Mamba": "mamba", "Falcon-Mamba": "falcon_mamba", "Mamba2": "mamba2", "Bamba": "bamba",
    "Granite-4.0-hybrid": "granitemoehybrid", "LFM2": "lfm2", "LFM3": "lfm3",
    "LFM2-MoE": "lfm2_moe", "Jamba": "jamba", "Nemotron-H": "nemotron_h", "Falcon-H1": "falcon_h1",
    "Zamba2": "zamba2", "Zamba": "zamba", "Inkling": "inkling", "Inkling2": "inkling2",
    "Inkling2-Loop": "inkling2_loop",
}  # fmt: skip
BUILT = [f for f, spec in FAMILIES.items() if spec is not None and MODULES[f] not in NOT_BUILT]
