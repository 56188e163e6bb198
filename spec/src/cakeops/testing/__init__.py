"""The conformance suite: every check an op backend must pass, as a pytest plugin.

Certify a backend (yours or ours) with one command, once its distribution is installed::

    pytest --pyargs cakeops.testing --cakeops-backend=<name> [--cakeops-device=cuda]

The helpers here are shared by the suite's test modules.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch

from cakeops._spec import relative_error, tolerance
from cakeops.measure import SavedTensors, peak_memory  # noqa: F401 (part of this API)

#: Kernels run by an emulator on the CPU (Triton's interpreter, numba's CUDA simulator),
#: thousands of times slower than on a device: the checks whose size is what they test keep a
#: smaller size there, said where they do.
EMULATED = (
    os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, what: str, dtype=None) -> None:
    """``out`` is within the spec's tolerance of the float64 ``ref`` (dtype: ``out.dtype``)."""
    dtype = dtype or out.dtype
    assert out.dtype == dtype, f"{what}: dtype {out.dtype}, expected {dtype}"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    err = relative_error(out, ref)
    tol = tolerance(dtype)
    assert err <= tol, f"{what}: relative error {err:.3g} exceeds the {dtype} tolerance {tol:g}"


def assert_compiled_matches(eager, compiled) -> None:
    """A compiled call's results against the eager call's: the same shapes and dtypes, values
    within the spec's tolerance. Not bit for bit: the kernels are the same, but a GPU's
    reductions may sum in another order for another alignment of the compiled graph's buffers
    (seen on an H200: float32 results 1e-5 apart)."""
    for i, (a, b) in enumerate(zip(eager, compiled, strict=True)):
        assert_matches(b, a, f"compiled result {i}", a.dtype)


def run_with_state(op, reference, tensors, fixed, g_out, g_final, math=False):
    """``(out, final_state or None, *gradients)`` of ``op(**tensors, **fixed)`` (with ``math``,
    of ``reference``'s float64 ``(out, final_state)`` on float64 copies) for the upstream
    gradients ``g_out`` and, when the call asks for the final state, ``g_final``: an op with a
    state's checks."""
    wanted = fixed.get("output_final_state", False)
    if math:
        leaves = {n: t.detach().double().requires_grad_() for n, t in tensors.items()}
        out, final = reference(**leaves, **{n: v for n, v in fixed.items()
                                            if n != "output_final_state"})  # fmt: skip
    else:
        leaves = tensors
        result = op(**leaves, **fixed)
        out, final = result if wanted else (result, None)
    loss = (out.double() * g_out.double()).sum()
    if wanted:
        loss = loss + (final.double() * g_final.double()).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return (out.detach(), final.detach() if wanted else None, *grads)


def check_with_state(op, reference, tensors, fixed, g_out, g_final) -> None:
    """:func:`run_with_state` of the op within the spec's tolerance of its reference: the
    output and the gradients in their inputs' dtypes, the final state in its own."""
    got = run_with_state(op, reference, tensors, fixed, g_out, g_final)
    want = run_with_state(op, reference, tensors, fixed, g_out, g_final, math=True)
    names = ["out", "final_state", *(f"d{n}" for n in tensors)]
    dtypes = [g_out.dtype, None, *(t.dtype for t in tensors.values())]
    for name, a, b, dtype in zip(names, got, want, dtypes, strict=True):
        if a is not None:
            assert_matches(a, b, name, dtype or a.dtype)


def assert_opcheck_and_compile_with_state(op: str, tensors, fixed, g_out, g_final) -> None:
    """``cakeops::<op>`` and its backward pass ``torch.library.opcheck`` with these arguments
    (a final state asked for), and ``torch.compile(fullgraph=True)`` of the public function
    gives the eager output, final state and gradients (:func:`assert_compiled_matches`)."""
    from cakeops.ops import SPECS

    values = SPECS[op].inputs(**tensors, **fixed).values()
    torch.library.opcheck(getattr(torch.ops.cakeops, op).default, tuple(values))
    plain = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in values)
    backward = getattr(torch.ops.cakeops, f"{op}_backward").default
    torch.library.opcheck(backward, (g_out, g_final.float(), *plain))
    public = getattr(importlib.import_module(f"cakeops.ops.{op}"), op)

    def call(fn):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in tensors.items()}
        out, state = fn(**leaves, **fixed)
        loss = (out * g_out).sum() + (state * g_final.float()).sum()
        return (out, state, *torch.autograd.grad(loss, list(leaves.values())))

    torch._dynamo.reset()
    eager = call(public)
    compiled = call(torch.compile(public, fullgraph=True))
    assert_compiled_matches(eager, compiled)


def reference_outputs(
    math: Callable[..., torch.Tensor],
    tensors: Mapping[str, torch.Tensor],
    params: Sequence,
    grad_output: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and gradients of the float64 reference by autograd (not a hand-written backward)."""
    leaves = {k: v.detach().to(torch.float64).requires_grad_() for k, v in tensors.items()}
    with torch.enable_grad():
        out = math(*leaves.values(), *params)
        grads = torch.autograd.grad(out, list(leaves.values()), grad_output.to(torch.float64))
    return out.detach(), dict(zip(leaves, grads, strict=True))


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same memory viewed the same way (no copy)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def tensors_on_ctx(grad_fn) -> list[str]:
    """Names of attributes of an autograd node's context that hold tensors (should be none)."""

    def has_tensor(value) -> bool:
        if isinstance(value, torch.Tensor):
            return True
        if isinstance(value, (list, tuple)):
            return any(has_tensor(v) for v in value)
        if isinstance(value, dict):
            return any(has_tensor(v) for v in value.values())
        return False

    return [k for k, v in vars(grad_fn).items() if has_tensor(v)]


def run_with_grads(
    fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor], g: torch.Tensor
):
    """``fn(*tensors)`` detached, followed by the gradients of each tensor for ``g``."""
    out = fn(*tensors)
    return (out.detach(), *torch.autograd.grad(out, tensors, g))


def assert_autocast_changes_nothing(
    fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor], g: torch.Tensor
) -> None:
    """Inside a bfloat16 autocast region, float32 ``tensors`` give exactly the float32 results
    and gradients they give outside it (the ops have no autocast rule)."""
    plain = run_with_grads(fn, tensors, g)
    with torch.autocast(tensors[0].device.type, dtype=torch.bfloat16):
        cast = run_with_grads(fn, tensors, g)
    for a, b in zip(plain, cast, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def assert_default_dtype_changes_nothing(run: Callable[[], Sequence[Any]]) -> None:
    """Under PyTorch's default dtype set to bfloat16 (as many inference scripts do) or
    float64, ``run()`` (a call of an op on float32 inputs, returning its results and
    gradients) gives exactly what it gives under float32's: no kernel allocates what it
    computes in with the default dtype. Under an emulator bfloat16 alone (a scratch tensor
    taking the default dtype shows there too, by error or rounding)."""
    plain = run()
    previous = torch.get_default_dtype()
    for default in (torch.bfloat16,) if EMULATED else (torch.bfloat16, torch.float64):
        torch.set_default_dtype(default)
        try:
            got = run()
        finally:
            torch.set_default_dtype(previous)
        assert len(got) == len(plain)
        for a, b in zip(plain, got, strict=True):
            same = (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
            assert same, f"under the default {default}"


def assert_func_grad_matches_autograd(
    fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor], g: torch.Tensor
) -> None:
    """``torch.func.grad`` of ``sum(fn(*tensors) * g)`` gives exactly the gradients
    ``torch.autograd.grad`` gives for ``g`` (the same backward, the same upstream gradient)."""
    plain = run_with_grads(fn, tensors, g)[1:]
    detached = tuple(t.detach() for t in tensors)
    argnums = tuple(range(len(tensors)))
    grads = torch.func.grad(lambda *t: (fn(*t) * g).sum(), argnums=argnums)(*detached)
    for name, a, b in zip(range(len(tensors)), plain, grads, strict=True):
        assert torch.equal(a, b), f"torch.func.grad differs from autograd for argument {name}"


def assert_bad_input_raises(
    op: str, call: Callable[[], Any], error: type[Exception], argument: str
) -> None:
    """``call()`` raises ``error`` with the spec's message: the op, the argument, what was
    expected and what came."""
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{op}: argument '{argument}' expected"), message
    assert "got" in message, message


def assert_saves_exactly(fn: Callable[..., torch.Tensor], tensors: Sequence[torch.Tensor], names):
    """The autograd graph of ``fn(*tensors)`` holds exactly ``tensors`` and nothing on its ctx."""
    with SavedTensors() as saved:
        out = fn(*tensors)
    assert len(saved.packed) == len(tensors), (
        f"saved {len(saved.packed)} tensors, the contract is {', '.join(names)}"
    )
    for got, want, name in zip(saved.packed, tensors, names, strict=True):
        assert same_tensor(got, want), f"saved tensor for {name} is not the input itself"
    assert tensors_on_ctx(out.grad_fn) == []
    return out
