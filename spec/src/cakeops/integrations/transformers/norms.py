"""The gated RMSNorms of the hybrid families (Qwen3-Next's, Mamba2's, Falcon-H1's and their
copies) on :func:`cakeops.rmsnorm_silu_gate`: forwards for subclasses of the models' own norm
classes, each with the model's dtype rule; a call the op does not serve runs the model's code."""

from __future__ import annotations

import torch

from cakeops.ops.rmsnorm_silu_gate import rmsnorm_silu_gate


def _own_forward(self, *args):
    """The model's own forward (the class ``apply_cakeops`` subclassed)."""
    return type(self).__mro__[1].forward(self, *args)


def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype, **options):
    """:func:`cakeops.rmsnorm_silu_gate` with the models' dtype rule: their norms upcast ``x``
    and the gate to float32 whatever each came as (a Mamba2 mixer passes its float32 scan output
    with a 16-bit gate), so both are taken in the wider of their dtypes (the weight too, unless
    it is float32), and the result is returned in ``out_dtype``, the model's own norm's."""
    dtype = torch.promote_types(x.dtype, gate.dtype)
    weight = self.weight
    if weight.dtype not in (dtype, torch.float32):
        weight = weight.to(dtype)
    y = rmsnorm_silu_gate(x.to(dtype), gate.to(dtype), weight, self.variance_epsilon, **options)
    return y.to(out_dtype)


def _norm_then_gate_forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None):
    """Qwen3-Next's norm and its copies (Qwen3.5, OLMo-Hybrid, ...): ``norm(x) * w * act(gate)``
    over the last dim, in ``x``'s dtype; a gate other than SiLU, or none, runs the model's own
    code."""
    if gate is None or getattr(self, "activation", "silu") not in ("silu", "swish"):
        return _own_forward(self, hidden_states, gate)
    return _gated_norm(self, hidden_states, gate, hidden_states.dtype)


def _mamba_forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None):
    """Mamba2's grouped norm after the gate (and its copies: Bamba, Granite 4.0, Nemotron-H,
    Zamba2), in the dtype of ``weight * x`` as the model's; without a gate, a plain grouped
    RMSNorm: the model's own code."""
    if gate is None:
        return _own_forward(self, hidden_states)
    out_dtype = torch.promote_types(self.weight.dtype, hidden_states.dtype)
    return _gated_norm(self, hidden_states, gate, out_dtype, group_size=self.group_size,
                       norm_before_gate=False)  # fmt: skip


def _falcon_h1_forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None):
    """Falcon-H1's: ``n_groups`` groups, the gate before or after the norm (its
    ``norm_before_gate``), in ``x``'s dtype."""
    if gate is None:
        return _own_forward(self, hidden_states, gate)
    return _gated_norm(self, hidden_states, gate, hidden_states.dtype,
                       group_size=hidden_states.shape[-1] // self.n_groups,
                       norm_before_gate=self.norm_before_gate)  # fmt: skip


#: gated-norm class name -> the forward on cakeops. tests/integrations/test_transformers.py finds
#: every ``*RMSNormGated`` class of the installed transformers and checks each is here (and
#: matches the model's own) or in NOT_SERVED_NORMS.
_NORM_THEN_GATE = ("Qwen3NextRMSNormGated", "Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated",
                   "Qwen4ExpTextRMSNormGated", "OlmoHybridRMSNormGated",
                   "LaraMiniRMSNormGated")  # fmt: skip
_MAMBA = ("MambaRMSNormGated", "BambaRMSNormGated", "GraniteMoeHybridRMSNormGated",
          "NemotronHRMSNormGated", "Zamba2RMSNormGated")  # fmt: skip
GATED_NORMS = {
    **dict.fromkeys(_NORM_THEN_GATE, _norm_then_gate_forward),
    **dict.fromkeys(_MAMBA, _mamba_forward),
    "FalconH1RMSNormGated": _falcon_h1_forward,
}
#: gated-norm class name -> why cakeops leaves it to the model
_SIGMOID = ("KimiLinearRMSNormGated", "BailingHybridRMSNormGated", "Glm5NextTextRMSNormGated")
NOT_SERVED_NORMS = dict.fromkeys(_SIGMOID, "a sigmoid gate (rmsnorm_silu_gate's gate is SiLU)")
