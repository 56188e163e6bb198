"""What every op spec shares: dtypes, tolerances, the error measure and argument errors."""

from __future__ import annotations

import itertools
import math
import os
import sys
from typing import Any

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Normwise relative error ``||out - ref|| / ||ref||`` allowed against the float64 reference.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision every op computes in for inputs of ``dtype``: float64 for float64, else
    float32 (16-bit inputs are loaded as they are and accumulated in float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tolerance(dtype: torch.dtype) -> float:
    """The spec's tolerance for results of ``dtype``."""
    return TOLERANCES[dtype]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Normwise relative error of ``out`` against ``ref``, in float64.

    NaN and Inf must sit where the reference has them (else the error is ``inf``); the norm is
    taken over the finite entries. A zero reference gives the absolute error.
    """
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}")
    out = out.detach().to("cpu", torch.float64)
    ref = ref.detach().to("cpu", torch.float64)
    finite = torch.isfinite(ref)
    same_nonfinite = torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.equal(
        out[torch.isinf(ref)], ref[torch.isinf(ref)]
    )
    if not same_nonfinite or not torch.isfinite(out[finite]).all():
        return math.inf
    diff = torch.linalg.vector_norm(out[finite] - ref[finite]).item()
    scale = torch.linalg.vector_norm(ref[finite]).item()
    return diff / scale if scale > 0 else diff


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe(value: Any) -> str:
    """A short description of an argument for error messages."""
    if isinstance(value, torch.Tensor):
        return f"a {dtype_name(value.dtype)} tensor of shape {tuple(value.shape)} on {value.device}"
    return f"{type(value).__name__} {value!r}"


def check_no_forward_ad(op: str, tensors: dict[str, torch.Tensor]) -> None:
    """Forward-mode AD (``torch.func.jvp``, ``torch.autograd.forward_ad``) is refused with a
    clear error: the ops define reverse mode only, and a silent zero tangent would be wrong."""
    if torch.compiler.is_compiling():
        return
    from torch.autograd.forward_ad import unpack_dual

    for name, value in tensors.items():
        if isinstance(value, torch.Tensor) and unpack_dual(value).tangent is not None:
            raise NotImplementedError(
                f"{op}: forward-mode AD is not supported (argument '{name}' carries a tangent); "
                "use reverse mode (loss.backward() or torch.autograd.grad) instead"
            )


def check_tensor(op: str, name: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: argument '{name}' expected a torch.Tensor, got {describe(value)}")


def check_float_dtype(op: str, name: str, value: torch.Tensor, allowed=FLOAT_DTYPES) -> None:
    if value.dtype not in allowed:
        names = ", ".join(dtype_name(d) for d in allowed)
        raise TypeError(
            f"{op}: argument '{name}' expected dtype {names}, got {dtype_name(value.dtype)}"
        )


def check_dtype_like(op: str, name: str, value: torch.Tensor, ref_name: str, ref: torch.Tensor):
    if value.dtype != ref.dtype:
        raise TypeError(
            f"{op}: argument '{name}' expected dtype {dtype_name(ref.dtype)} (the dtype of "
            f"{ref_name}), got {dtype_name(value.dtype)}"
        )


def check_same_device(op: str, tensors: dict[str, torch.Tensor]) -> None:
    (first, ref), *rest = tensors.items()
    for name, value in rest:
        if value.device != ref.device:
            raise ValueError(
                f"{op}: argument '{name}' expected to be on {ref.device} like '{first}', "
                f"got {value.device}"
            )


def check_number(op: str, name: str, value: Any) -> float:
    """A real number (not a bool, not a tensor), returned as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: argument '{name}' expected a float, got {describe(value)}")
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range (10**400)
        raise ValueError(
            f"{op}: argument '{name}' expected a number within the float range (magnitude "
            f"below {sys.float_info.max:.4g}), got an int of {value.bit_length()} bits"
        ) from None


#: ``1``: the log multipliers' values are checked on a GPU too (a host synchronisation per call;
#: a CPU's are always checked); ``0`` or unset: not there.
CHECK_VALUES_ENV = "CAKEOPS_CHECK_VALUES"


def env_flag(name: str, default: bool) -> bool:
    """The switch in environment variable ``name``: ``1`` on, ``0`` off, unset or empty
    ``default``; anything else a ``ValueError`` (``false`` or ``off`` must not read as on)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    if raw.strip() in ("0", "1"):
        return raw.strip() == "1"
    raise ValueError(f"cakeops: environment variable {name} expected 0 or 1, got {raw!r}")


def device_values_checked() -> bool:
    """Whether :data:`CHECK_VALUES_ENV` asks for the checks that read a GPU tensor's values."""
    return env_flag(CHECK_VALUES_ENV, False)


def readable(t: torch.Tensor, on_device: bool) -> bool:
    """Whether a check may read ``t``'s values on the host: always on a CPU; on another device
    when ``on_device`` (a read costs a synchronisation there), never while a CUDA graph is being
    captured (a read would break it), nor for a fake or meta tensor (no values)."""
    if t.device.type == "cpu":
        if type(t) is torch.Tensor:
            return True
        from torch._subclasses.fake_tensor import is_fake

        return not is_fake(t)
    if not on_device or t.device.type == "meta":
        return False
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(t):
        return False
    return not (t.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def check_cu_seqlens(op: str, cu: torch.Tensor, N: int, L: int) -> int:
    """Packed sequences' offsets (``(S + 1,)`` int32/int64, sorted from 0 to ``L``, ``N = 1``);
    returns ``S``. The values are read on the host on every device (on a GPU, a
    synchronisation: offsets past ``L`` would make a kernel read and write out of bounds),
    except while a CUDA graph is captured."""
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: argument 'cu_seqlens' expected dtype int32 or int64, got "
                        f"{dtype_name(cu.dtype)}")  # fmt: skip
    if cu.dim() != 1 or cu.numel() < 2 or N != 1:
        raise ValueError(f"{op}: argument 'cu_seqlens' expected offsets (S + 1,) with N = 1, "
                         f"got shape {tuple(cu.shape)} with N = {N}")  # fmt: skip
    if readable(cu, on_device=True):
        values = cu.tolist()  # one read (on a GPU, one synchronisation) for every check
        if values[0] != 0 or values[-1] != L or any(b < a for a, b in itertools.pairwise(values)):
            raise ValueError(f"{op}: argument 'cu_seqlens' expected sorted offsets from 0 to "
                             f"L = {L}, got {values}")  # fmt: skip
    return cu.numel() - 1


def check_states(op: str, a: Any, N: int, L: int, state_shape: tuple[int, ...]) -> None:
    """Packed sequences' offsets (``a.cu_seqlens``) and the initial state ``a.initial_state``
    of shape ``(sequences, *state_shape)``, float."""
    sequences = N if a.cu_seqlens is None else check_cu_seqlens(op, a.cu_seqlens, N, L)
    s0 = a.initial_state
    if s0 is None:
        return
    check_float_dtype(op, "initial_state", s0)
    want = (sequences, *state_shape)
    if tuple(s0.shape) != want:
        raise ValueError(f"{op}: argument 'initial_state' expected shape {want}, got "
                         f"{tuple(s0.shape)}")  # fmt: skip


#: A CPU tensor of at most this many log multipliers is checked from its values as a list (a
#: decode step's decay or gates: a reduction and ``.item()`` cost twice that with caches cold).
LISTED_VALUES = 64


def check_log_multipliers(op: str, name: str, t: torch.Tensor) -> None:
    """Logs of multipliers are ``<= 0``: checked on a CPU tensor, on a GPU's only with
    :data:`CHECK_VALUES_ENV` set (a decode step's check would wait for the device; a positive
    value there grows the state, reads nothing out of bounds)."""
    if t.is_cpu and type(t) is torch.Tensor and t.numel() <= LISTED_VALUES:
        values = t.tolist() if t.dim() == 1 else t.reshape(-1).tolist()
        top = max(values, default=0.0)
        # a NaN maximum hides whether a positive value is there too: then each value decides
        if top > 0 or (math.isnan(top) and any(v > 0 for v in values)):
            bad = max(v for v in values if v > 0)
            raise ValueError(f"{op}: argument '{name}' expected log multipliers <= 0, got "
                             f"{bad}")  # fmt: skip
        return
    if not t.numel() or not readable(t, t.is_cpu or device_values_checked()):
        return
    # one reduction (a decode step's few values: a third of any() of a comparison); a NaN
    # maximum hides whether a positive value is there too: then the comparison decides
    top = t.max().item()
    if top > 0 or (math.isnan(top) and bool((t > 0).any())):
        bad = t.masked_fill(t.isnan(), -math.inf).max().item() if math.isnan(top) else top
        raise ValueError(f"{op}: argument '{name}' expected log multipliers <= 0, got "
                         f"{bad}")  # fmt: skip


def state_no_work(a: Any) -> bool:
    """Nothing to compute for an op with states (``q``, ``v``, ``initial_state``,
    ``output_final_state``): no element in q or v, unless L = 0 hands initial states on as
    final ones whose gradient then reaches them."""
    if a.q.numel() and a.v.numel():
        return False
    handed_on = a.q.shape[2] == 0 and a.initial_state is not None and a.output_final_state
    return not (handed_on and a.initial_state.numel())


def state_without_work(a: Any, final_state: Any) -> torch.Tensor:
    """The final state of a call with nothing to compute: the initial state (or zeros), of the
    shape and dtype ``final_state(a)`` gives."""
    shape, dtype = final_state(a)
    if a.initial_state is None:
        return torch.zeros(shape, dtype=dtype, device=a.selecting.device)
    return a.initial_state.to(dtype).clone()
