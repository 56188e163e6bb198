"""Causal linear attention on the CPU: one float32 ``E x M`` state per head, updated step by step,
an algorithm per module.

``prange`` runs the heads in parallel; each head walks its positions in order with a state small
enough to stay in cache (16 KiB at E = M = 64), so there is no chunk score matrix and no BLAS
call per chunk: 4EM flops per position forward, 10EM backward, against the chunked form's
``2C(E + M) + 4EM``. Every sum runs in a fixed order: deterministic.

- :mod:`.plain`: no options (fast-transformers' drop-in), four positions per pass;
- :mod:`.options`: log multipliers, states, packed sequences, grouped key heads;
- :mod:`.decode_step`: a decode step, each head's state read and written once.
"""

from cakeops_numba.cpu.causal_dot_product.decode_step import (
    STEP_FORWARD_BELOW,
    STEP_SERIAL_BELOW,
    step,
    step_backward,
)
from cakeops_numba.cpu.causal_dot_product.options import backward_options, forward_options
from cakeops_numba.cpu.causal_dot_product.plain import backward, forward

__all__ = [
    "STEP_FORWARD_BELOW",
    "STEP_SERIAL_BELOW",
    "backward",
    "backward_options",
    "forward",
    "forward_options",
    "step",
    "step_backward",
]
