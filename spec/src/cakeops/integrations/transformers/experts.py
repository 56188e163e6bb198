"""The experts of Hugging Face's MoE families on :func:`cakeops.routed_experts`: the options
(activation, clamped gate, ``+ 1`` on the up projection) that compute an experts module, found
by running its own code on a probe; its weights read as views; the ``ExpertsInterface``
function; and the ``EPImplementation`` for transformers' expert parallelism."""

from __future__ import annotations

from typing import Any

import torch

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


def mark_configs(model: torch.nn.Module) -> None:
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


def register_ep_implementation() -> None:
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
