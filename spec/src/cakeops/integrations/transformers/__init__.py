"""cakeops inside Hugging Face transformers (``pip install cakeops[transformers]``).

- :func:`register` adds ``"cakeops"`` to transformers' ``ExpertsInterface``: a model built with
  ``experts_implementation="cakeops"`` (``from_pretrained`` or ``from_config``) runs its experts
  modules on :func:`cakeops.routed_experts`, with the model's own routing (softmax top-k, sigmoid
  with an expert bias, grouped top-k: whatever the model computes) and its packed
  ``gate_up_proj`` read as two views, without a copy.
- :func:`apply_cakeops` does that on a built model and also swaps its gated RMSNorms
  (Qwen3-Next's, Mamba2's and their copies: :data:`GATED_NORMS`) for
  :func:`cakeops.rmsnorm_silu_gate`,
  keeping their parameters and state-dict names, MiniMax's lightning attention's core for
  :func:`cakeops.causal_dot_product`, and the gated delta rule and KDA of every layer that calls
  transformers' ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` /
  ``chunk_kda`` / ``fused_recurrent_kda`` (Qwen3-Next, Qwen3.5, OLMo-Hybrid, Kimi Linear, ...)
  for :func:`cakeops.gated_delta_rule`, and the causal convolutions of every layer that calls
  ``causal_conv1d_fn`` / ``causal_conv1d_update`` (those families, the Mamba and Mamba2
  families, LFM2, ...) for :func:`cakeops.causal_conv1d`, packed sequences included.

The modules, one idea each: :mod:`.experts` (the experts' options, forward and EP),
:mod:`.norms` (the gated norms), :mod:`.linear_attention` (MiniMax's), :mod:`.hub_kernels`
(the adapters for the hub kernels the layers call) and :mod:`.rebinding` (how a layer's forward
comes to call them).

Importing this module registers ``"cakeops"``. Checkpoints are unchanged: no weight is copied or
renamed.
"""

from __future__ import annotations

import functools

import torch

from cakeops.integrations.packed_documents import keep_documents_apart
from cakeops.integrations.transformers.experts import (
    NAME,
    Unsupported,
    _registered_name,  # noqa: F401  (pickles of models saved by earlier versions name it here)
    experts_forward,
    experts_options,
    mark_configs,
    register_ep_implementation,
)
from cakeops.integrations.transformers.norms import GATED_NORMS, NOT_SERVED_NORMS
from cakeops.integrations.transformers.rebinding import (
    PATCHED,
    _new_patched,  # noqa: F401  (pickles of models saved by earlier versions name it here)
    swap_class,
)

__all__ = ["GATED_NORMS", "NAME", "NOT_SERVED_NORMS", "PATCHED", "Unsupported", "apply_cakeops",
           "check_model", "experts_forward", "experts_options", "register"]  # fmt: skip


def check_model(model: torch.nn.Module) -> None:
    """Raise :class:`Unsupported` if an experts module of ``model`` cannot run on cakeops
    (each class named once, with its reasons): the refusal comes when the model is built."""
    problems: dict[str, str] = {}
    for module in model.modules():
        if hasattr(module, "has_gate") and hasattr(module, "down_proj"):
            try:
                experts_options(module)
            except Unsupported as exc:
                problems.setdefault(type(module).__name__, str(exc))
    if problems:
        raise Unsupported("\n".join(problems.values()))


def register() -> None:
    """Add ``"cakeops"`` to transformers' ``ExpertsInterface`` and have a model built with it
    (``from_config``/``from_pretrained(..., experts_implementation="cakeops")``) check its
    experts at the end of its construction, and ``set_experts_implementation("cakeops")``
    before it switches: each experts module's options are then found eagerly, never inside a
    ``torch.compile`` trace (idempotent)."""
    from transformers import PreTrainedModel
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, experts_forward)
    register_ep_implementation()
    post_init = PreTrainedModel.post_init
    if getattr(post_init, "_cakeops_checks", False):
        return

    @functools.wraps(post_init)
    def post_init_then_check(self, *args, **kwargs):
        result = post_init(self, *args, **kwargs)
        if getattr(self.config, "_experts_implementation", None) == NAME:
            check_model(self)
            mark_configs(self)
        return result

    post_init_then_check._cakeops_checks = True  # type: ignore[attr-defined]
    PreTrainedModel.post_init = post_init_then_check
    set_implementation = PreTrainedModel.set_experts_implementation

    @functools.wraps(set_implementation)
    def check_then_set(self, experts_implementation, *args, **kwargs):
        named = experts_implementation
        if NAME in (named.values() if isinstance(named, dict) else (named,)):
            check_model(self)  # refused before anything changes; the options found eagerly
        result = set_implementation(self, experts_implementation, *args, **kwargs)
        mark_configs(self)
        return result

    PreTrainedModel.set_experts_implementation = check_then_set


def apply_cakeops(model: torch.nn.Module) -> torch.nn.Module:
    """Run ``model``'s experts on cakeops (``experts_implementation="cakeops"``), its gated
    RMSNorms on :func:`cakeops.rmsnorm_silu_gate`, the core of its linear attention
    (MiniMax's lightning attention) on :func:`cakeops.causal_dot_product`, its delta rules on
    :func:`cakeops.gated_delta_rule` and its causal convolutions on
    :func:`cakeops.causal_conv1d`, in place; returns the model. Parameters, buffers and
    state-dict names stay as they are."""
    register()
    check_model(model)
    if (
        hasattr(model, "set_experts_implementation")
        and getattr(model, "_can_set_experts_implementation", lambda: True)()
    ):
        model.set_experts_implementation(NAME)
    for module in model.modules():
        swap_class(module)
    keep_documents_apart(model)
    return model


register()
