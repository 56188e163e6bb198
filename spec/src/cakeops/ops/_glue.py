"""What every op's custom-op glue shares: picking the backend and checking what it returns."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cakeops import _spec
from cakeops.registry import Backend, forced_choice, select, use_backend


def pick(op: str, inputs: Mapping[str, Any], preference: str = "") -> Backend:
    """The backend for ``inputs``; ``preference`` (a comma list) is forced when given."""
    if not preference:
        return select(op, inputs)
    with use_backend(preference, op=op):
        return select(op, inputs)


def backward_preference(op: str) -> str:
    """What ``setup_context`` records so the backward runs the forward's backend.

    An eager backward may run on another thread (CUDA), where a ``use_backend()`` context is not
    visible, so the explicit choice in force at the forward is recorded. A compiled graph is
    cached and reused across contexts, so under ``torch.compile`` nothing is baked in and the
    backward selects again when it runs.
    """
    if torch.compiler.is_compiling():
        return ""
    forced = forced_choice(op)
    return ",".join(forced[0]) if forced else ""


def checked(op: str, backend: Backend, name: str, got: torch.Tensor, like: torch.Tensor):
    """``got`` made contiguous, after checking it has ``like``'s shape, dtype and device."""
    if got.shape != like.shape or got.dtype != like.dtype or got.device != like.device:
        raise RuntimeError(
            f"{op}: backend {backend.name!r} returned {name} as {_spec.describe(got)}, expected "
            f"{_spec.dtype_name(like.dtype)} of shape {tuple(like.shape)} on {like.device}"
        )
    return got.contiguous()
