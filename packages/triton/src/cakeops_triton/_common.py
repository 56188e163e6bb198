"""What every kernel module shares: where the kernels run, and the 16-bit arithmetic a GPU does.

The host code takes one path, the GPU's, whether the kernels are compiled for a GPU or run by
Triton's interpreter (``TRITON_INTERPRET=1``, set before this module is imported). Two things
the interpreter gets wrong are emulated inside the kernels, so that CI checks the arithmetic a
GPU performs: it truncates float32 -> bfloat16 conversions (a GPU rounds to nearest even), and
its ``tl.dot`` multiplies the raw bits of bfloat16 operands.
"""

from __future__ import annotations

import functools
import inspect
import threading

import torch
import triton
import triton.language as tl

from cakeops_triton import INTERPRET

EMULATE: tl.constexpr = tl.constexpr(INTERPRET)
# Programs a persistent launch puts on each multiprocessor; the interpreter's stand-in count of
# multiprocessors is small, so that its launches loop over several blocks each.
PROGRAMS_PER_SM = 4
INTERPRETER_SMS = 2


def _interpreter_loop_bounds_on_numpy_2_4() -> None:
    """Triton 3.6's interpreter holds every scalar argument as a one-element array and turns a
    loop bound (``range(0, D, G)``, ``D`` an argument) into an int with ``int(array)``, which
    NumPy 2.4 refuses for an array of one dimension ("only 0-dimensional arrays can be
    converted to Python scalars"). Its tensors' ``__index__`` takes the array's one element
    instead. Interpreter only: compiled kernels never run this Python, and the arguments a GPU
    launch gets are the same Python ints either way."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "cakeops_patched", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        # through the scope, so that it is restored with the interpreter's own patches
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.cakeops_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


def _interpreter_patches_builtins_cheaply() -> None:
    """Triton 3.6's interpreter patches ``triton.language`` again at every call of a device
    function (``tl.sum``, ``tl.cdiv``, a kernel's helpers: each a ``@jit`` function), listing
    every member of each module with ``inspect.getmembers`` to find the builtins: most of the
    time of a kernel that sums a few vectors per step. The same patching, with each module's
    builtin names listed once: a name whose member is no longer a builtin (patched already) is
    skipped, as the original's check skips it. Interpreter only."""
    from triton.runtime import interpreter

    original = interpreter._patch_builtin
    if getattr(original, "cakeops_patched", False):
        return
    names: dict[int, tuple[object, list[str]]] = {}

    def patch_builtin(pkg, builder, scope):
        known = names.get(id(pkg))
        if known is None or known[0] is not pkg:
            members = inspect.getmembers(pkg)
            known = names[id(pkg)] = (pkg, [n for n, m in members if tl.core.is_builtin(m)])
        for name in known[1]:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    patch_builtin.cakeops_patched = True  # type: ignore[attr-defined]
    interpreter._patch_builtin = patch_builtin


if INTERPRET:
    _interpreter_loop_bounds_on_numpy_2_4()
    _interpreter_patches_builtins_cheaply()


# The interpreter keeps its state in process globals: concurrent calls from several Python
# threads break it, so under the interpreter the ops take turns.
_INTERPRETER_LOCK = threading.RLock()


def serialised(fn):
    """``fn`` as it is on a GPU; under the interpreter, one call at a time."""
    if not INTERPRET:
        return fn

    @functools.wraps(fn)
    def one_at_a_time(*args, **kwargs):
        with _INTERPRETER_LOCK:
            return fn(*args, **kwargs)

    return one_at_a_time


def untuned(fn, heuristics: dict | None = None):
    """``fn`` (a kernel's plain Python function) compiled with no specialisation on the values
    of its sizes and strides or the alignment of its pointers: one binary per config serves
    every shape, for problems too small to tune (their loads need no vectorising). The tuned
    kernel is the same function, specialised and autotuned."""
    params = inspect.signature(fn).parameters.values()
    plain = [p.name for p in params if p.annotation not in (tl.constexpr, "tl.constexpr")]
    kernel = triton.jit(do_not_specialize=plain, do_not_specialize_on_alignment=plain)(fn)
    return triton.heuristics(heuristics)(kernel) if heuristics else kernel


def launch(kernels, grid, args, meta, tuned: bool) -> None:
    """``kernels = (autotuned, untuned)`` (see :func:`untuned`): the autotuned kernel through
    its autotuner, or, for a problem too small to tune, the untuned one with the first config
    its pruning keeps for an unspecialised kernel (``UNTUNED`` among the pruning's arguments:
    no vector loads to count on), and no tuning runs."""
    autotuned, untuned_kernel = kernels
    if tuned:
        autotuned[grid](*args, **meta)
        return
    named = {**dict(zip(autotuned.arg_names, args, strict=False)), "UNTUNED": True}
    configs = autotuned.configs
    prune = autotuned.early_config_prune
    config = ((prune(configs, named, **meta) if prune else None) or configs)[0]
    untuned_kernel[grid](*args, **meta, **config.all_kwargs())


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a stand-in count off the GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SMS


def mma_operands_in_registers() -> bool:
    """Whether the target's 16-bit MMA reads its operands from registers (NVIDIA before sm_90:
    ``mma.sync``) rather than from shared memory (``wgmma``); the interpreter has no target."""
    if INTERPRET:
        return False
    from triton.runtime.driver import driver

    target = driver.active.get_current_target()
    return target.backend == "cuda" and target.arch < 90


def unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a contiguous last dim (a copy only when it has none): the kernels read a row's
    elements as one vector and take every other stride as an argument."""
    return t if t.stride(-1) == 1 else t.contiguous()


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision for float32 operands: TF32 only where the user enabled it."""
    tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and not INTERPRET
    return "tf32" if tf32 else "ieee"


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """``x`` converted to ``dtype``, a float32 ``x`` rounded to nearest even as a GPU does."""
    if EMULATE and dtype == tl.bfloat16 and x.dtype == tl.float32:
        # The bfloat16 bits made by hand (the interpreter's own conversion truncates, and
        # mangles subnormals): round the top half to nearest even; a NaN stays a (quiet) NaN.
        bits = x.to(tl.uint32, bitcast=True)
        top = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        top = tl.where(x != x, (bits >> 16) | 0x40, top)
        return top.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b`` accumulated in float32; 16-bit operands on tensor cores."""
    if EMULATE and a.dtype == tl.bfloat16:
        # exact: bfloat16 values and their products are exact in float32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)
