"""Documents packed in one row of a Hugging Face model, kept apart in every cakeops mixer.

Trainers pack documents into one row without padding (transformers' flattening collator):
positions restarting at 0 at each document (``position_ids``), and sometimes
``cu_seq_lens_q`` (the documents' offsets) or Mamba's ``seq_idx``. transformers derives the
documents from restarting positions for its attention; its recurrent layers read only the
offsets, and some causal-LM classes (Mamba2's) drop every such argument before the layers.

:func:`keep_documents_apart` (``apply_cakeops`` calls it) hooks each model class of a model
(the causal LM and its base model): the offsets are found from what the call gives
(``cu_seq_lens_q``, else ``seq_idx``, else restarting ``position_ids``) or from the model
around it, and handed to the layers as the flattening collator hands them (``cu_seq_lens_q``,
``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``; ``seq_idx`` too, which some layers
hand their convolution instead), which every mixer cakeops serves reads.
A model with a layer that would still run the documents together (:data:`MIXING_LAYERS`)
raises a ``ValueError`` naming it instead of returning a silently mixed result.
:func:`packed_offsets` reads the offsets back where a layer's kernel call receives them.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

#: the offsets found by the model around the one being called (a causal LM's, for its base
#: model, which its forward may not hand them to)
_OFFSETS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "cakeops_packed_offsets", default=None
)
#: per hooked module, the tokens to reset the offsets with after its forward
_RESETS: dict[int, list[contextvars.Token]] = {}

#: layer class name -> why packed documents reach each other through it, cakeops serving
#: every other part of its model (tests/integrations/test_hf_packed.py checks each is needed)
MIXING_LAYERS = {
    **dict.fromkeys(
        ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer"),
        "its selective scan (Mamba1's per-channel A) is transformers' own, which reads no "
        "document boundaries",
    ),
    "GraniteMoeHybridAttention": "its attention mask is built without the positions, so its "
    "attention spans every document of the row",
    "InklingAttention": "its key and value short convolutions are called without the "
    "document boundaries",
}


def offsets_from(kwargs: dict[str, Any], length: int) -> torch.Tensor | None:
    """The documents' offsets ``(documents + 1,)`` of a one-row call of ``length`` positions,
    from ``cu_seq_lens_q``, else ``seq_idx`` ``(1, L)``, else ``position_ids`` ``(1, L)``
    restarting (a position that does not follow its predecessor starts a document, as
    transformers reads them); None when the call packs nothing. Positions with padding
    (an attention mask with zeros) are the mask's business: not read."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return cu
    for name in ("seq_idx", "position_ids"):
        ids = kwargs.get(name)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape != (1, length):
            continue
        if name == "position_ids":
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
                return None
        offsets = boundaries(ids[0], step=1 if name == "position_ids" else 0)
        return offsets.to(torch.int32) if offsets.numel() > 2 else None
    return None


def boundaries(ids: torch.Tensor, step: int) -> torch.Tensor:
    """The offsets (int64, from 0 to ``len(ids)``) of the runs of ``ids`` (1-D) in which each
    entry is its predecessor plus ``step``: a document's positions (``step`` 1) or its
    ``seq_idx`` (``step`` 0). Reads where they change: a synchronisation on a GPU."""
    starts = (ids[1:] != ids[:-1] + step).nonzero().flatten() + 1
    ends = torch.tensor([0, ids.numel()], device=ids.device)
    return torch.cat([ends[:1], starts, ends[1:]])


def _length(args: tuple, kwargs: dict[str, Any]) -> int | None:
    """The sequence length of a model call (one row), from its ids or embeddings."""
    for x in (kwargs.get("input_ids"), args[0] if args else None, kwargs.get("inputs_embeds")):
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            return x.shape[1] if x.shape[0] == 1 else None
    return None


def _before(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]):
    if torch.compiler.is_compiling():  # finding restarts is data-dependent (transformers too)
        return None
    length = _length(args, kwargs)
    offsets = None if length is None or length < 2 else offsets_from(kwargs, length)
    if offsets is None and length is not None:
        around = _OFFSETS.get()
        if around is not None and int(around[-1]) == length:
            offsets = around
    _RESETS.setdefault(id(module), []).append(_OFFSETS.set(offsets))
    if offsets is None:
        return None
    mixing = sorted({type(m).__name__.removeprefix("Cakeops") for m in module.modules()}
                    & MIXING_LAYERS.keys())  # fmt: skip
    if mixing:
        _OFFSETS.reset(_RESETS[id(module)].pop())
        why = "; ".join(f"{name}: {MIXING_LAYERS[name]}" for name in mixing)
        raise ValueError(
            f"{type(module).__name__}: documents packed in one row (restarting position_ids, "
            f"seq_idx or cu_seq_lens_q) would reach each other through {why}. Pass one "
            "document per row (with padding and an attention mask) for this model"
        )
    added: dict[str, Any] = {}
    lengths = offsets[1:] - offsets[:-1]
    if kwargs.get("cu_seq_lens_q") is None:
        longest = int(lengths.max())
        added.update(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=longest,
                     max_length_k=longest)  # fmt: skip
    if kwargs.get("seq_idx") is None:  # what some layers hand their convolution instead
        documents = torch.arange(lengths.numel(), device=offsets.device, dtype=torch.int32)
        added["seq_idx"] = torch.repeat_interleave(documents, lengths)[None]
    return (args, {**kwargs, **added}) if added else None


def _after(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any):
    if torch.compiler.is_compiling():
        return
    tokens = _RESETS.get(id(module))
    if tokens:
        _OFFSETS.reset(tokens.pop())


def keep_documents_apart(model: torch.nn.Module) -> None:
    """Hook every Hugging Face model class inside ``model`` (once each) so that documents
    packed in one row reach every cakeops mixer as offsets, or are refused."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not getattr(module, "_cakeops_packing", 0):
            module.register_forward_pre_hook(_before, with_kwargs=True)
            module.register_forward_hook(_after, with_kwargs=True, always_call=True)
            module._cakeops_packing = True


def packed_offsets(x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """Packed sequences' offsets from what the layers pass along: ``cu_seq_lens_q``
    (``DataCollatorWithFlattening``) or Mamba's per-position ``seq_idx`` ``(1, L)`` (its
    offsets read from the changes of sequence: a synchronisation on a GPU)."""
    if x.shape[0] != 1:
        return None
    cu = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seqlens"))
    if cu is not None:
        return cu
    seq_idx = kwargs.get("seq_idx")
    return None if seq_idx is None else boundaries(seq_idx.reshape(-1), step=0)
