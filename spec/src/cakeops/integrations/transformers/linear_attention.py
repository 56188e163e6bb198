"""MiniMax's lightning attention with its core on :func:`cakeops.causal_dot_product` (a forward
for a subclass of the model's layer; the projections, norm and gate are the model's code)."""

from __future__ import annotations

import torch

from cakeops.integrations.packed_documents import packed_offsets
from cakeops.ops.causal_dot_product import causal_dot_product


def _minimax_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                     cache=None, **kwargs):  # fmt: skip
    """MiniMax's lightning attention with its core (the block loop of a prefill, the per-token
    loop of a decode) as one :func:`cakeops.causal_dot_product`: ``S_t = exp(-slope_h) S_{t-1}
    + k_t v_t^T``, from the cached state when there is one; the rest is the model's own code."""
    from transformers.models.minimax.modeling_minimax import apply_mask_to_padding_states

    cache = cache if cache is not None else kwargs.pop("past_key_values", None)
    N, L, _ = hidden_states.shape
    qkv = self.act_fn(self.qkv_proj(hidden_states))
    qkv = apply_mask_to_padding_states(qkv, attention_mask)
    qkv = qkv.reshape(N, L, self.num_attention_heads, 3 * self.head_dim)
    q, k, v = (t.transpose(1, 2) for t in torch.split(qkv, self.head_dim, dim=3))
    state = cache.get_linear_cache(self.layer_idx) if cache is not None else None
    state = state if isinstance(state, torch.Tensor) else None  # a skipped layer's placeholder
    cu = packed_offsets(hidden_states, kwargs)  # documents packed in one row: kept apart
    if cu is not None and state is not None:  # the cached state is the row's first document's
        state = torch.cat([state, state.new_zeros((cu.numel() - 2, *state.shape[1:]))])
    out, state = causal_dot_product(q, k, v, log_decay=-self.slope_rate.view(-1),
                                    initial_state=state, output_final_state=True,
                                    cu_seqlens=cu)  # fmt: skip
    if cu is not None:  # the row's state: its last document's
        state = state[-1:]
    out = out.transpose(1, 2).reshape(N, L, self.num_attention_heads * self.head_dim)
    out = self.norm(out)
    out = torch.sigmoid(self.output_gate(hidden_states)) * out
    out = self.out_proj(out)
    if cache is not None:
        cache.set_linear_cache(self.layer_idx, state)
    return out, state


#: linear-attention class name -> the forward with its core on cakeops
LINEAR_ATTENTIONS = {"MiniMaxLightningAttention": _minimax_forward}
