"""Reading and writing tensor elements in the kernels, bfloat16 included.

numba has no bfloat16 type (nor has numpy, nor PyTorch's ``__cuda_array_interface__``), so a
bfloat16 tensor reaches the kernels as an ``int16`` view of its bits. ``widen(x[i])`` turns an
element into float32 (the bits shifted into the top half of a float32; float16 and float32
elements converted as usual) and ``store(y, idx, v)`` writes a float32 value, rounded to nearest
even into an ``int16`` (bfloat16) array, as a GPU's conversion does; NaN stays NaN.

On a GPU these are numba overloads chosen by the element type at compile time; in the CUDA
simulator the kernels run as Python and call the Python versions below. ``sigmoid`` is the
kernels' one elementwise function with an overflow to avoid.
"""

from __future__ import annotations

import math
import struct

import numpy as np
from numba import cuda, float32, int32, types

from cakeops_numba import SIMULATOR


def _widen_py(v):
    if isinstance(v, np.int16):
        return np.float32(struct.unpack("<f", struct.pack("<I", (int(v) & 0xFFFF) << 16))[0])
    return np.float32(v)


def _bits_py(v) -> np.int16:
    bits = struct.unpack("<I", struct.pack("<f", float(np.float32(v))))[0]
    top = (bits >> 16) | 0x40 if v != v else (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.int16(top - 0x10000 if top & 0x8000 else top)


if SIMULATOR:
    widen = _widen_py

    def store(arr, idx, v) -> None:
        arr[idx] = _bits_py(v) if arr.dtype == np.int16 else v

else:
    from numba.core.extending import overload
    from numba.cuda import libdevice

    def widen(v):  # compiled through the overload below
        raise NotImplementedError("widen runs inside numba-cuda kernels only")

    def store(arr, idx, v) -> None:
        raise NotImplementedError("store runs inside numba-cuda kernels only")

    @overload(widen, target="cuda")
    def _widen(v):
        if isinstance(v, types.Integer):  # the bits of a bfloat16

            def impl(v):
                return libdevice.int_as_float((int32(v) & 0xFFFF) << 16)

            return impl
        return lambda v: float32(v)

    @overload(store, target="cuda")
    def _store(arr, idx, v):
        if isinstance(arr.dtype, types.Integer):  # a bfloat16 array: round to nearest even

            def impl(arr, idx, v):
                bits = libdevice.float_as_int(float32(v))
                top = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                if v != v:
                    top = (bits >> 16) | 0x40
                arr[idx] = top

            return impl

        def impl(arr, idx, v):
            arr[idx] = v

        return impl


@cuda.jit(device=True)
def sigmoid(z):
    """``1 / (1 + exp(-z))`` taking ``exp`` of non-positive numbers only: a GPU's ``exp`` of a
    large argument gives inf, the simulator's (Python's ``math``) raises ``OverflowError``. NaN
    stays NaN."""
    if z >= float32(0.0):
        return float32(1.0) / (float32(1.0) + math.exp(-z))
    e = math.exp(z)
    return e / (float32(1.0) + e)
