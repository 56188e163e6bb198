"""The ``numba`` backend: CUDA kernels written with numba-cuda, CPU kernels where they win.

On CUDA, tensors reach the kernels without copies through ``__cuda_array_interface__``, outputs
are allocated by PyTorch and kernels launch on PyTorch's current stream. Its CUDA kernels use no
tensor cores, so the automatic choice follows expected speed: ``rmsnorm_silu_gate`` (memory-bound)
ranks below ``triton`` and above ``torch``; the matrix-product ops (``causal_dot_product``,
``moe_experts``, ``routed_experts``) rank below ``torch``, whose cuBLAS and grouped GEMMs are
many times faster, and run on numba only when it is asked for by name.

On the CPU, ``njit`` kernels serve the ops where they beat the ``torch`` backend on the op's
benchmark shapes (``causal_dot_product``, in every dtype; ``gated_delta_rule``, both gate forms,
from ``gated_delta_rule.CPU_DELTA_RULE_FROM`` positions; see ``packages/numba/benchmarks``),
as the automatic choice there; ``rmsnorm_silu_gate``'s is the automatic choice for a decode
step's inputs (up to ``rmsnorm_silu_gate.CPU_NORM_ELEMENTS`` elements;
``packages/numba/benchmarks``' ``cpu_rmsnorm_silu_gate.py``), and runs the others when named.

The CUDA kernels need numba-cuda (``pip install 'cakeops-numba[cuda]'``); the CPU kernels need
numba only. With ``NUMBA_ENABLE_CUDASIM=1`` (set before numba is imported) the CUDA kernels run
on CPU tensors in numba's CUDA simulator instead, only when the backend is chosen explicitly (the
conformance suite does).

bfloat16 reaches the CUDA kernels as an ``int16`` view of its bits (PyTorch's
``__cuda_array_interface__`` and numpy have no bfloat16 type), widened to float32 as it loads
and rounded to nearest even as it stores (:mod:`cakeops_numba._elements`). The CPU ``njit``
kernel computes in float32: it reads float32 and bfloat16 (as ``int16`` bits) in place and
converts float16 in bounded blocks of heads.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys

import torch

from cakeops import Backend
from cakeops.opspec import OpInputs
from cakeops.registry import package_kernels

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "") == "1"

if not SIMULATOR and importlib.util.find_spec("numba_cuda") is not None:
    from cakeops_numba._compat import numba_cuda_on_numpy_2_5

    numba_cuda_on_numpy_2_5()  # before any kernel compiles; nothing on NumPy < 2.5
CUDA_PRIORITY = 50  # below triton (100), above torch (10): memory-bound kernels
CUDA_MATMUL_PRIORITY = 5  # below torch (10): products on FMA against torch's tensor cores
CPU_PRIORITY = 20  # above torch (10), for the ops with a CPU kernel


def on_cpu_kernels(t: torch.Tensor) -> bool:
    """Whether ``t`` goes to the ``njit`` CPU kernels: a CPU tensor outside the simulator (which
    sends CPU tensors to the CUDA kernels)."""
    return t.device.type == "cpu" and not SIMULATOR


def devices(cpu_kernel: bool, cuda: int = CUDA_PRIORITY) -> dict[str, int | None]:
    """Where an op is served: CUDA always (at priority ``cuda``); the CPU through its ``njit``
    kernel if it has one, or in the simulator through the CUDA kernels, then only when forced."""
    if SIMULATOR:
        return {"cuda": cuda, "cpu": None}
    return {"cuda": cuda, **({"cpu": CPU_PRIORITY} if cpu_kernel else {})}


def _first_compile() -> None:
    """Compile and run a one-thread kernel: what every numba-cuda kernel needs first (its
    target, NVVM, the driver's linker), on the device PyTorch uses."""
    from numba import cuda

    from cakeops_numba._launch import on_stream, view

    @cuda.jit
    def write_one(out):
        out[0] = 1.0

    out = torch.zeros(1, device="cuda")
    with on_stream(out.device) as stream:
        write_one[1, 1, stream](view(out))
    torch.cuda.current_stream().synchronize()
    if out.item() != 1.0:
        raise RuntimeError("a one-thread test kernel ran but did not write its output")


#: Why the CPU kernels cannot run in this process when it was forked after numba's threads
#: started on GNU OpenMP (numba's ``omp`` layer on Linux): that runtime does not survive a
#: fork, and numba terminates such a child at its first parallel launch.
FORKED_FROM_OPENMP = (
    "this process was forked after numba's OpenMP threads started (GNU OpenMP does not survive "
    "a fork; numba terminates the child at its first parallel launch): start the process with "
    "spawn or forkserver, or set NUMBA_THREADING_LAYER=workqueue or tbb"
)
_forked_from_openmp = False


def _after_fork_in_child() -> None:
    global _forked_from_openmp
    numba = sys.modules.get("numba")
    if numba is None or not sys.platform.startswith("linux"):
        return
    try:
        layer = numba.threading_layer()
    except ValueError:  # its threads had not started: this process starts its own
        return
    _forked_from_openmp = _forked_from_openmp or layer == "omp"


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def start_threads() -> int:
    """numba's thread count, its threads started if they were not, PyTorch's thread count left
    as it was: numba's OpenMP layer sets the process's OpenMP thread count as it starts its
    threads, which is PyTorch's count too (1 under ``OMP_NUM_THREADS=1`` became the CPU count
    for the rest of the process)."""
    import numba

    before = torch.get_num_threads()
    try:
        return numba.get_num_threads()
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


class NumbaBackend(Backend):
    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("numba") is None:
            return "numba is not installed (pip install cakeops-numba, which brings it)"
        return None

    @functools.cached_property
    def cuda_unavailable_reason(self) -> str | None:
        """Why the CUDA kernels cannot run here (the CPU kernels need numba only)."""
        if SIMULATOR:
            return None
        # numba still ships a deprecated built-in CUDA target; the kernels are tested on
        # numba-cuda's, the `cuda` extra
        if importlib.util.find_spec("numba_cuda") is None:
            return "numba-cuda is not installed: pip install 'cakeops-numba[cuda]'"
        if not torch.cuda.is_available():
            return "no CUDA device (NUMBA_ENABLE_CUDASIM=1 runs the kernels on CPU tensors)"
        try:
            from numba import cuda
        except Exception as exc:  # an import-time failure, with its cause
            return f"numba-cuda does not import here: {type(exc).__name__}: {exc}"
        if not cuda.is_available():
            return "numba-cuda finds no usable CUDA driver"
        try:
            _first_compile()
        except Exception as exc:  # NVVM missing, an incompatible NumPy, ...: the cause
            return f"numba-cuda cannot compile a kernel here: {type(exc).__name__}: {exc}"
        return None

    @functools.cached_property
    def cpu_unavailable_reason(self) -> str | None:
        """Why the ``njit`` CPU kernels cannot run here. numba reads its environment as it is
        imported (``NUMBA_NUM_THREADS=0`` fails the import), runs ``njit`` functions as Python
        under ``NUMBA_DISABLE_JIT`` (where the kernels' intrinsics do not exist), and starts
        its threads at the first launch (an unknown ``NUMBA_THREADING_LAYER`` fails only
        then): asked once, before a choice, so that numba is passed over with the cause
        instead of failing the call."""
        try:
            import numba
        except Exception as exc:  # numba's own check of its environment, with its message
            return f"numba does not import here: {type(exc).__name__}: {exc}"
        if numba.config.DISABLE_JIT:
            return "NUMBA_DISABLE_JIT is set: its CPU kernels run only compiled"
        try:
            start_threads()  # starts numba's threads, as a kernel's first launch would
        except Exception as exc:
            return f"numba's threads do not start here: {type(exc).__name__}: {exc}"
        return None

    def not_supported_reasons(self, op: str, inputs: OpInputs) -> list[str]:
        """What the op's kernels serve, then whether numba can run them here (CUDA, or its
        CPU threads), then the kernel module's own rule (importing it imports numba)."""
        reasons = self.served_reasons(op, inputs)
        if inputs.device_type == "cuda" and self.cuda_unavailable_reason is not None:
            reasons.append(self.cuda_unavailable_reason)
        if inputs.device_type == "cpu" and not SIMULATOR and not reasons:
            why = FORKED_FROM_OPENMP if _forked_from_openmp else self.cpu_unavailable_reason
            if why is not None:
                reasons.append(why)
        return reasons or self.declared_reasons(op, "not_supported_reasons", inputs)


backend = NumbaBackend(
    name="numba",
    distribution="cakeops-numba",
    description="numba-cuda kernels (zero-copy, on PyTorch's stream), njit CPU kernels if faster",
    ops=package_kernels(
        __name__,
        devices=devices(cpu_kernel=False),
        dtypes=DTYPES,
        overrides={
            "moe_experts": {"devices": devices(cpu_kernel=False, cuda=CUDA_MATMUL_PRIORITY)},
            "routed_experts": {"devices": devices(cpu_kernel=False, cuda=CUDA_MATMUL_PRIORITY)},
            # CUDA: one thread per value column, step by step, no tensor cores: by name only.
            # CPU: the njit recurrence, from CPU_DELTA_RULE_FROM positions (float32 inside)
            "gated_delta_rule": {"devices": devices(cpu_kernel=True, cuda=CUDA_MATMUL_PRIORITY)},
            # the njit CPU kernel computes in float32 (other dtypes converted)
            "rmsnorm_silu_gate": {"devices": devices(cpu_kernel=True)},
            "causal_dot_product": {
                "devices": devices(cpu_kernel=True, cuda=CUDA_MATMUL_PRIORITY),
                # the njit CPU kernel computes in float32 (bfloat16 read as int16 bits, float16
                # converted a block of heads at a time), so it takes every dtype, as does the
                # simulator
            },
        },
    ),
)
