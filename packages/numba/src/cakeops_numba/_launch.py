"""Handing PyTorch tensors to numba-cuda kernels: zero-copy views and PyTorch's stream."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

import torch
from numba import cuda

from cakeops_numba import SIMULATOR

# Threads per block. The simulator runs every thread as a Python thread: keep blocks small there.
THREADS = 32 if SIMULATOR else 128


def view(t: torch.Tensor):
    """``t`` as an array a kernel can take, sharing its memory (strides kept); bfloat16 as the
    ``int16`` view of its bits (see :mod:`cakeops_numba._elements`)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if t.device.type == "cuda":
        # The kernels run on PyTorch's current stream, so no synchronisation on hand-over.
        return cuda.as_cuda_array(t.detach(), sync=False)
    if not SIMULATOR:
        raise RuntimeError("cakeops-numba: CPU tensors need NUMBA_ENABLE_CUDASIM=1")
    # The simulator copies a plain numpy argument to its fake device (and refuses strided ones);
    # its device-array type wraps the tensor's memory as it is.
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(t.detach().numpy())


def _thread_safe_simulator_shared_arrays() -> None:
    """numba's simulator creates a block's ``cuda.shared.array`` on first use with an unlocked
    check-then-store, from every simulated thread at once: under load two threads can each make
    their own array and the block's threads then disagree on their shared memory (a wrong
    result, now and then). The same allocation, keyed the same way, under a lock."""
    import numpy as np
    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support

    original = FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory: not keyed
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)  # the kernel line, the key numba uses
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            found = self._allocations.get(caller)
            if found is None:
                found = self._allocations[caller] = np.empty(shape, dtype)
        return found

    FakeCUDAShared.array = array


if SIMULATOR:
    _thread_safe_simulator_shared_arrays()


def blocks_for(rows: int, device: torch.device) -> int:
    """Blocks of a grid-stride launch over ``rows``: a few per multiprocessor, fewer in the
    simulator."""
    if device.type != "cuda":
        return max(1, min(rows, 2))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(rows, 8 * sms))


# The simulator's block scheduler busy-polls its threads; with Python's default GIL switch
# interval the poller holds the GIL for most of the time the simulated threads need it. Kernels
# that synchronise often run several times faster with a short interval; ones whose threads run
# long loops between barriers prefer a longer one.
SIMULATOR_SWITCH_INTERVAL_S = 2e-4
_SIMULATOR_LOCK = threading.RLock()


@contextlib.contextmanager
def on_stream(
    device: torch.device, sim_switch_interval_s: float = SIMULATOR_SWITCH_INTERVAL_S
) -> Iterator[object]:
    """PyTorch's current stream on ``device`` as a numba stream (``0`` in the simulator)."""
    if device.type != "cuda":
        # The simulator swaps numba's cuda module for each launch, process-wide: concurrent
        # launches from several Python threads break it, so they take turns.
        with _SIMULATOR_LOCK:
            previous = sys.getswitchinterval()
            sys.setswitchinterval(sim_switch_interval_s)
            try:
                yield 0
            finally:
                sys.setswitchinterval(previous)
        return
    with cuda.gpus[device.index or 0]:
        yield cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
