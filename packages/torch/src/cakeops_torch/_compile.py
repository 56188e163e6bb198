"""The torch backend's inductor-compiled CPU paths: one fused loop where the eager code makes a
dozen elementwise passes over memory, with that eager code as the fallback.

Each op decides when its inputs are big enough to gain (:func:`use_compiled`) and runs a plain
function of tensors through :func:`run_compiled`. Rows (dim 0 of 2-D tensors) are marked dynamic,
so a new row count does not recompile. ``CAKEOPS_TORCH_COMPILE=0`` turns every compiled path off
(another value than ``0`` or ``1`` is an error);
if compiling fails (no C++ compiler, an unsupported Python), a warning says so once and the eager
code runs from then on.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from cakeops._spec import env_flag

COMPILE_ENV = "CAKEOPS_TORCH_COMPILE"
_COMPILED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: why compiling failed, once it has: the compiled paths are then off for the process
_compile_error: str | None = None
_RECOMPILE_LIMIT = (
    "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
)
#: what :func:`run_compiled` returns when the compiler failed
FAILED = object()


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


def use_compiled(x: torch.Tensor, min_elements: int) -> bool:
    """Whether ``x`` (the tensor that sizes the work) takes the compiled path."""
    return (
        _compile_error is None
        and x.device.type == "cpu"
        and x.dtype in _COMPILED_DTYPES
        and x.numel() >= min_elements
        and env_flag(COMPILE_ENV, True)
    )


def _compiler_errors() -> tuple[type[BaseException], ...]:
    """What a failing ``torch.compile`` raises: dynamo's exceptions (inductor's wrapped in them)
    and a C++/CUDA compile error raised as is. Anything else (out of memory, bad input) is the
    caller's and propagates."""
    import torch._dynamo.exc
    import torch._inductor.exc

    names = ("CppCompileError", "CUDACompileError")
    return (
        torch._dynamo.exc.TorchDynamoException,
        *(getattr(torch._inductor.exc, n) for n in names if hasattr(torch._inductor.exc, n)),
    )


def run_compiled(op: str, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` compiled, its 2-D tensors' rows marked dynamic; :data:`FAILED` if compiling
    failed (``op`` names the op in the warning)."""
    global _compile_error
    for t in args:
        if isinstance(t, torch.Tensor) and t.dim() == 2:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    # Each dtype, width and variant is a graph of its own: allow more of them than dynamo's
    # default before it gives up compiling a function (set and restored directly: the config's
    # patch() context costs a decode step's call more than its math).
    config = torch._dynamo.config
    limit = getattr(config, _RECOMPILE_LIMIT)
    try:
        setattr(config, _RECOMPILE_LIMIT, max(limit, 64))
        return _compiled(fn)(*args)
    except _compiler_errors() as e:  # the compiler failed: use the eager code from now on
        _compile_error = f"{type(e).__name__}: {e}"
        warnings.warn(
            f"cakeops-torch: torch.compile of {op} failed, using the eager kernels "
            f"({_compile_error.splitlines()[0]})",
            RuntimeWarning,
            stacklevel=3,
        )
        return FAILED
    finally:
        setattr(config, _RECOMPILE_LIMIT, limit)
