"""Expert parallelism: :func:`routed_experts` with the experts sharded across the ranks of a
``torch.distributed`` process group.

Layout: each of the ``W`` ranks holds its own tokens and a contiguous block of ``E / W``
experts, rank ``r`` the global ids ``[r E/W, (r+1) E/W)``; the weights a rank passes are its
block. ``top_k_index`` holds global ids (``>= E``: a dropped slot, as in the single-process op).

A call makes two all-to-all exchanges of token rows: each kept ``(token, slot)`` row goes to the
rank that owns its expert (sorted by destination, with its local expert id), runs through that
rank's :func:`cakeops.routed_experts` with weight one, and the expert outputs come back in a
second all-to-all; the combine ``out_t = sum_s w_ts y_ts`` runs at home, in slot order. Autograd
flows back through both exchanges (each the reverse all-to-all of the other): ``x``, the local
experts' weights and biases, and ``top_k_weights``. Only the split sizes cross to the host
(one small all-to-all of counts); rows never do.

Gradients: each rank's expert weights receive the gradients of every rank's tokens, the sum of
all the ranks' losses. A data-parallel setup that averages the other parameters' gradients
over ranks (DDP, FSDP2) should divide the expert gradients by the world size too (or scale
what it sums), as :func:`scale_expert_grads` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cakeops.ops.routed_experts import routed_experts as _routed_experts

OP = "distributed.routed_experts"


def _all_to_all(rows: torch.Tensor, split_in: list[int], split_out: list[int], group):
    """Rows ``split_in`` to each rank, ``split_out`` from each."""
    out = rows.new_empty((sum(split_out), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), split_out, split_in, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """:func:`_all_to_all` with autograd: the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, split_in: list[int], split_out: list[int], group):
        ctx.splits, ctx.group = (split_in, split_out), group
        return _all_to_all(rows, split_in, split_out, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        split_in, split_out = ctx.splits
        return _all_to_all(grad, split_out, split_in, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, split_in: list[int], split_out: list[int], group):
    if rows.requires_grad:
        return _AllToAll.apply(rows, split_in, split_out, group)
    return _all_to_all(rows, split_in, split_out, group)


def _check(x, top_k_index, top_k_weights, w_up, group) -> int:
    """The world size, after the checks the single-process op does not make (it checks the
    rest when it runs)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{OP}: torch.distributed is not initialised (init_process_group)")
    if not isinstance(w_up, torch.Tensor) or w_up.dim() != 3:
        raise ValueError(f"{OP}: argument 'w_up' expected this rank's (E/W, F, D) experts")
    for name, t in (("x", x), ("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{OP}: argument '{name}' expected a torch.Tensor, got {type(t)}")
    if top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape:
        raise ValueError(
            f"{OP}: arguments 'top_k_index' and 'top_k_weights' expected the same (T, k) shape, "
            f"got {tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}"
        )
    return dist.get_world_size(group)


def routed_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    **options: Any,
) -> torch.Tensor:
    """:func:`cakeops.routed_experts` with the experts sharded over ``group`` (None: the
    default group): ``x (T, D)`` and ``top_k_index``/``top_k_weights (T, k)`` are this rank's
    tokens with global expert ids; ``w_gate``, ``w_up (E/W, F, D)``, ``w_down (E/W, D, F)`` and
    the biases in ``options`` are this rank's experts (``options``: those of
    :func:`cakeops.routed_experts`). Returns this rank's ``(T, D)``."""
    world = _check(x, top_k_index, top_k_weights, w_up, group)
    local = w_up.shape[0]
    T, k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    # each kept (token, slot) row, sorted by the rank that owns its expert (dropped: sorted last)
    dest = torch.where(ids < local * world, ids // local, world)
    order = torch.sort(dest, stable=True).indices
    counts = torch.bincount(dest, minlength=world + 1)[:world]
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    split_in, split_out = counts.tolist(), recv_counts.tolist()  # the only host transfer
    sent = order[: sum(split_in)]
    rows = _exchange(x.index_select(0, sent // k), split_in, split_out, group)
    local_ids = _exchange((ids[sent] - dest[sent] * local).unsqueeze(1), split_in, split_out, group)
    ones = torch.ones(local_ids.shape, dtype=top_k_weights.dtype, device=x.device)
    y = _routed_experts(rows, local_ids, ones, w_gate, w_up, w_down, **options)
    back = _exchange(y, split_out, split_in, group)  # this rank's kept slots, in `sent` order
    # the combine at home, each token's slots in slot order (dropped slots: zero rows)
    slots = back.new_zeros((T * k, back.shape[1])).index_copy(0, sent, back)
    weights = top_k_weights.to(slots.dtype).reshape(T, k, 1)
    return (slots.view(T, k, -1) * weights).sum(1).to(x.dtype)


def scale_expert_grads(parameters, group: dist.ProcessGroup | None = None) -> None:
    """Divide the gradients of expert-parallel ``parameters`` by the world size: the average
    over ranks that DDP and FSDP2 apply to the other parameters (each rank's experts received
    every rank's gradient, the sum)."""
    world = dist.get_world_size(group)
    for p in parameters:
        if p.grad is not None:
            p.grad.div_(world)
