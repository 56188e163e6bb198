"""What the CPU kernel modules share: the fast-math flags, the compile decorator, the launch lock
with the thread count, float32 bit casts, a tensor's address as an array, and the float32 CPU
tensors the kernels read and write."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import carray, njit, types
from numba.core.extending import intrinsic

from cakeops_numba import start_threads

# Reassociation lets the inner loops vectorise; no "nnan"/"ninf", so NaN and inf propagate.
FASTMATH = {"reassoc", "contract", "arcp"}
# numba's "workqueue" threading layer (used when neither OpenMP nor TBB is found) aborts on
# concurrent launches from two Python threads: launches take turns, whichever op they run.
LAUNCH = threading.Lock()


def _new_launch_lock() -> None:
    """In a forked child: a lock of its own (another thread of the parent may have held it at
    the fork, and no thread of the child would ever release it)."""
    global LAUNCH
    LAUNCH = threading.Lock()


if hasattr(os, "register_at_fork"):  # (not on Windows, which does not fork)
    os.register_at_fork(after_in_child=_new_launch_lock)

#: What the kernels' scratch and results are allocated as: never PyTorch's default dtype
#: (bfloat16 in many inference scripts) or device.
F32 = {"dtype": torch.float32, "device": torch.device("cpu")}


def compiled(parallel: bool, fastmath: set[str] = FASTMATH, inline: bool = False):
    """A decorator: ``fn`` compiled on first use (``parallel``: its ``prange`` loop runs on
    numba's threads), cached on disk (in ``__pycache__`` or numba's user cache directory) so
    later processes skip the seconds of compiling; without a writable cache location, compiled
    once per process. Division follows IEEE (``error_model="numpy"``): Python's check for a
    zero divisor, a branch per division, would keep every loop that divides scalar. ``inline``:
    a helper inlined into its callers' numba IR, where the compiler sees which arrays are
    distinct (called as a function, its loops over several array arguments stay scalar)."""

    def compile_(fn):
        options = {"parallel": parallel, "fastmath": fastmath, "error_model": "numpy"}
        if inline:
            return njit(**options, inline="always")(fn)
        try:
            return njit(**options, cache=True)(fn)
        except RuntimeError:  # numba: "cannot cache function ...: no locator available"
            return njit(**options)(fn)

    return compile_


@contextmanager
def launching(serial: bool = False) -> Iterator[None]:
    """Hold the launch lock, numba's threads set to PyTorch's count (one with ``serial``),
    PyTorch's own count left as the caller set it."""
    with LAUNCH:
        start_threads()
        threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
        numba.set_num_threads(1 if serial else threads)
        yield


@intrinsic
def int_as_float(typingctx, bits):
    """The float32 with the bits of an int32."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def float_as_int(typingctx, value):
    """The int32 with the bits of a float32."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@intrinsic
def float_pointer(typingctx, address):
    """A float32 pointer to ``address`` (a tensor's ``data_ptr()``), for ``numba.carray``."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.FloatType()))

    return types.CPointer(types.float32)(types.intp), codegen


@njit(inline="always")
def floats(address, shape):  # pragma: no cover - compiled
    """The C-contiguous float32 array of ``shape`` at ``address`` (a tensor's ``data_ptr()``)."""
    return carray(float_pointer(address), shape)


def as_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float32 and C-contiguous (a copy only when needed)."""
    if t.dtype is not torch.float32 or not t.is_contiguous():
        return t.float().contiguous()
    return t


_NUMPY = {torch.float32: np.float32, torch.int16: np.int16}


def array_at(t: torch.Tensor) -> np.ndarray:
    """A numpy view of ``t``'s memory (float32, or bfloat16's int16 bits), made from its address and
    strides. ``Tensor.numpy()`` marks the storage as never resizable again, which breaks FSDP2
    when ``t`` is a parameter or a view of one (it frees a parameter's storage by resizing)."""
    if t.numel() == 0:
        return np.empty(t.shape, _NUMPY[t.dtype])
    size = t.element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    memory = (ctypes.c_char * (extent * size)).from_address(t.data_ptr())
    return np.ndarray(t.shape, _NUMPY[t.dtype], memory, strides=[s * size for s in t.stride()])


def view_of(view: torch.Tensor, given: torch.Tensor) -> np.ndarray:
    """A numpy view of ``view``: by address where it is the memory of ``given``, a caller's
    tensor (``Tensor.numpy()`` would mark its storage as never resizable: FSDP2 resizes a
    parameter's, and q, k or v may be one or a view of one), else by ``numpy()`` (a copy of
    ours, a few microseconds cheaper)."""
    if view.untyped_storage().data_ptr() == given.untyped_storage().data_ptr():
        return array_at(view)
    return view.numpy()
