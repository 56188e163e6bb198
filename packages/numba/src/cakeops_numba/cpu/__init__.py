"""CPU kernels (numba ``njit``, parallel), shipped only for ops where they beat the ``torch``
backend on the op's benchmark shapes (``packages/numba/benchmarks``)."""
