"""The gated delta rule (and KDA) in Triton: which algorithm takes a call.

- :mod:`.chunk`: the forward over chunks of positions, on tensor cores (scalar gates, key
  heads up to 64: :func:`.chunk.supported`), for calls of at least :data:`CHUNKED_FROM`
  positions;
- :mod:`.fused_recurrent`: one position at a time, the state in registers: short calls
  (decoding), KDA, wider key heads, and the backward.
"""

from __future__ import annotations

from . import chunk, fused_recurrent

#: Positions (``q.shape[2]``: a batch row's length, or the packed row's) from which a forward
#: takes the chunked kernels: one chunk. Not measured on a GPU yet (no device has run them);
#: under the interpreter one chunk is 16 positions, so the suite's longer calls take them.
CHUNKED_FROM = chunk.CHUNK


def forward(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
            cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    algorithm = fused_recurrent
    if chunk.supported(k, g) and q.shape[2] >= CHUNKED_FROM:
        algorithm = chunk
    return algorithm.forward(q, k, v, g, beta, scale, initial_state, output_final_state,
                             cu_seqlens, use_qk_l2norm)  # fmt: skip


backward = fused_recurrent.backward
