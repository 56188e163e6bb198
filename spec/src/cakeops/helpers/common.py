"""What every op's kernels share: each gradient in its input's dtype (:func:`cast_grads`), a tensor
in a dtype without a no-op ``.to`` (:func:`as_dtype`), a host list of indices as a tensor,
cheaply (:func:`index_tensor`)."""

from __future__ import annotations

import array

import torch


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: ``t`` itself when it already is (a no-op ``.to`` still costs a decode
    step's call a microsecond or two)."""
    return t if t.dtype == dtype else t.to(dtype)


def index_tensor(values: list[int], device: torch.device | str | None = None) -> torch.Tensor:
    """The int64 tensor of a host list of ints, through the list's bytes: ``torch.tensor(list)``
    inspects each element for its type, several times the cost, a bookkeeping step's share of
    a small call."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    t = torch.frombuffer(array.array("q", values), dtype=torch.int64)  # keeps the array alive
    return t if device is None else t.to(device)


def cast_grads(grads, inputs) -> tuple[torch.Tensor, ...]:
    """Each gradient in the dtype of the input it belongs to (a no-op where it already is; None
    for an optional input not given)."""
    return tuple(None if t is None else g.to(t.dtype) for g, t in zip(grads, inputs, strict=True))
