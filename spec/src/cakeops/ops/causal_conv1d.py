"""Spec of ``causal_conv1d``: the depthwise causal convolution that Mamba2 and Gated DeltaNet
layers run before their scans (``causal_conv1d_fn`` / ``causal_conv1d_update``).

Per channel ``c``, with a kernel of width ``W`` and ``x`` extended to the left by the
initial state (the sequence's ``W - 1`` previous inputs, zeros when not given)::

    y[c, t] = act(bias[c] + sum_j weight[c, j] * x[c, t - (W - 1) + j])

``act`` is the identity or SiLU. The final state is the last ``W - 1`` inputs of the extended
sequence, so that a call continuing from it gives what the whole sequence gives (decoding).
Layout ``(N, C, L)`` as the models pass it; strided views are accepted, so Hugging Face's
``(N, L, C)`` tensors come in as ``x.transpose(1, 2)`` without a copy. With ``cu_seqlens``
(``N = 1``) no window crosses a sequence's start: each sequence starts from its own state.

Backends implement :class:`Kernels` (arguments validated, activation ``None`` or ``"silu"``).
Saved-tensor contract: exactly the tensor inputs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
from torch import Tensor

from cakeops import _spec, opspec
from cakeops.opspec import NO_GRAD, OpInputs, OpSpec

OP = "causal_conv1d"

#: the activations the op takes (``"swish"`` is SiLU's other name: causal-conv1d takes both)
ACTIVATIONS = (None, "silu", "swish")


@dataclasses.dataclass(frozen=True, eq=False)
class Inputs(OpInputs):
    """The arguments, in order: ``x`` ``(N, C, L)``, ``weight`` ``(C, W)``, ``bias`` ``(C,)``;
    keyword-only: ``activation``, ``initial_state`` ``(sequences, C, W - 1)``,
    ``output_final_state``, ``cu_seqlens``."""

    op = OP
    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    _: dataclasses.KW_ONLY
    activation: str | None = None
    initial_state: torch.Tensor | None = None
    output_final_state: bool = False
    cu_seqlens: torch.Tensor | None = dataclasses.field(default=None, metadata=NO_GRAD)


#: What a backend's ``causal_conv1d`` kernel module defines: ``forward(x, weight, bias,
#: activation, initial_state, output_final_state, cu_seqlens) -> (out, final_state)`` (an empty
#: tensor when not asked for) and ``backward(g_out, g_final, ...same...) -> (dx, dweight, dbias,
#: dinitial_state)`` (None for a bias or an initial state not given; ``g_final`` empty when the
#: final state has no gradient). ``activation`` is None or ``"silu"``. Inputs and upstream
#: gradients may have any strides.
Kernels = opspec.Kernels[
    Callable[..., tuple[Tensor, Tensor]], Callable[..., tuple[Tensor | None, ...]]
]


def check(a: Inputs) -> Inputs:
    """The op's own checks (after the type checks); ``"swish"`` becomes ``"silu"``."""
    if a.x.dim() != 3:
        raise ValueError(f"{OP}: argument 'x' expected 3 dimensions (N, C, L), got shape "
                         f"{tuple(a.x.shape)}")  # fmt: skip
    _spec.check_float_dtype(OP, "x", a.x)
    N, C, L = a.x.shape
    for name in ("weight", "bias"):
        t = a[name]
        if t is not None and t.dtype not in (a.x.dtype, torch.float32):
            raise TypeError(
                f"{OP}: argument '{name}' expected dtype {_spec.dtype_name(a.x.dtype)} (the "
                f"dtype of x) or float32, got {_spec.dtype_name(t.dtype)}"
            )
    _spec.check_same_device(OP, a.tensors)
    if a.weight.dim() != 2 or a.weight.shape[0] != C or a.weight.shape[1] < 1:
        raise ValueError(f"{OP}: argument 'weight' expected shape ({C}, W) with W >= 1 (the C "
                         f"of x), got {tuple(a.weight.shape)}")  # fmt: skip
    if a.bias is not None and tuple(a.bias.shape) != (C,):
        raise ValueError(f"{OP}: argument 'bias' expected shape ({C},), got "
                         f"{tuple(a.bias.shape)}")  # fmt: skip
    if a.activation not in ACTIVATIONS:
        raise ValueError(f"{OP}: argument 'activation' expected None, 'silu' or 'swish', got "
                         f"{a.activation!r}")  # fmt: skip
    _spec.check_states(OP, a, N, L, (C, a.weight.shape[1] - 1))
    if a.activation == "swish":
        return dataclasses.replace(a, activation="silu")
    return a


def check_data(a: Inputs) -> None:
    """The check of :func:`check` that reads values: sorted offsets."""
    if a.cu_seqlens is not None:
        _spec.check_cu_seqlens(OP, a.cu_seqlens, a.x.shape[0], a.x.shape[2])


def example(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Inputs:
    """Small valid inputs (Mamba2's width 4), for ``cakeops info`` and smoke tests."""
    x = torch.randn(2, 16, 10, device=device, dtype=dtype)
    weight = torch.randn(16, 4, device=device, dtype=dtype) * 0.5
    bias = torch.randn(16, device=device, dtype=dtype) * 0.1
    return Inputs(x, weight, bias, activation="silu")


def _final_state(a: Inputs):
    """The final state's shape and dtype when the call asks for it: the initial state's dtype,
    else x's (it holds inputs)."""
    if not a.output_final_state:
        return None
    N, C, _ = a.x.shape
    sequences = N if a.cu_seqlens is None else a.cu_seqlens.numel() - 1
    dtype = a.x.dtype if a.initial_state is None else a.initial_state.dtype
    return (sequences, C, a.weight.shape[1] - 1), dtype


def _no_work(a: Inputs) -> bool:
    """No element in x, unless an empty sequence hands a non-empty initial state on as its
    final state (whose gradient then reaches it)."""
    if a.x.numel():
        return False
    s0 = a.initial_state
    return not (a.output_final_state and s0 is not None and s0.numel() and a.x.shape[2] == 0)


SPEC = OpSpec(
    inputs=Inputs,
    check=check,
    check_data=check_data,
    no_work=_no_work,
    example=example,
    second=_final_state,
    second_flag="output_final_state",
    second_no_work=functools.partial(_spec.state_without_work, final_state=_final_state),
    contiguous_grads=False,  # the models' output is a transposed view: so is its gradient
    output_layout_of="x",  # and the output, laid out like x, is one when x is
)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
):
    """Depthwise causal convolution: ``act(bias + sum_j weight[:, j] x[:, t - W + 1 + j])``.

    ``x`` is ``(N, C, L)`` (any strides), ``weight`` ``(C, W)``, ``bias`` ``(C,)``;
    ``activation`` None or ``"silu"``. ``initial_state`` ``(sequences, C, W - 1)`` holds each
    sequence's previous inputs (zeros when None); with ``output_final_state`` returns
    ``(out, final_state)``, the last ``W - 1`` inputs of each sequence, to continue from.
    ``cu_seqlens`` packs sequences in ``N = 1``. Computes in float32 (float64 for float64) and
    returns ``x.dtype``. Saves only its tensor inputs.
    """
    return SPEC.call(x, weight, bias, activation, initial_state, output_final_state, cu_seqlens)
