"""The experts' activations in plain PyTorch: what the float64 oracle computes and what the
Hugging Face integration probes a model's activation against (one table, owned by the spec)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: act(g) of each activation name, in plain PyTorch (``silu`` takes its slope ``alpha``)
ACT = {
    "silu": lambda g, alpha: g * torch.sigmoid(alpha * g),
    "gelu": lambda g, alpha: F.gelu(g),
    "gelu_tanh": lambda g, alpha: F.gelu(g, approximate="tanh"),
    "relu": lambda g, alpha: F.relu(g),
    "relu2": lambda g, alpha: F.relu(g).square(),
}


def gated(gate, up, activation="silu", alpha=1.0, limit=None, up_offset=0.0):
    """``h`` from the gate and up pre-activations: ``act(min(gate, L)) * (clamp(up, -L, L) +
    up_offset)``."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return ACT[activation](gate, alpha) * (up + up_offset)
