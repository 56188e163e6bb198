"""Grouped experts for engines that hand the experts rows already sorted by expert with their
counts, ``experts(x, num_tokens_per_expert)`` (torchtitan's ``GroupedExperts`` and the engines
modelled on it, DeepSpeed's AutoEP among them), served by :func:`cakeops.routed_experts`.

The slot's contract: ``x (R, D)`` holds expert 0's rows, then expert 1's, ...; its last
``R - sum(counts)`` rows are padding (an engine aligns each group's size) and come back as
zeros; the output is each row's expert output, ``(R, D)`` in ``x``'s dtype, in the same order
(the engine weighs and combines). The weights are torchtitan's ``w1`` (gate) and ``w3`` (up),
``(E, F, D)``, and ``w2`` (down), ``(E, D, F)``.

    from cakeops.integrations.torchtitan import use_cakeops_experts
    use_cakeops_experts(model)   # every module with w1, w2, w3 and num_experts

Each row becomes a one-slot routing (its expert's id, weight 1; padding rows the dropped id
``E``), found from the counts on the device (no host synchronisation): the op's gradients for
``x`` and the three weights are the slot's.
"""

from __future__ import annotations

import functools
import math

import torch

from cakeops._spec import device_values_checked, readable
from cakeops.ops.routed_experts import routed_experts


def row_experts(num_tokens_per_expert: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert of each of ``rows`` rows sorted by expert, ``(rows, 1)`` int64: ``E`` (a
    dropped slot) for the rows past the counts' sum. The counts may be float (``torch.histc``
    gives them so)."""
    ends = torch.cumsum(checked_counts(num_tokens_per_expert, rows), 0)
    positions = torch.arange(rows, device=ends.device)
    return torch.searchsorted(ends, positions, right=True).unsqueeze(1)


@torch.library.custom_op("cakeops::grouped_experts_counts", mutates_args=())
def checked_counts(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """The counts as int64, once checked: whole, non-negative counts summing to at most
    ``rows``. Checked on a CPU tensor, on a GPU's only with ``CAKEOPS_CHECK_VALUES=1`` (a check
    would wait for the device). Counts past the rows would drop the last experts' rows,
    fractional ones round down, negative ones misplace every row after them: all silently.

    A custom op, so that a compiled graph (``torch.compile(fullgraph=True)``) runs the check
    on the real counts at each call, where tracing cannot read them; its result feeds the
    routing, so no graph drops it."""
    if counts.numel() and readable(counts, counts.is_cpu or device_values_checked()):
        values = counts.tolist()
        what = "grouped_experts: argument 'num_tokens_per_expert' expected"
        for e, v in enumerate(values):
            if not (v >= 0 and math.isfinite(v) and v == int(v)):
                raise ValueError(f"{what} whole counts >= 0, got {v:g} for expert {e}")
        if sum(values) > rows:
            raise ValueError(f"{what} counts summing to at most the {rows} rows of x, got a "
                             f"sum of {sum(values):g}")  # fmt: skip
    return counts.to(torch.int64)


@checked_counts.register_fake
def _(counts: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.empty_like(counts, dtype=torch.int64)


def grouped_experts(
    x: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    """The SwiGLU experts of rows sorted by expert: row ``r`` of expert ``e`` gives
    ``(silu(x_r w1[e]^T) * (x_r w3[e]^T)) w2[e]^T``; rows past the counts' sum give zeros."""
    if x.dim() != 2:
        raise ValueError(
            f"grouped_experts: argument 'x' expected 2 dimensions (rows, D), got shape "
            f"{tuple(x.shape)}"
        )
    if num_tokens_per_expert.shape != (w1.shape[0],):
        raise ValueError(
            f"grouped_experts: argument 'num_tokens_per_expert' expected shape "
            f"({w1.shape[0]},) (the experts of w1), got {tuple(num_tokens_per_expert.shape)}"
        )
    index = row_experts(num_tokens_per_expert, x.shape[0])
    weights = torch.ones(index.shape, dtype=x.dtype, device=x.device)
    return routed_experts(x, index, weights, w1, w3, w2)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (torchtitan's expert-parallel weights), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _forward(self: torch.nn.Module, x: torch.Tensor, num_tokens_per_expert: torch.Tensor):
    return grouped_experts(x, num_tokens_per_expert, _local(self.w1), _local(self.w2),
                           _local(self.w3))  # fmt: skip


def use_cakeops_experts(model: torch.nn.Module) -> int:
    """Serve every grouped-experts module of ``model`` (one with ``w1``, ``w2``, ``w3`` and
    ``num_experts``) with :func:`grouped_experts`, keeping its parameters and state-dict
    names; returns how many. Apply it before wrapping the model (FSDP, compile). The module's
    ``forward`` becomes a partial of this module's function (not a bound method, which pickle
    cannot bring back): a model saved whole loads, in any process, still on cakeops."""
    count = 0
    for module in model.modules():
        if all(hasattr(module, n) for n in ("w1", "w2", "w3", "num_experts")):
            module.forward = functools.partial(_forward, module)
            count += 1
    return count
