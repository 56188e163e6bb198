"""Documents packed in one row as trainers pack them (transformers' ``DataCollatorWithFlattening``:
positions restarting at 0 per document, and with its options ``seq_idx`` or the flash-attention
offsets), at each served family's causal-LM class, the class a ``Trainer`` calls: each
document's logits, and every parameter's gradient, equal the documents run one by one. Where a
layer cakeops does not serve would still run the documents together, the call is refused with
a ``ValueError`` naming it (and each such entry is needed: without it, the documents mix)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from test_hf_half_precision import FAMILIES

import cakeops
from cakeops.integrations import packed_documents
from cakeops.integrations.transformers import apply_cakeops

TOLERANCE = 2 * cakeops.tolerance(torch.float32)
LENGTHS = (5, 7, 8)
FORMS = {
    "positions": {},
    "seq_idx": {"return_seq_idx": True},
    "flash offsets": {"return_flash_attn_kwargs": True},
}
#: families whose own attention fails on restarting positions (unpatched too: an error, not a
#: mixed result), with transformers' message
TRANSFORMERS_REFUSES = {
    "Kimi-Linear": "must match the size",
    "Bailing-Hybrid": "must match the size",
}


def model_of(family: str):
    config_class, sizes = FAMILIES[family]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config_class(**sizes))
    model.train()
    return model


def documents():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 64, (n,), generator=gen) for n in LENGTHS]


def packed_batch(form: str) -> dict:
    """The flattening collator's row for the documents."""
    collator = tf.DataCollatorWithFlattening(**FORMS[form])
    batch = collator([{"input_ids": d.tolist()} for d in documents()])
    return {k: v for k, v in batch.items() if k != "labels"}


def mixing_layers(model) -> set[str]:
    names = {type(m).__name__.removeprefix("Cakeops") for m in model.modules()}
    return names & packed_documents.MIXING_LAYERS.keys()


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten() for _, g in sorted(grads.items())])


def logits_and_grads(model, **batch):
    model.zero_grad(set_to_none=True)
    logits = model(**batch, use_cache=False).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    (logits * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), weights, grads


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_documents_equal_the_documents_one_by_one(family, form):
    model = apply_cakeops(model_of(family))
    batch = packed_batch(form)
    if family in TRANSFORMERS_REFUSES:
        with pytest.raises((RuntimeError, ValueError)):  # its attention, or its fallbacks'
            model_of(family)(**batch, use_cache=False)
        with pytest.raises(RuntimeError, match=TRANSFORMERS_REFUSES[family]):
            model(**batch, use_cache=False)
        return
    if mixing_layers(model):
        for name in mixing_layers(model):
            with pytest.raises(ValueError, match=f"documents packed in one row .*{name}"):
                model(**batch, use_cache=False)
        return
    logits, weights, grads = logits_and_grads(model, **batch)
    want = dict.fromkeys(grads, 0.0)
    start = 0
    for doc in documents():
        end = start + doc.numel()
        model.zero_grad(set_to_none=True)
        alone = model(doc[None], use_cache=False).logits
        assert cakeops.relative_error(logits[:, start:end], alone) <= TOLERANCE
        (alone * weights[:, start:end]).sum().backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                want[n] = want[n] + p.grad
        start = end
    # normwise over every parameter: some (Zamba's x_proj) get gradients of float32 noise
    assert cakeops.relative_error(flat(grads), flat(want)) <= TOLERANCE


@pytest.mark.parametrize("family", [f for f in FAMILIES if mixing_layers(model_of(f))
                                    or mixing_layers(apply_cakeops(model_of(f)))])  # fmt: skip
def test_each_refusal_is_needed(family, monkeypatch):
    """Without its family's entries in ``MIXING_LAYERS``, the packed row's documents reach
    each other: the refusal is what stands between the user and a mixed result."""
    model = apply_cakeops(model_of(family)).eval()
    monkeypatch.setattr(packed_documents, "MIXING_LAYERS", {})
    batch = packed_batch("positions")
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits
        doc = documents()[1]
        alone = model(doc[None], use_cache=False).logits
    start = LENGTHS[0]
    assert cakeops.relative_error(logits[:, start : start + doc.numel()], alone) > TOLERANCE


def test_one_document_and_a_padded_row_are_not_packed():
    """Positions counting up (one document), and the positions ``generate`` makes for a
    left-padded row, pack nothing: the model's own path, unchanged."""
    model = apply_cakeops(model_of("Qwen3-Next"))
    ids = documents()[2][None]
    assert packed_documents.offsets_from({"position_ids": torch.arange(8)[None]}, 8) is None
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    kwargs = {"position_ids": positions, "attention_mask": mask}
    assert packed_documents.offsets_from(kwargs, 8) is None
    with torch.no_grad():
        a = model(ids, position_ids=torch.arange(8)[None], use_cache=False).logits
        b = model(ids, use_cache=False).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
