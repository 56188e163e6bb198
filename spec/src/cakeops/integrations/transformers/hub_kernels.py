"""Adapters for the kernels transformers loads from the hub (``use_kernel_func_from_hub_with_
fallback``: fla's delta rules, causal-conv1d, mamba_ssm's scans) on cakeops' ops, each taking
the kernel's own arguments and layout, and which layer calls cakeops declines
(:data:`DECLINED_CALLS`). :mod:`.rebinding` puts them in the layers' forwards."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from cakeops._spec import compute_dtype
from cakeops.integrations.packed_documents import packed_offsets
from cakeops.ops.causal_conv1d import ACTIVATIONS as CONV_ACTIVATIONS
from cakeops.ops.causal_conv1d import causal_conv1d
from cakeops.ops.causal_dot_product import causal_dot_product
from cakeops.ops.gated_delta_rule import gated_delta_rule
from cakeops.ops.rmsnorm_silu_gate import rmsnorm_silu_gate

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
                 cu_seqlens=packed_offsets(hidden_states, kwargs))  # fmt: skip


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
    cu = packed_offsets(hidden_states, {**kwargs, "seq_idx": seq_idx})
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


def hub_name(fn: Any) -> str | None:
    """The kernel name of a function wrapped by transformers' hub fallback, else None."""
    if not callable(fn) or not hasattr(fn, "__wrapped__"):
        return None
    try:
        nonlocals = inspect.getclosurevars(fn).nonlocals
    except (TypeError, ValueError):
        return None
    name = nonlocals.get("func_name")
    return name if isinstance(name, str) else None


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


def decline(*args: Any, **kwargs: Any) -> None:
    """A call cakeops declines (:data:`DECLINED_CALLS`): None, so the layer goes on with its
    separate calls."""
    return None
