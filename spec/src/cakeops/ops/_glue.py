"""What every op's custom-op glue shares: picking the backend and checking what it returns."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from typing import Any

import torch

from cakeops import _spec
from cakeops.registry import Backend, select, use_backend

# op -> the backend that ran this thread's latest forward of it (read by setup_context, which
# runs right after the forward, on the same thread)
_forward_choice = threading.local()


def pick(op: str, inputs: Mapping[str, Any], preference: str = "") -> Backend:
    """The backend for ``inputs``; ``preference`` (a comma list) is forced when given. A call
    without one (a forward) is remembered for :func:`backward_preference`."""
    if not preference:
        chosen = select(op, inputs)
        _forward_choice.__dict__[op] = chosen.name
        return chosen
    with use_backend(preference, op=op):
        return select(op, inputs)


def run_kernel(backend: Backend, op: str, kind: str, *args: Any) -> Any:
    """``backend``'s ``forward`` or ``backward`` kernel for ``op`` with autocast off: the kernels
    compute in their inputs' dtypes whatever autocast region surrounds the op (the ops have no
    autocast rule, like a custom op: cast the inputs to run them in 16-bit), forward and backward
    alike."""
    kernel = getattr(backend.kernels(op), kind)
    devices = {a.device.type for a in args if isinstance(a, torch.Tensor)}
    with contextlib.ExitStack() as stack:
        for device in devices & {"cpu", "cuda", "xpu", "mps"}:
            stack.enter_context(torch.autocast(device, enabled=False))
        return kernel(*args)


def backward_preference(op: str) -> str:
    """What ``setup_context`` records so the backward runs the forward's backend.

    The backend that ran the forward, whatever chose it (a ``use_backend()`` context, an
    environment variable or the priorities): an eager backward may run on another thread
    (CUDA), where that context is not visible, and the environment may have changed since. A
    compiled graph is cached and reused across contexts, so under ``torch.compile`` nothing is
    baked in and the backward selects again when it runs.
    """
    if torch.compiler.is_compiling():
        return ""
    return _forward_choice.__dict__.get(op, "")


def autograd_function(op: str, setup_context, backward) -> type:
    """The ``torch.autograd.Function`` the public function calls: the custom op forward,
    ``setup_context`` and ``backward`` of the op (the custom op's own autograd registration serves
    direct callers of ``torch.ops.cakeops``). PyTorch's generated Function for a custom op defines
    no ``setup_context``, so ``torch.func.grad``, ``vjp`` and ``jacrev`` refuse it
    (pytorch/pytorch#170834); this one does, and its vmap rule is generated. ``op`` names the
    custom op (``cakeops::<op>``) its forward calls."""
    overload = getattr(torch.ops.cakeops, op).default
    return type(
        f"{op}_function",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(lambda *args: overload(*args)),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
            "generate_vmap_rule": True,
        },
    )


def apply(function: type, custom_op: Any, *args: Any) -> Any:
    """``function.apply(*args)``, eagerly; while compiling, the ``custom_op`` it wraps (with the
    op's registered autograd), which Dynamo traces as one node."""
    if torch.compiler.is_compiling():
        return custom_op(*args)
    return function.apply(*args)


def backward_function(op: str) -> type:
    """The Function around an op's backward custom op, so that a backward run with
    ``create_graph=True`` (as ``torch.func.grad`` does) works and a second derivative through it
    is a clear error instead of a silent zero."""

    def no_double_backward(ctx, *grads):
        raise NotImplementedError(
            f"{op}: second derivatives (backward of the backward) are not supported"
        )

    return autograd_function(f"{op}_backward", lambda ctx, inputs, output: None, no_double_backward)


def checked(op: str, backend: Backend, name: str, got: torch.Tensor, like: torch.Tensor):
    """``got`` made contiguous, after checking it has ``like``'s shape, dtype and device."""
    if got.shape != like.shape or got.dtype != like.dtype or got.device != like.device:
        raise RuntimeError(
            f"{op}: backend {backend.name!r} returned {name} as {_spec.describe(got)}, expected "
            f"{_spec.dtype_name(like.dtype)} of shape {tuple(like.shape)} on {like.device}"
        )
    return got.contiguous()
