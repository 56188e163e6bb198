"""cakeops inside Hugging Face transformers (``pip install cakeops[transformers]``).

- :func:`register` adds ``"cakeops"`` to transformers' ``ExpertsInterface``: a model built with
  ``experts_implementation="cakeops"`` (``from_pretrained`` or ``from_config``) runs its experts
  modules on :func:`cakeops.routed_experts`, with the model's own routing (softmax top-k, sigmoid
  with an expert bias, grouped top-k: whatever the model computes) and its packed
  ``gate_up_proj`` read as two views, without a copy.
- :func:`apply_cakeops` does that on a built model and also swaps its gated RMSNorms
  (``Qwen3NextRMSNormGated``, ``MambaRMSNormGated``) for :func:`cakeops.rmsnorm_silu_gate`,
  keeping their parameters and state-dict names.

Importing this module registers ``"cakeops"``. Checkpoints are unchanged: no weight is copied or
renamed.
"""

from __future__ import annotations

from typing import Any

import torch

from cakeops.ops.rmsnorm_silu_gate import rmsnorm_silu_gate
from cakeops.ops.routed_experts import routed_experts

NAME = "cakeops"


def experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """An ``ExpertsInterface`` function: the experts module's SwiGLU experts and combine on
    :func:`cakeops.routed_experts`. Refuses layouts it does not implement, with the reason."""
    unsupported = [
        reason
        for reason, present in (
            ("expert biases", getattr(self, "has_bias", False)),
            ("experts without a gate", not getattr(self, "has_gate", True)),
            ("transposed expert weights", getattr(self, "is_transposed", False)),
            ("interleaved gate/up weights", not getattr(self, "is_concatenated", True)),
            ("a norm after each expert", getattr(self, "has_post_expert_norm", False)),
            ("expert parallelism", getattr(self, "_is_expert_parallel", False)),
            ("an activation other than SiLU", not _is_silu(getattr(self, "act_fn", None))),
        )
        if present
    ]
    if unsupported:
        raise NotImplementedError(
            f"experts_implementation='cakeops' does not support {type(self).__name__} with "
            f"{', '.join(unsupported)}; use 'eager' or 'grouped_mm' for this model"
        )
    F = self.down_proj.shape[-1]
    gate_up = self.gate_up_proj
    return routed_experts(
        hidden_states, top_k_index, top_k_weights, gate_up[:, :F], gate_up[:, F:], self.down_proj
    )


def _is_silu(act: Any) -> bool:
    """torch's SiLU or transformers' ``ACT2FN["silu"]`` (a ``SiLUActivation``)."""
    if act is torch.nn.functional.silu or isinstance(act, torch.nn.SiLU):
        return True
    return type(act).__name__ == "SiLUActivation"


def register() -> None:
    """Add ``"cakeops"`` to transformers' ``ExpertsInterface`` (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, experts_forward)


# --------------------------------------------------------------------------------------------
# Gated norms


def _qwen3_next_forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return rmsnorm_silu_gate(hidden_states, gate, self.weight, self.variance_epsilon)


def _mamba_forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None):
    if gate is None:  # a plain grouped RMSNorm: the model's own code
        return type(self).__mro__[1].forward(self, hidden_states)
    return rmsnorm_silu_gate(
        hidden_states,
        gate,
        self.weight,
        self.variance_epsilon,
        group_size=self.group_size,
        norm_before_gate=False,
    )


#: gated-norm class name -> the forward on cakeops (norm before gate: Qwen3-Next; after: Mamba2)
GATED_NORMS = {
    "Qwen3NextRMSNormGated": _qwen3_next_forward,
    "MambaRMSNormGated": _mamba_forward,
}
_patched: dict[type, type] = {}


def _patched_class(cls: type) -> type:
    if cls not in _patched:
        forward = GATED_NORMS[cls.__name__]
        _patched[cls] = type(f"Cakeops{cls.__name__}", (cls,), {"forward": forward})
    return _patched[cls]


def apply_cakeops(model: torch.nn.Module) -> torch.nn.Module:
    """Run ``model``'s experts on cakeops (``experts_implementation="cakeops"``) and its gated
    RMSNorms on :func:`cakeops.rmsnorm_silu_gate`, in place; returns the model. Parameters,
    buffers and state-dict names stay as they are."""
    register()
    if (
        hasattr(model, "set_experts_implementation")
        and getattr(model, "_can_set_experts_implementation", lambda: True)()
    ):
        model.set_experts_implementation(NAME)
    for module in model.modules():
        if type(module).__name__ in GATED_NORMS:
            module.__class__ = _patched_class(type(module))
    return model


register()
