"""Helpers for backend authors: each piece of math the spec owns that several backends need,
written once here (the conformance guide names this package), a module per family of ops:

- :mod:`cakeops.helpers.experts` (``moe_experts``, ``routed_experts``): the routing rules
  (:func:`route`, :class:`Routing`), their backward (:func:`routing_backward`), sorted-row
  bookkeeping (:func:`row_weights`, :func:`row_tiles`), the combine and the dispatch backward
  (:func:`combine`, :func:`weighted_slot_sum`, :func:`slot_sum`, :func:`dispatch_backward`),
  the SwiGLU backward (:func:`swiglu_backward`) and every other activation the experts take
  (:class:`Activation`), dropped slots (:func:`kept_rows`);
- :mod:`cakeops.helpers.causal` (``causal_dot_product``, ``gated_delta_rule``): the backward as
  three causal scans (:func:`backward_by_scans`), the per-position log multipliers
  (:func:`log_multipliers`) and their gradients (:func:`log_multiplier_grads`, or
  :func:`split_log_grads` for a kernel that sums them itself), one decode step
  (:func:`causal_step`, :func:`causal_step_backward`), a state times a vector the way a CPU
  computes it fast (:func:`state_times`), gate factors floored to 0 (:func:`gate_factors`,
  :func:`state_floor`);
- :mod:`cakeops.helpers.conv` (``causal_conv1d``): each sequence's place
  (:func:`conv_sequences`), the final state gathered from the inputs (:func:`conv_final_state`)
  and the initial state's gradient (:func:`conv_initial_state_grad`), for kernels that compute
  the positions only;
- :mod:`cakeops.helpers.common` (every op): :func:`cast_grads` (each gradient in its input's
  dtype), :func:`as_dtype` (a tensor in a dtype, without a no-op ``.to``) and
  :func:`index_tensor` (a host list of indices as a tensor, cheaply); and
  :func:`cakeops.compute_dtype` (the precision to compute in).

Everything is importable from ``cakeops.helpers`` itself, as before the split.
"""

from cakeops._spec import compute_dtype
from cakeops.helpers.causal import (
    LOG_FACTOR_FLOOR,
    backward_by_scans,
    causal_step,
    causal_step_backward,
    crossing_in_chunk,
    drop_tiny_,
    gate_factors,
    key_head_sums,
    log_multiplier_grads,
    log_multipliers,
    split_log_grads,
    state_floor,
    state_times,
    value_heads,
)
from cakeops.helpers.common import as_dtype, cast_grads, index_tensor
from cakeops.helpers.conv import (
    ConvSequences,
    conv_final_state,
    conv_initial_state_grad,
    conv_sequences,
)
from cakeops.helpers.experts import (
    Activation,
    ExpertWeights,
    Routing,
    SwiGLUGrads,
    combine,
    dispatch_backward,
    down_bias_dots,
    gate_up_pair,
    given_routing,
    kept_rows,
    route,
    routing_backward,
    row_experts,
    row_tiles,
    row_weights,
    slot_sum,
    swiglu_backward,
    swiglu_rows,
    top_k_choice,
    weighted_slot_sum,
)

__all__ = [
    "LOG_FACTOR_FLOOR",
    "Activation",
    "ConvSequences",
    "ExpertWeights",
    "Routing",
    "SwiGLUGrads",
    "as_dtype",
    "backward_by_scans",
    "cast_grads",
    "causal_step",
    "causal_step_backward",
    "combine",
    "compute_dtype",
    "conv_final_state",
    "conv_initial_state_grad",
    "conv_sequences",
    "crossing_in_chunk",
    "dispatch_backward",
    "down_bias_dots",
    "drop_tiny_",
    "gate_factors",
    "gate_up_pair",
    "given_routing",
    "index_tensor",
    "kept_rows",
    "key_head_sums",
    "log_multiplier_grads",
    "log_multipliers",
    "route",
    "routing_backward",
    "row_experts",
    "row_tiles",
    "row_weights",
    "slot_sum",
    "split_log_grads",
    "state_floor",
    "state_times",
    "swiglu_backward",
    "swiglu_rows",
    "top_k_choice",
    "value_heads",
    "weighted_slot_sum",
]
