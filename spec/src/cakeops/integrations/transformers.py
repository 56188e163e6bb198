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

Importing this module registers ``"cakeops"``. Checkpoints are unchanged: no weight is copied or
renamed.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from typing import Any

import torch

from cakeops._spec import compute_dtype
from cakeops.integrations.packed_documents import boundaries, keep_documents_apart
from cakeops.ops.causal_conv1d import ACTIVATIONS as CONV_ACTIVATIONS
from cakeops.ops.causal_conv1d import causal_conv1d
from cakeops.ops.causal_dot_product import causal_dot_product
from cakeops.ops.gated_delta_rule import gated_delta_rule
from cakeops.ops.rmsnorm_silu_gate import rmsnorm_silu_gate
from cakeops.ops.routed_experts import ACTIVATIONS, routed_experts

NAME = "cakeops"
#: Attribute names the families use for a clamped SwiGLU's limit and sigmoid slope.
_LIMITS = ("limit", "swiglu_limit")
_ALPHAS = ("alpha", "swiglu_alpha")


class _RegisteredName(str):
    """``"cakeops"`` as a config of a model on cakeops' experts holds it: a pickled model (a
    model saved whole with ``torch.save``) brings back this name through :func:`_registered_name`,
    which imports this module, and so registers the name, in a process that has not imported
    cakeops."""

    def __reduce__(self):
        return (_registered_name, ())


def _registered_name() -> str:
    return _RegisteredName(NAME)


def _mark_configs(model: torch.nn.Module) -> None:
    """Every config in ``model`` naming cakeops' experts holds :class:`_RegisteredName`."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_experts_implementation_internal", None) == NAME:
            config._experts_implementation_internal = _registered_name()


class Unsupported(NotImplementedError):
    """An experts module cakeops cannot run, with the reasons."""


def _probe(width: int = 16) -> torch.Tensor:
    """Float64 pre-activations from -12 to 12 (the clamps of every family bite inside that
    range), ``(4, width)`` with ``width`` even, on the CPU whatever the default device (a model
    built under ``torch.device("meta")`` is probed as any other)."""
    return torch.linspace(-12, 12, 4 * width, dtype=torch.float64, device="cpu").view(4, width)


def _matches(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)


def _activation_of(act: Any) -> dict[str, Any] | None:
    """The op's ``activation`` (and ``alpha``) computing what ``act`` computes, found by
    running ``act`` on a probe: transformers' activation classes, torch's functions and modules
    alike; None when none of the op's does."""
    from cakeops._activations import ACT

    if act is None:
        return None
    probe = _probe()
    try:
        with torch.no_grad():
            want = act(probe.clone())
    except Exception:  # an activation that takes another signature: not one of ours
        return None
    candidates = [(name, 1.0) for name in ACT] + [("silu", 1.702)]  # quick_gelu: silu(1.702 x)
    for name, alpha in candidates:
        if isinstance(want, torch.Tensor) and _matches(want, ACT[name](probe, alpha)):
            return {"activation": name} | ({"alpha": alpha} if alpha != 1.0 else {})
    return None


def _gate_options(module: torch.nn.Module, activation: dict[str, Any]) -> dict[str, Any] | None:
    """The op's options computing the module's ``_apply_gate`` (its own, or transformers'
    default ``act(gate) * up``), checked on a probe; None when none of them does. A family's
    own gate is read from its attributes (``limit``/``swiglu_limit``, ``alpha``/
    ``swiglu_alpha``) and tried with and without GPT-OSS's ``+ 1`` on the up projection."""
    from cakeops._activations import gated

    probe = _probe()
    F = probe.shape[1] // 2
    interleaved = not getattr(module, "is_concatenated", True)
    gate, up = (probe[:, ::2], probe[:, 1::2]) if interleaved else (probe[:, :F], probe[:, F:])
    try:
        with torch.no_grad():
            want = module._apply_gate(probe.clone())
    except Exception:
        return None
    limit = next((float(getattr(module, a)) for a in _LIMITS if hasattr(module, a)), None)
    alpha = next((float(getattr(module, a)) for a in _ALPHAS if hasattr(module, a)), None)
    base = dict(activation)
    tries = [base]
    if limit is not None or alpha is not None:
        clamped = {"activation": "silu"} if alpha is not None else dict(base)
        if alpha is not None:
            clamped["alpha"] = alpha
        if limit is not None:
            clamped["limit"] = limit
        tries += [clamped, {**clamped, "up_offset": 1.0}]
    for options in tries:
        if _matches(want, gated(gate, up, **options)):
            return options
    return None


def experts_options(module: torch.nn.Module) -> dict[str, Any]:
    """The keyword options of :func:`cakeops.routed_experts` that compute this experts module
    (activation, ``alpha``, ``limit``, ``up_offset``), found once and kept on the module;
    raises :class:`Unsupported` with every reason it cannot."""
    cached = module.__dict__.get("_cakeops_options")
    if cached is not None:
        return cached
    if torch.compiler.is_compiling():  # the probe compares values: it cannot be traced
        raise RuntimeError(
            f"experts_implementation='cakeops': {type(module).__name__}'s options are found by "
            "running it eagerly once; call cakeops.integrations.transformers.check_model(model) "
            "(apply_cakeops and set_experts_implementation('cakeops') do) before torch.compile"
        )
    reasons = []
    if getattr(module, "has_post_expert_norm", False):
        norm = type(getattr(module, "post_expert_norm", None)).__name__
        reasons.append(f"a norm after each expert ({norm}), before the combine")
    act = getattr(module, "act_fn", None)
    activation = _activation_of(act)
    gated = getattr(module, "has_gate", True)
    if gated:
        options = _gate_options(module, activation or {"activation": "silu"})
        if options is None:
            doc = (type(act).__doc__ or "").strip().split("\n")[0]
            what = f"{type(act).__name__}: {doc}" if act is not None and doc else "its own"
            reasons.append(
                f"its gate ({type(module).__name__}._apply_gate, {what.rstrip('.')}) is none "
                f"of cakeops' forms (act(min(gate, limit)) * (clamp(up, ±limit) + offset), act "
                f"in {', '.join(ACTIVATIONS)})"
            )
    else:
        options = activation
        if options is None:
            reasons.append(f"its activation ({type(act).__name__}) is not in {ACTIVATIONS}")
    if reasons:
        raise Unsupported(
            f"experts_implementation='cakeops' does not support {type(module).__name__}: "
            f"{'; '.join(reasons)}; use 'eager' or 'grouped_mm' for this model"
        )
    module.__dict__["_cakeops_options"] = options
    return options


def _weights(self: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's weights and biases as the op reads them: views, never copies.

    Hugging Face keeps ``gate_up_proj (E, 2F, D)`` (``(E, D, 2F)`` transposed), gate then up
    (or interleaved: gate, up, gate, ...), ``up_proj`` without a gate, ``down_proj (E, D, F)``
    (``(E, F, D)`` transposed) and the biases beside them."""
    transposed = getattr(self, "is_transposed", False)
    down = self.down_proj.transpose(1, 2) if transposed else self.down_proj
    F = down.shape[-1]

    def split(t: torch.Tensor | None, dim: int):
        """Gate and up along ``dim``: the two halves, or every other entry (interleaved)."""
        if t is None:
            return None, None
        if getattr(self, "is_concatenated", True):
            return t.narrow(dim, 0, F), t.narrow(dim, F, F)
        before = (slice(None),) * dim
        return t[(*before, slice(0, None, 2))], t[(*before, slice(1, None, 2))]

    has_bias = getattr(self, "has_bias", False)
    out: dict[str, torch.Tensor | None] = {"w_down": down}
    if getattr(self, "has_gate", True):
        gate, up = split(self.gate_up_proj, 2 if transposed else 1)
        if transposed:
            gate, up = gate.transpose(1, 2), up.transpose(1, 2)
        out["b_gate"], out["b_up"] = split(self.gate_up_proj_bias if has_bias else None, 1)
    else:
        gate, up = None, self.up_proj.transpose(1, 2) if transposed else self.up_proj
        out["b_up"] = self.up_proj_bias if has_bias else None
    out["w_gate"], out["w_up"] = gate, up
    out["b_down"] = self.down_proj_bias if has_bias else None
    return out


def _arguments(self: torch.nn.Module) -> tuple[Any, ...]:
    """``(w_gate, w_up, w_down, the other keyword arguments)`` of :func:`cakeops.routed_experts`
    for the module (:func:`_weights` and :func:`experts_options`). Without grad mode (a decode
    step) they are kept on the module while its parameters are the same tensors on the same
    memory (an optimizer's in-place step keeps the views valid; a new parameter or ``.data``
    does not): a decode step then skips the views' half-dozen ops. Under ``torch.compile`` the
    views are made each call: they are part of the graph, and a compiled graph cannot compare
    data pointers."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return _made_arguments(self)
    key = tuple((id(p), p.data_ptr(), p.shape) for p in self._parameters.values() if p is not None)
    cached = self.__dict__.get("_cakeops_arguments")
    if cached is None or cached[0] != key:
        cached = (key, _made_arguments(self))
        self.__dict__["_cakeops_arguments"] = cached
    return cached[1]


def _made_arguments(self: torch.nn.Module) -> tuple[Any, ...]:
    w = _weights(self)
    gate, up, down = w.pop("w_gate"), w.pop("w_up"), w.pop("w_down")
    return gate, up, down, {**w, **experts_options(self)}


def experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """An ``ExpertsInterface`` function: the experts module's experts and combine on
    :func:`cakeops.routed_experts`, whatever its form (activation, clamped gate, biases,
    transposed or interleaved weights, no gate). Ids past the local experts (transformers'
    expert parallelism) are dropped slots. Refuses a module it cannot run, with the reasons."""
    gate, up, down, rest = _arguments(self)
    return routed_experts(hidden_states, top_k_index, top_k_weights, gate, up, down, **rest)


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
    _register_ep_implementation()
    post_init = PreTrainedModel.post_init
    if getattr(post_init, "_cakeops_checks", False):
        return

    @functools.wraps(post_init)
    def post_init_then_check(self, *args, **kwargs):
        result = post_init(self, *args, **kwargs)
        if getattr(self.config, "_experts_implementation", None) == NAME:
            check_model(self)
            _mark_configs(self)
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
        _mark_configs(self)
        return result

    PreTrainedModel.set_experts_implementation = check_then_set


def _register_ep_implementation() -> None:
    """Add ``"cakeops"`` to transformers' ``EPImplementationInterface`` (a transformers without
    expert parallelism, or without torch.distributed, is left alone)."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from transformers.distributed.expert_parallel import (
            EPImplementation,
            EPImplementationInterface,
        )
    except ImportError:
        return

    class CakeopsEP(EPImplementation):
        """``DistributedConfig(..., ep_implementation="cakeops")``: the experts module's
        experts, sharded over the EP group, on :func:`cakeops.distributed.routed_experts` (a
        token sent once to each rank that owns one of its experts, its slots' ids and weights
        with it; the partial sums combined at home). The ranks of a TP group (which hold the same
        batch) each take a slice of its tokens and gather the outputs, as transformers'
        ``AllToAllEP`` does. Refuses an experts module cakeops cannot run, when built."""

        def __init__(self, experts, ep_mesh, tp_mesh):
            super().__init__(experts, ep_mesh, tp_mesh)
            self.experts = experts
            experts_options(experts)

        def __call__(self, hidden_states, top_k_index, top_k_weights):
            from cakeops.distributed import routed_experts as distributed_experts

            num_tokens, hidden = hidden_states.shape
            sliced = self.tp_mesh.size() > 1
            if sliced:  # Replicate -> Shard(0): a local slice; its backward gathers the rows
                hidden_states, top_k_index, top_k_weights = (
                    DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False)
                    .redistribute(self.tp_mesh, [Shard(0)])
                    .to_local()
                    for t in (hidden_states, top_k_index, top_k_weights)
                )
            w = _weights(self.experts)  # the local experts: EP runs this inside its local view
            out = distributed_experts(
                hidden_states, top_k_index, top_k_weights, w.pop("w_gate"), w.pop("w_up"),
                w.pop("w_down"), group=self.ep_mesh.get_group(), **w,
                **experts_options(self.experts),
            )  # fmt: skip
            if not sliced:
                return out
            out = DTensor.from_local(out.contiguous(), self.tp_mesh, [Shard(0)],
                                     shape=(num_tokens, hidden), stride=(hidden, 1))  # fmt: skip
            return out.full_tensor()

    EPImplementationInterface.register(NAME, CakeopsEP)


# --------------------------------------------------------------------------------------------
# Gated norms


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


#: gated-norm class name -> the forward on cakeops. tests/test_transformers.py finds every
#: ``*RMSNormGated`` class of the installed transformers and checks each is here (and matches
#: the model's own) or in NOT_SERVED_NORMS.
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


# --------------------------------------------------------------------------------------------
# Linear attention


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
    cu = _packed_offsets(hidden_states, kwargs)  # documents packed in one row: kept apart
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
#: every module class apply_cakeops swaps, by name
PATCHED = {**GATED_NORMS, **LINEAR_ATTENTIONS}
_patched: dict[type, type] = {}


# --------------------------------------------------------------------------------------------
# The gated delta rule and KDA (Gated DeltaNet and Kimi Delta Attention layers)


def _hf_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                   output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                   scale=None, **kwargs):  # fmt: skip
    """fla's and transformers' ``chunk_gated_delta_rule`` / ``chunk_kda`` (and their recurrent
    forms) on :func:`cakeops.gated_delta_rule`: ``(N, L, H, D)`` tensors passed as transposed
    views (no copy), packed sequences kept apart by ``cu_seqlens``."""
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out, state = gated_delta_rule(t(query), t(key), t(value), t(g), t(beta), scale=scale,
                                  initial_state=initial_state, output_final_state=True,
                                  cu_seqlens=cu_seqlens,
                                  use_qk_l2norm=use_qk_l2norm_in_kernel)  # fmt: skip
    return t(out), (state if output_final_state else None)


# --------------------------------------------------------------------------------------------
# The causal convolution (Mamba, Mamba2, Gated DeltaNet, KDA and short-convolution layers)


def _packed_offsets(x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """Packed sequences' offsets from what the layers pass along: ``cu_seq_lens_q``
    (``DataCollatorWithFlattening``) or Mamba's per-position ``seq_idx`` ``(1, L)`` (its
    offsets read from the changes of sequence: a synchronisation on a GPU)."""
    if x.shape[0] != 1:
        return None
    cu = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seqlens"))
    if cu is not None:
        return cu
    seq_idx = kwargs.get("seq_idx")
    return None if seq_idx is None else boundaries(seq_idx.reshape(-1), step=0)


def _conv(x, weight, bias, activation, **options):
    """:func:`cakeops.causal_conv1d` with transformers' activation (SiLU fused, any other
    applied after) and its dtype rule (x in a 16-bit weight's dtype, as its fallback casts)."""
    if weight.dtype not in (x.dtype, torch.float32):
        x = x.to(weight.dtype)
    fused = activation in CONV_ACTIVATIONS
    out = causal_conv1d(x, weight, bias, activation=activation if fused else None, **options)
    if fused:
        return out
    from transformers.activations import ACT2FN

    return ACT2FN[activation](out)


def _hf_causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' (and causal-conv1d's) ``causal_conv1d_fn`` on
    :func:`cakeops.causal_conv1d`: ``(N, C, L)`` as the layers pass it (a transposed view, taken
    without a copy; the output comes back in that layout), packed sequences kept apart
    (``cu_seq_lens_q`` or ``seq_idx``), causal-conv1d's ``initial_states`` and
    ``return_final_states`` too."""
    initial = kwargs.get("initial_states")
    wanted = bool(kwargs.get("return_final_states", False))
    return _conv(hidden_states, weight, bias, activation, initial_state=initial,
                 output_final_state=wanted,
                 cu_seqlens=_packed_offsets(hidden_states, kwargs))  # fmt: skip


def _hf_causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None,
                             **kwargs):  # fmt: skip
    """``causal_conv1d_update`` on :func:`cakeops.causal_conv1d`: the new positions from the
    cached state's last ``W - 1`` inputs, and the state rolled in place as transformers' does
    (its cache holds ``W`` of them)."""
    width, kept = weight.shape[-1], conv_state.shape[-1]
    past = conv_state[:, :, kept - (width - 1) :]
    out = _conv(hidden_states, weight, bias, activation, initial_state=past)
    rolled = torch.cat([conv_state, hidden_states.to(conv_state.dtype)], -1)[:, :, -kept:]
    conv_state.copy_(rolled)
    return out


# --------------------------------------------------------------------------------------------
# Mamba2's scan (SSD) on causal_dot_product


def _groups(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Mamba2's B or C ``(N, L, G, S)`` as :func:`cakeops.causal_dot_product`'s key heads
    ``(N, G, L, S)`` in ``dtype`` (a transposed view): value head ``h`` reads group
    ``h // (heads / G)``, the op's own rule, so no head gets a copy."""
    return t.to(dtype).transpose(1, 2)


def _time_steps(dt, dt_bias, dt_softplus, dtype, dt_limit=None):
    """Mamba2's discretisation steps: ``dt + dt_bias``, softplus, clamped to ``dt_limit``, in
    ``dtype`` (its fallback's order)."""
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    if dt_limit is not None and tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def _hf_mamba_chunk_scan(hidden_states, dt, A, B, C, chunk_size=None, D=None, z=None,
                         dt_bias=None, initial_states=None, seq_idx=None, dt_softplus=False,
                         dt_limit=(0.0, float("inf")), return_final_states=False,
                         **kwargs):  # fmt: skip
    """mamba_ssm's (and transformers' fallback's) ``mamba_chunk_scan_combined`` on
    :func:`cakeops.causal_dot_product`: ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``,
    ``y_t = C_t^T h_t + D x_t`` (times ``silu(z)``), i.e. q = C, k = B (the op's key heads,
    one per group: never repeated per head), v = dt x, ``log_gates = dt A``; the state
    ``(N, H, P, S)`` as the models keep it (the op's is its transpose), float32; packed
    sequences from ``seq_idx`` or ``cu_seq_lens_q``, each document from zeros but the first
    (from the row's initial state), the row's final state its last document's (mamba_ssm's
    rule). ``chunk_size`` is the op's business."""
    f = compute_dtype(hidden_states.dtype)
    dt = _time_steps(dt, dt_bias, dt_softplus, f, dt_limit)  # (N, L, H)
    x = hidden_states.to(f)
    v = (x * dt[..., None]).transpose(1, 2)
    log_gates = (dt * A.to(f)).transpose(1, 2)
    initial = None if initial_states is None else initial_states.to(f).transpose(-1, -2)
    cu = _packed_offsets(hidden_states, {**kwargs, "seq_idx": seq_idx})
    if cu is not None and initial is not None:  # the row's initial state is its first document's
        initial = torch.cat([initial, initial.new_zeros((cu.numel() - 2, *initial.shape[1:]))])
    out, final = causal_dot_product(_groups(C, f), _groups(B, f), v,
                                    log_gates=log_gates, initial_state=initial,
                                    output_final_state=True, cu_seqlens=cu)  # fmt: skip
    if cu is not None:  # the row's final state: its last document's
        final = final[-1:]
    y = out.transpose(1, 2)
    if D is not None:
        y = y + (D.to(f)[:, None] if D.dim() == 1 else D.to(f)) * x
    if z is not None:
        y = y * torch.nn.functional.silu(z.to(f))
    y = y.contiguous()
    return (y, final.transpose(-1, -2)) if return_final_states else y


def _per_head(t: torch.Tensor | None, dims: int) -> bool:
    """Whether ``t`` is one value per head expanded over its last ``dims`` dimensions (how
    the models pass dt, dt_bias and A to ``selective_state_update``)."""
    return t is None or all(t.stride(-1 - i) == 0 or t.shape[-1 - i] == 1 for i in range(dims))


def _hf_selective_state_update(original, state, hidden_states, dt, A, B, C, D=None, z=None,
                               dt_bias=None, dt_softplus=False, **kwargs):  # fmt: skip
    """mamba_ssm's ``selective_state_update`` for Mamba2 (a state ``(N, H, P, S)``, dt and A
    one value per head): one position of :func:`cakeops.causal_dot_product` from the state,
    written back in place. Anything else (Mamba1's per-channel A) runs ``original``."""
    mamba2 = state.dim() == 4 and hidden_states.dim() == 3 and B.dim() == 3
    if not (mamba2 and _per_head(dt, 1) and _per_head(dt_bias, 1) and _per_head(A, 2)):
        return original(state, hidden_states, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                        dt_softplus=dt_softplus, **kwargs)  # fmt: skip
    f = compute_dtype(hidden_states.dtype)
    bias = None if dt_bias is None else dt_bias[..., 0]
    dt = _time_steps(dt[..., 0], bias, dt_softplus, f)[..., None]  # (N, H, 1)
    x = hidden_states.to(f)
    v = (x * dt)[:, :, None]
    log_gates = dt * A[:, 0, 0].to(f)[:, None]
    q, k = (_groups(t[:, None], f) for t in (C, B))
    out, final = causal_dot_product(q, k, v, log_gates=log_gates,
                                    initial_state=state.to(f).transpose(-1, -2),
                                    output_final_state=True)  # fmt: skip
    state.copy_(final.transpose(-1, -2))
    y = out[:, :, 0]
    if D is not None:
        y = y + D.to(f) * x if D.dim() > 1 else y + D.to(f)[:, None] * x
    if z is not None:
        y = y * torch.nn.functional.silu(z.to(f))
    return y.to(hidden_states.dtype)


_hf_selective_state_update.wants_original = True


def _hf_split_conv1d_scan(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size=None,
                          initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                          return_final_states=False, activation="silu", rmsnorm_weight=None,
                          rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None,
                          headdim=None, ngroups=1, norm_before_gate=True,
                          **kwargs):  # fmt: skip
    """mamba_ssm's ``mamba_split_conv1d_scan_combined``, the call a Mamba2 mixer makes first
    in training (no cache), as the mixers make it: the projection ``zxbcdt`` split into the gate
    ``z``, the convolution's input and ``dt``; :func:`cakeops.causal_conv1d` (SiLU); the SSD
    scan on :func:`cakeops.causal_dot_product` (softplus of ``dt + dt_bias``, the ``D`` skip);
    the grouped gated norm on :func:`cakeops.rmsnorm_silu_gate`; the output projection. Packed
    documents (``seq_idx`` or ``cu_seq_lens_q``) stay apart in both the convolution and the
    scan. As mamba_ssm's kernel, it receives no attention mask: a left-padded batch's padding
    reaches the scan through the convolution's bias, where the mixer's separate calls zero it.
    Any other use (no norm or projection, mamba_ssm's extra gated-MLP columns, an activation
    the convolution does not fuse) answers None, and the mixer runs its separate calls."""
    heads, conv_dim = A.shape[0], conv1d_weight.shape[0]
    dim = heads * (headdim or 0)
    if (activation not in ("silu", "swish") or rmsnorm_weight is None or outproj_weight is None
            or not dim or zxbcdt.shape[-1] != dim + conv_dim + heads):  # fmt: skip
        return None
    state = (conv_dim - dim) // (2 * ngroups)
    z, xbc, dt = zxbcdt.split([dim, conv_dim, heads], dim=-1)
    xbc = _hf_causal_conv1d_fn(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, activation,
                               seq_idx=seq_idx, **kwargs).transpose(1, 2)  # fmt: skip
    x, B, C = xbc.split([dim, ngroups * state, ngroups * state], dim=-1)
    N, L = zxbcdt.shape[:2]
    result = _hf_mamba_chunk_scan(
        x.reshape(N, L, heads, headdim), dt, A, B.reshape(N, L, ngroups, state),
        C.reshape(N, L, ngroups, state), chunk_size, D=D, dt_bias=dt_bias,
        initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit,
        return_final_states=return_final_states, **kwargs)  # fmt: skip
    y, final = result if return_final_states else (result, None)
    y = rmsnorm_silu_gate(y.reshape(N, L, dim), z.to(y.dtype), rmsnorm_weight.to(y.dtype),
                          rmsnorm_eps, group_size=dim // ngroups,
                          norm_before_gate=norm_before_gate)  # fmt: skip
    out = torch.nn.functional.linear(y.to(zxbcdt.dtype), outproj_weight, outproj_bias)
    return (out, final) if return_final_states else out


#: the kernel names transformers' ``use_kernel_func_from_hub_with_fallback`` wraps that
#: cakeops serves: the delta rules, the convolutions, Mamba2's scans, and what serves each
DELTA_RULES = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda",
               "fused_recurrent_kda")  # fmt: skip
CONVOLUTIONS = ("causal_conv1d_fn", "causal_conv1d_update")
SERVED_KERNELS = {
    **dict.fromkeys(DELTA_RULES, _hf_delta_rule),
    "causal_conv1d_fn": _hf_causal_conv1d_fn,
    "causal_conv1d_update": _hf_causal_conv1d_update,
    "mamba_chunk_scan_combined": _hf_mamba_chunk_scan,
    "selective_state_update": _hf_selective_state_update,
    "mamba_split_conv1d_scan_combined": _hf_split_conv1d_scan,
}
MAMBA2_SCANS = ("mamba_chunk_scan_combined", "selective_state_update")


def _hub_name(fn: Any) -> str | None:
    """The kernel name of a function wrapped by transformers' hub fallback, else None."""
    if not callable(fn) or not hasattr(fn, "__wrapped__"):
        return None
    try:
        nonlocals = inspect.getclosurevars(fn).nonlocals
    except (TypeError, ValueError):
        return None
    name = nonlocals.get("func_name")
    return name if isinstance(name, str) else None


def _layers(fn: Any) -> list[Any]:
    """``fn`` and the functions it wraps (``functools.wraps`` chains: transformers wraps some
    forwards in hooks)."""
    chain = []
    while callable(fn) and hasattr(fn, "__code__") and fn not in chain:
        chain.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return chain


def _served_names(cls: type, kernels=tuple(SERVED_KERNELS)) -> dict[str, str]:
    """The globals ``cls.forward`` (or a function it wraps) calls that are transformers' hub
    kernels among ``kernels`` (by default every one cakeops serves): name -> kernel name."""
    names = {}
    for fn in _layers(cls.__dict__.get("forward")):
        scope = fn.__globals__
        for n in fn.__code__.co_names:
            kernel = _hub_name(scope.get(n))
            if kernel in kernels:
                names[n] = kernel
    if "mamba_chunk_scan_combined" not in names.values():  # Mamba1's state update: not served
        names = {n: k for n, k in names.items() if k != "selective_state_update"}
    return names


#: layer class name -> {kernel name: why cakeops declines that call}: it answers None, as
#: transformers' fallback does, and the layer makes its separate calls (each on cakeops; the
#: fallback itself raises on packed documents)
DECLINED_CALLS = {
    "FalconH1Mixer": {
        "mamba_split_conv1d_scan_combined": "its fused training call asks for the norm after "
        "the gate, where its own norm (and so its inference) normalises before it by default "
        "(config.mamba_norm_before_gate): transformers' two paths disagree, and serving the "
        "fused call would train another model than the one that generates",
    },
}


def _declined(*args: Any, **kwargs: Any) -> None:
    """A call cakeops declines (:data:`DECLINED_CALLS`): None, so the layer goes on with its
    separate calls."""
    return None


def _originals(cls: type) -> dict[str, Any]:
    """The functions the names of :func:`_served_names` are bound to in ``cls.forward``'s
    module (what an adapter falls back to)."""
    found = {}
    for fn in _layers(cls.__dict__.get("forward")):
        found.update({n: fn.__globals__[n] for n in fn.__code__.co_names if n in fn.__globals__})
    return found


def _served_module(scope: dict[str, Any], served: dict[str, Any]) -> types.ModuleType:
    """A module copying the model module whose globals are ``scope``, with the ``served`` names
    from cakeops, importable as ``cakeops._served.<model module>``: torch.compile guards a
    function's globals through the module they belong to, by name."""
    name = f"cakeops._served.{scope['__name__']}"
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__dict__.update(scope)
        module.__dict__.update(served, __name__=name)
        sys.modules[name] = module
    return module


def _rebound(fn: Any, served: dict[str, Any]) -> Any:
    """A copy of ``fn`` reading the ``served`` names from cakeops: the same code over a copy of
    its globals (and the function it wraps, held in its closure, rebound the same way)."""
    cells = fn.__closure__
    inner = getattr(fn, "__wrapped__", None)
    if inner is not None and cells:
        new_inner = _rebound(inner, served)

        def swap(cell):
            try:
                return types.CellType(new_inner) if cell.cell_contents is inner else cell
            except ValueError:  # an empty cell
                return cell

        cells = tuple(swap(c) for c in cells)
    scope = fn.__globals__
    if any(n in fn.__code__.co_names for n in served):
        scope = _served_module(scope, served).__dict__
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, cells)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return functools.wraps(fn)(copy) if inner is None else functools.update_wrapper(
        copy, fn, updated=())  # fmt: skip


def _kernels_class(cls: type) -> type:
    """``cls`` with its forward reading the hub kernels cakeops serves (the delta rules, the
    convolutions) from cakeops (other models of the family keep transformers' functions)."""
    if cls not in _patched:
        originals = _originals(cls)
        served = {}
        declined = DECLINED_CALLS.get(cls.__name__, {})
        for name, kernel in _served_names(cls).items():
            adapter = _declined if kernel in declined else SERVED_KERNELS[kernel]
            if getattr(adapter, "wants_original", False):
                adapter = functools.partial(adapter, originals[name])
            served[name] = adapter
        forward = _rebound(cls.__dict__["forward"], served)
        body = {"forward": forward, "__reduce_ex__": _reduce_ex, "__cakeops_original__": cls}
        _patched[cls] = type(f"Cakeops{cls.__name__}", (cls,), body)
    return _patched[cls]


def _new_patched(cls: type) -> torch.nn.Module:
    """Unpickling: an empty instance of ``cls``'s patched class (its state comes after)."""
    patched = _patched_class(cls) if cls.__name__ in PATCHED else _kernels_class(cls)
    return object.__new__(patched)


def _reduce_ex(self: torch.nn.Module, protocol: int):
    """Pickle a patched module by its model class, which is importable (the patched class is
    built at run time and is not): unpickling, in any process, rebuilds the patched class."""
    reduced = object.__reduce_ex__(self, max(protocol, 2))
    return (_new_patched, (type(self).__cakeops_original__,), *reduced[2:])


def _patched_class(cls: type) -> type:
    if cls not in _patched:
        body = {"forward": PATCHED[cls.__name__], "__reduce_ex__": _reduce_ex,
                "__cakeops_original__": cls}  # fmt: skip
        _patched[cls] = type(f"Cakeops{cls.__name__}", (cls,), body)
    return _patched[cls]


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
        cls = type(module)
        if cls.__name__ in PATCHED:
            module.__class__ = _patched_class(cls)
        elif cls not in _patched.values() and _served_names(cls):
            module.__class__ = _kernels_class(cls)
    keep_documents_apart(model)
    return model


register()
