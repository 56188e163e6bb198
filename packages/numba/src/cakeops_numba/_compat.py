"""numba-cuda 0.30 on NumPy 2.5.

numba-cuda 0.30 registers an overload of ``np.row_stack`` when its CUDA target first loads (the
first compile), and NumPy 2.5 removed ``row_stack``: every compile then fails with
``AttributeError: module 'numpy' has no attribute 'row_stack'`` (numba itself checks the NumPy
version there; numba-cuda does not). :func:`numba_cuda_on_numpy_2_5` loads that module once with
a stand-in ``row_stack`` of its own, then removes it again: numpy is left as it was, and the
overload is registered for a function nothing calls. Nothing happens where NumPy still has
``row_stack``.
"""

from __future__ import annotations

import importlib

import numpy as np

#: The numba-cuda module whose import registers the overload.
ARRAYOBJ = "numba.cuda.np.arrayobj"


def _row_stack(tup):  # pragma: no cover - never called: numba-cuda only registers it
    return np.vstack(tup)


def numba_cuda_on_numpy_2_5() -> None:
    """Import numba-cuda's array overloads with ``np.row_stack`` present, on a NumPy that has
    none (>= 2.5); leave numpy without it afterwards."""
    if hasattr(np, "row_stack"):
        return
    np.row_stack = _row_stack  # type: ignore[attr-defined]
    try:
        importlib.import_module(ARRAYOBJ)
    finally:
        del np.row_stack
