"""The gated delta rule (and KDA) in Triton: which algorithm takes a call.

- :mod:`.chunk`: forward and backward over chunks of positions (scalar gates and KDA's, key
  heads up to 128: :func:`.chunk.supported`), for calls of at least :data:`CHUNKED_FROM`
  positions;
- :mod:`.fused_recurrent`: one position at a time, the state in registers: short calls
  (decoding) and wider key heads, the latter chosen implicitly up to
  :data:`DELTA_RULE_POSITIONS` (:func:`not_preferred_reasons`).
"""

from __future__ import annotations

from . import chunk, fused_recurrent

#: Positions (``q.shape[2]``: a batch row's length, or the packed row's) from which a call
#: takes the chunked kernels, forward and backward: one forward chunk. Not measured on a GPU
#: yet (no device has run them); under the interpreter a chunk is 4 positions, so the suite's
#: calls of 4 and more take them.
CHUNKED_FROM = chunk.CHUNK
#: The longest call (positions: a batch row's, or the packed row's) chosen implicitly that the
#: chunked kernels do not take (key heads over ``chunk.MAX_K``): a decode step, or a few
#: speculative tokens, as one launch of the step kernel where the torch backend's chunked form
#: makes a dozen launches. Longer such calls go to the torch backend, whose backward is chunked
#: (the step kernels' runs step by step); named, the backend runs them all.
DELTA_RULE_POSITIONS = 64


def not_preferred_reasons(inputs) -> list[str]:
    """Long calls the chunked kernels do not take are passed over (see
    :data:`DELTA_RULE_POSITIONS`)."""
    if inputs.q.shape[2] <= DELTA_RULE_POSITIONS or chunk.supported(inputs.k, inputs.g):
        return []
    return [
        f"chosen implicitly for calls of up to {DELTA_RULE_POSITIONS} positions (a decode "
        f"step: one launch) unless chunked (key heads up to {chunk.MAX_K}), "
        f"got {inputs.q.shape[2]} positions, gates {tuple(inputs.g.shape)} and key heads of "
        f"{inputs.k.shape[-1]}: its step kernels' backward runs step by step, where the "
        "torch backend's is chunked"
    ]


def _algorithm(q, k, g):
    if chunk.supported(k, g) and q.shape[2] >= CHUNKED_FROM:
        return chunk
    return fused_recurrent


def forward(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
            cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    return _algorithm(q, k, g).forward(q, k, v, g, beta, scale, initial_state,
                                       output_final_state, cu_seqlens, use_qk_l2norm)  # fmt: skip


def backward(g_out, g_final, q, k, v, g, beta, scale, initial_state=None,
             output_final_state=False, cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    return _algorithm(q, k, g).backward(g_out, g_final, q, k, v, g, beta, scale, initial_state,
                                        output_final_state, cu_seqlens, use_qk_l2norm)  # fmt: skip
