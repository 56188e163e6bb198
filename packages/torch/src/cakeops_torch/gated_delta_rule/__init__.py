"""The gated delta rule (and KDA) in plain PyTorch: an algorithm per module.

- :mod:`.chunk`: the UT/WY chunked form, forward and a backward written out by hand (every
  call but the shortest);
- :mod:`.recurrent`: step by step, for calls of at most ``RECURRENT_UP_TO`` positions forward
  and one position backward (decoding), where a padded chunk's machinery costs more than the
  math.
"""

from __future__ import annotations

from . import chunk, recurrent
from .chunk import CHUNK, GROUP_BYTES, KDA_CHUNK

#: Sequences up to this long (decoding's one token, a speculative few) run the recurrence step
#: by step: a handful of small products instead of a padded chunk's machinery.
RECURRENT_UP_TO = 4


def forward(q, k, v, g, beta, scale, initial_state=None, output_final_state=False,
            cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    short = 0 < q.shape[2] <= RECURRENT_UP_TO and cu_seqlens is None
    run = recurrent.forward if short else chunk.forward
    return run(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
               use_qk_l2norm)  # fmt: skip


def backward(g_out, g_final, q, k, v, g, beta, scale, initial_state=None,
             output_final_state=False, cu_seqlens=None, use_qk_l2norm=False):  # fmt: skip
    run = recurrent.backward if q.shape[2] == 1 and cu_seqlens is None else chunk.backward
    return run(g_out, g_final, q, k, v, g, beta, scale, initial_state, output_final_state,
               cu_seqlens, use_qk_l2norm)  # fmt: skip


__all__ = ["CHUNK", "GROUP_BYTES", "KDA_CHUNK", "RECURRENT_UP_TO", "backward", "forward"]
