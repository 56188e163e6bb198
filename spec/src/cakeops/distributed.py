"""Expert parallelism: :func:`routed_experts` with the experts sharded across the ranks of a
``torch.distributed`` process group.

Layout: each of the ``W`` ranks holds its own tokens and a contiguous block of ``E / W``
experts, rank ``r`` the global ids ``[r E/W, (r+1) E/W)``; the weights a rank passes are its
block. ``top_k_index`` holds global ids (``>= E`` or ``-1``: a dropped slot, as in the
single-process op).

A call makes two all-to-all exchanges of token rows: a token goes once to each rank that owns
one of its experts (sorted by destination, with its ``k`` slots' local expert ids there and
combine weights packed beside it, the slots on other ranks dropped), runs through that rank's
:func:`cakeops.routed_experts`, which weighs its float32 slot outputs, sums the token's slots
there (and computes the weights' gradient from them) as the single-process op does, and each
rank's partial sum comes back in a second all-to-all, summed at home in float32, rank by rank.
A token goes to at most ``min(k, W)`` ranks instead of as ``k`` rows (top-4 of 16 experts
over 2 ranks: to the other rank 0.96 times on average instead of 2).
Every rank must hold the same number of experts, and the ranks' calls must agree on what the
exchange and the experts' form depend on (checked within the exchange of the counts, with whether
each rank's arguments passed the single-process op's checks: all ranks raise alike, none is left
waiting); a rank may have no tokens. Autograd
flows back through both exchanges (each the reverse all-to-all of the other): ``x``, the local
experts' weights and biases, and ``top_k_weights``. Only the small all-to-all's integers cross
to the host (the split sizes and what the ranks must agree on, run while the rank prepares its
rows); rows never do.

Gradients: each rank's expert weights receive the gradients of every rank's tokens, the sum of
all the ranks' losses. A data-parallel setup that averages the other parameters' gradients
over ranks (DDP, FSDP2) divides the expert gradients by the world size too:
:func:`average_expert_grads` sets that up once (FSDP's own divide factor when the experts are
sharded over an expert-FSDP dimension, else a gradient hook); :func:`scale_expert_grads` does it
by hand after a backward.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch
import torch.distributed as dist

from cakeops._spec import FLOAT_DTYPES
from cakeops.ops.routed_experts import ACTIVATIONS, SPEC
from cakeops.ops.routed_experts import routed_experts as _routed_experts
from cakeops.opspec import OpInputs

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


def _places(layout: list[tuple[torch.dtype, int]]) -> tuple[list[int], int]:
    """Where :func:`_packed` puts each part of a row, in bytes, and the row's width: the first
    part (the token's row) at 0, padded to 16 bytes; the others widest dtype first, so that
    each starts aligned for its dtype; the row padded to 64 bytes, so that the token rows read
    back have a stride of whole 16-element tiles (the Triton experts' wide tiles ask for it)."""
    widths = [columns * dtype.itemsize for dtype, columns in layout]
    places, cursor = [0] * len(layout), -(-widths[0] // 16) * 16
    for i in sorted(range(1, len(layout)), key=lambda i: -layout[i][0].itemsize):
        places[i], cursor = cursor, cursor + widths[i]
    return places, -(-cursor // 64) * 64


def _packed(*parts: torch.Tensor) -> torch.Tensor:
    """``(n, c_i)`` tensors of any dtypes side by side as one ``(n, bytes)`` uint8 tensor, laid
    out by :func:`_places` (the padding zero), each part read back as a view
    (:func:`_unpacked`)."""
    layout = [(p.dtype, p.shape[1]) for p in parts]
    places, width = _places(layout)
    packed = torch.zeros((parts[0].shape[0], width), dtype=torch.uint8, device=parts[0].device)
    for part, start in zip(parts, places, strict=True):
        columns = part.contiguous().view(torch.uint8)
        packed[:, start : start + columns.shape[1]] = columns
    return packed


def _unpacked(packed: torch.Tensor, layout: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """The tensors :func:`_packed` put side by side, from their ``(dtype, columns)``: views of
    ``packed`` (no copy: the rows a rank receives stay in the buffer they arrived in)."""
    places, _ = _places(layout)
    return [packed[:, start : start + columns * dtype.itemsize].view(dtype)
            for (dtype, columns), start in zip(layout, places, strict=True)]  # fmt: skip


class _Dispatch(torch.autograd.Function):
    """Each pair's row, its slots' local ids and weights to its rank in one exchange of bytes
    (one all-to-all where three would each pay a collective's latency); the backward sends the
    rows' and weights' gradients home in one too."""

    @staticmethod
    def forward(ctx, rows, ids, weights, split_in: list[int], split_out: list[int], group):
        layout = [(t.dtype, t.shape[1]) for t in (rows, ids, weights)]
        ctx.splits, ctx.group, ctx.layout = (split_in, split_out), group, layout[::2]
        got = _all_to_all(_packed(rows, ids, weights), split_in, split_out, group)
        rows_in, ids_in, weights_in = _unpacked(got, layout)
        ctx.mark_non_differentiable(ids_in)
        return rows_in, ids_in, weights_in

    @staticmethod
    def backward(ctx, d_rows, _, d_weights):
        split_in, split_out = ctx.splits
        home = _all_to_all(_packed(d_rows, d_weights), split_out, split_in, ctx.group)
        d_rows, d_weights = _unpacked(home, ctx.layout)
        return d_rows, None, d_weights, None, None, None


#: What every rank's call must agree on, as ``(argument, what)``: the rows' layout on the wire,
#: the experts' form (a token's experts must not depend on their rank), and whether the backward
#: exchanges (a rank that records no backward would leave the others waiting in it).
_AGREED = (
    ("x", "width D"),
    ("x", "dtype"),
    ("top_k_index", "number of slots k"),
    ("top_k_weights", "dtype"),
    *((name, "presence (None or not)") for name in ("w_gate", "b_gate", "b_up", "b_down")),
    ("activation", "value"),
    ("alpha", "value"),
    ("limit", "value (None as inf)"),
    ("up_offset", "value"),
    ("x", "need of a gradient (grad mode, and x or top_k_weights requiring one)"),
    ("w_up", "need of a gradient (grad mode, and any argument requiring one)"),
)


def _agreed(inputs: OpInputs) -> list[Any]:
    """This rank's values of :data:`_AGREED`."""
    grad = torch.is_grad_enabled()
    rows = grad and (inputs["x"].requires_grad or inputs["top_k_weights"].requires_grad)
    experts = [inputs[name] for name in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")]
    back = rows or (grad and any(t is not None and t.requires_grad for t in experts))
    limit = inputs["limit"]
    return [
        inputs["x"].shape[1],
        inputs["x"].dtype,
        inputs["top_k_index"].shape[1],
        inputs["top_k_weights"].dtype,
        *(inputs[name] is not None for name in ("w_gate", "b_gate", "b_up", "b_down")),
        inputs["activation"],
        float(inputs["alpha"]),
        math.inf if limit is None else float(limit),
        float(inputs["up_offset"]),
        rows,
        back,
    ]


def _encoded(value: Any) -> int:
    """A value of :func:`_agreed` as an int64 for the exchange (:func:`_decoded` reads it)."""
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    if isinstance(value, torch.dtype):
        return FLOAT_DTYPES.index(value)
    if isinstance(value, str):
        return ACTIVATIONS.index(value)
    return int(value)


def _decoded(like: Any, code: int) -> Any:
    if isinstance(like, float):
        return struct.unpack("<d", struct.pack("<q", code))[0]
    if isinstance(like, torch.dtype):
        return FLOAT_DTYPES[code]
    if isinstance(like, str):
        return ACTIVATIONS[code]
    return type(like)(code)


def _device(*candidates: Any) -> torch.device:
    """Where the small exchange runs on a rank whose arguments were refused: the experts'
    device (the group's), else the first tensor's."""
    return next((t.device for t in candidates if isinstance(t, torch.Tensor)), torch.device("cpu"))


def _disagreement(table: list[list[int]], mine: list[Any]) -> str | None:
    """The first field of :data:`_AGREED` on which the ranks' rows of ``table`` differ, as an
    error message (values read as this rank's ``mine``), or None."""
    for column, ((name, what), like) in enumerate(zip(_AGREED, mine, strict=True)):
        codes = [row[column] for row in table]
        if len(set(codes)) > 1:
            values = [_decoded(like, c) for c in codes]
            return (f"{OP}: argument '{name}' expected the same {what} on every rank, got "
                    f"{values} on ranks 0..{len(table) - 1}")  # fmt: skip
    return None


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
    tokens with global expert ids (``T = 0`` is fine: the last micro-batch, an empty shard);
    ``w_gate``, ``w_up (E/W, F, D)``, ``w_down (E/W, D, F)`` and the biases in ``options`` are
    this rank's experts, the same number on every rank (``options``: those of
    :func:`cakeops.routed_experts`). Returns this rank's ``(T, D)``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{OP}: torch.distributed is not initialised (init_process_group)")
    world = dist.get_world_size(group)
    if world < 1:  # torch's answer for a rank outside the group
        raise ValueError(
            f"{OP}: argument 'group' expected a process group this rank belongs to, got one "
            f"without global rank {dist.get_rank()}"
        )
    # This rank's arguments are checked as the single-process op checks them (global ids past
    # this rank's block pass as dropped slots) before any exchange, and whether they were
    # refused travels with the counts, beside what the ranks must agree on: every rank raises
    # alike (a rank that raised alone would leave the others waiting in an exchange).
    try:
        inputs = SPEC.bind(x, top_k_index, top_k_weights, w_gate, w_up, w_down, **options)
        agreed, refused = _agreed(inputs), None
    except Exception as exc:
        agreed, refused = [0] * len(_AGREED), exc
    if refused is None:
        local, T, ids = w_up.shape[0], top_k_index.shape[0], top_k_index
        device = x.device
        # each slot's destination rank (world: a dropped slot), then the (rank, token) pairs: a
        # token goes once to each rank that holds one of its experts, with all its slots there
        dest = torch.where((ids >= 0) & (ids < local * world), ids // local, world)
        wanted = torch.zeros((T, world + 1), dtype=torch.bool, device=device)
        wanted.scatter_(1, dest, True)
        wanted = wanted[:, :world].t()  # (world, T)
        counts = wanted.sum(1)
    else:
        local, device = 0, _device(w_up, x, w_down, top_k_index)
        counts = torch.zeros(world, dtype=torch.int64, device=device)
    # each block's size, this rank's number of experts, its refusal and what must agree, to
    # every rank in one exchange, which runs while this rank prepares what it sends
    head = [local, refused is not None, *map(_encoded, agreed)]
    mine = torch.cat([counts[:, None], torch.tensor(head, device=device).expand(world, -1)], 1)
    theirs = torch.empty_like(mine)
    work = dist.all_to_all_single(theirs, mine, group=group, async_op=True)
    if refused is None:
        split_in = counts.tolist()
        # the pairs sorted by rank, then token, without waiting for the device: a stable sort
        # of the flags puts the pairs first
        order = torch.sort((~wanted).reshape(-1).to(torch.uint8), stable=True).indices
        pairs = order[: sum(split_in)]
        rank, token = pairs // max(T, 1), pairs % max(T, 1)
        # each pair's slots: those on its rank, with their local ids; the others dropped there
        here = dest[token] == rank[:, None]
        local_ids = torch.where(here, ids[token] - rank[:, None] * local, local).to(torch.int32)
        pair_weights = torch.where(here, top_k_weights[token], 0)
        rows = _gather_rows(x, token)
    work.wait()
    table = theirs.tolist()
    if refused is not None:
        raise refused
    if refusers := [r for r, row in enumerate(table) if row[2]]:
        raise ValueError(f"{OP}: the arguments of rank(s) {refusers} were refused (each raised "
                         f"why there): no rank runs the call")  # fmt: skip
    split_out, blocks = [row[0] for row in table], [row[1] for row in table]
    if any(b != local for b in blocks):
        raise ValueError(
            f"{OP}: argument 'w_up' expected the same number of experts on every rank (a "
            f"contiguous block of E / W each), got blocks of {blocks} experts on ranks "
            f"0..{world - 1}"
        )
    if message := _disagreement([row[3:] for row in table], agreed):
        raise ValueError(message)
    # each slot's local id and combine weight travel with its token's row, in one exchange:
    # the experts' op weighs its float32 slot outputs, sums a token's slots on that rank and
    # computes the weights' gradient from them, as the single-process op does
    rows, ids_in, weights_in = _Dispatch.apply(rows, local_ids, pair_weights, split_in,
                                               split_out, group)  # fmt: skip
    y = _routed_experts(rows, ids_in, weights_in, w_gate, w_up, w_down, **options)
    back = _exchange(y, split_out, split_in, group)  # each pair's partial sum, in `pairs` order
    # The partial sums at home in float32 (float64 for float64), rank by rank: within a rank
    # a token appears once, so each add has distinct rows (the same order on every run).
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = x.new_zeros((T, x.shape[1]), dtype=ct)
    start = 0
    for n in split_in:  # every rank, an empty block too: the graph reaches the exchange
        out = out.index_add(0, token[start : start + n], back[start : start + n].to(ct))
        start += n
    return out.to(x.dtype)


class _GatherRows(torch.autograd.Function):
    """``x[index]``, whose backward sums each row's gradients in float32 (rounded once, as the
    single-process op's ``dx``), not in ``x``'s dtype one slot at a time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor):
        ctx.save_for_backward(index)
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        dx = grad.new_zeros(ctx.shape, dtype=torch.float32)
        return dx.index_add_(0, index, grad.float()).to(ctx.dtype), None


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if x.requires_grad and x.dtype in (torch.float16, torch.bfloat16) and torch.is_grad_enabled():
        return _GatherRows.apply(x, index)
    return x.index_select(0, index)


#: the mark :func:`average_expert_grads` leaves on a module and its parameters
_AVERAGED = "_cakeops_expert_grads_averaged"


def average_expert_grads(
    experts: torch.nn.Module,
    group: dist.ProcessGroup | None = None,
    fsdp_mesh: Any = None,
    **fsdp_kwargs: Any,
) -> torch.nn.Module:
    """Make the gradients of ``experts`` (a module holding this rank's expert block, whose
    forward runs :func:`routed_experts` over the expert-parallel ``group``) the average over
    every data-parallel rank, as DDP and FSDP2 make the other parameters', with nothing to call
    after each backward. Each rank's block receives the sum of its EP group's gradients; so:

    - with ``fsdp_mesh`` (the expert-FSDP dimension of a 2-D mesh, expert-FSDP x EP): the module
      is ``fully_shard``-ed over it (``fsdp_kwargs`` passed on) with FSDP's own gradient divide
      factor set to ``expert-FSDP size x EP size``: its reduce-scatter sums over the expert-FSDP
      ranks and divides by every rank's count (torchtitan does the same);
    - without: a gradient hook on each parameter divides what reaches it by the EP group's size
      (before accumulation: correct with gradient accumulation too).

    Returns ``experts``. Use it instead of :func:`scale_expert_grads`, not with it, and once
    (a second call, or :func:`scale_expert_grads` on these parameters, is a ``ValueError``: it
    would divide the gradients again)."""
    if getattr(experts, _AVERAGED, False):
        raise ValueError(
            "average_expert_grads: argument 'experts' expected a module whose gradients are not "
            "averaged yet, got one an earlier call set up (a second would divide them again)"
        )
    ep = dist.get_world_size(group)
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(experts, mesh=fsdp_mesh, **fsdp_kwargs)
        experts.set_gradient_divide_factor(float(fsdp_mesh.size() * ep))  # type: ignore[operator]
        if dist.get_backend(fsdp_mesh.get_group()) == "gloo":  # no PREMUL_SUM: sum, then divide
            experts.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    else:
        for p in experts.parameters():
            if p.requires_grad:
                p.register_hook(lambda g, ep=ep: g / ep)
    for owner in (experts, *experts.parameters()):
        setattr(owner, _AVERAGED, True)
    return experts


def scale_expert_grads(parameters, group: dist.ProcessGroup | None = None) -> None:
    """Divide the gradients of expert-parallel ``parameters`` by the world size: the average
    over ranks that DDP and FSDP2 apply to the other parameters (each rank's experts received
    every rank's gradient, the sum)."""
    parameters = list(parameters)
    if any(getattr(p, _AVERAGED, False) for p in parameters):
        raise ValueError(
            "scale_expert_grads: argument 'parameters' expected gradients not averaged yet, got "
            "parameters average_expert_grads set up (scaling would divide them again)"
        )
    world = dist.get_world_size(group)
    for p in parameters:
        if p.grad is not None:
            p.grad.div_(world)
