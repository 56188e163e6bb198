"""``causal_conv1d``: each sequence's place (:func:`conv_sequences`), the final state gathered
from the inputs (:func:`conv_final_state`) and the initial state's gradient
(:func:`conv_initial_state_grad`), for kernels that compute the positions only."""

from __future__ import annotations

from typing import NamedTuple

import torch


class ConvSequences(NamedTuple):
    """Each sequence of a ``causal_conv1d`` call: its batch row, first position and length,
    ``(S,)`` int64 on x's device (computed there: no synchronisation)."""

    row: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor


def conv_sequences(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> ConvSequences:
    N, _, L = x.shape
    if cu_seqlens is None:
        rows = torch.arange(N, device=x.device)
        return ConvSequences(rows, torch.zeros_like(rows), torch.full_like(rows, L))
    cu = cu_seqlens.to(torch.long)
    return ConvSequences(torch.zeros_like(cu[1:]), cu[:-1], cu[1:] - cu[:-1])


def _conv_taps(x, width, cu_seqlens):
    """The sequences, and per sequence the positions ``length - (W - 1) + k`` of the final
    state's ``W - 1`` slots (negative: a slot of the initial state)."""
    seqs = conv_sequences(x, cu_seqlens)
    k = torch.arange(width - 1, device=x.device)
    return seqs, k, seqs.length[:, None] - (width - 1) + k


def _gather_positions(t: torch.Tensor, seqs: ConvSequences, p: torch.Tensor) -> torch.Tensor:
    """``t[row, :, start + p]`` for each sequence and each ``p`` ``(S, P)`` (zeros where ``p`` is
    outside the sequence), as ``(S, C, P)``."""
    inside = (p >= 0) & (p < seqs.length[:, None])
    if t.shape[2] == 0:
        return t.new_zeros(p.shape[0], t.shape[1], p.shape[1])
    index = (seqs.start[:, None] + p).clamp(0, t.shape[2] - 1)
    picked = t[seqs.row[:, None], :, index]  # (S, P, C)
    return picked.masked_fill(~inside[..., None], 0).transpose(1, 2)


def conv_final_state(x, initial_state, width: int, cu_seqlens, dtype) -> torch.Tensor:
    """``causal_conv1d``'s final state ``(sequences, C, W - 1)`` in ``dtype``: each sequence's
    last ``W - 1`` inputs, reaching into its initial state (or zeros) when it is shorter."""
    seqs, k, p = _conv_taps(x, width, cu_seqlens)
    final = _gather_positions(x, seqs, p).to(dtype)
    if initial_state is not None:
        # slot k of the final state is slot length + k of the initial one when p < 0
        slot = (seqs.length[:, None] + k).clamp(max=max(width - 2, 0))
        sequence = torch.arange(slot.shape[0], device=x.device)[:, None]
        past = initial_state[sequence, :, slot].transpose(1, 2).to(dtype)
        final = torch.where((p < 0)[:, None, :], past, final)
    return final.contiguous()


def conv_initial_state_grad(dpre, weight, g_final, cu_seqlens) -> torch.Tensor:
    """``causal_conv1d``'s initial-state gradient ``(sequences, C, W - 1)`` in float32, from
    the pre-activation's gradient ``dpre`` ``(N, C, L)`` (slot ``k`` feeds position ``k - j``
    through tap ``j``) and the final state's gradient ``g_final`` (empty: none), which reaches
    the slots a sequence shorter than the state hands on."""
    width = weight.shape[1]
    seqs, k, p = _conv_taps(dpre, width, cu_seqlens)
    first = _gather_positions(dpre, seqs, k[None, :].expand(p.shape[0], -1)).float()
    w = weight.float()
    grad = torch.zeros_like(first)
    for slot in range(width - 1):
        for j in range(slot + 1):
            grad[:, :, slot] += w[:, j] * first[:, :, slot - j]
    if g_final.numel():
        slot = seqs.length[:, None] + k
        handed = (slot <= width - 2)[:, None, :]
        index = slot.clamp(max=width - 2)[:, None, :].expand_as(grad)
        grad.scatter_add_(2, index, g_final.float().masked_fill(~handed, 0))
    return grad
