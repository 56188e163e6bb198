"""Every served hybrid family's tiny model in bfloat16 and float16, patched by ``apply_cakeops``,
against the same model unpatched in the same dtype: the forward's logits, a training step's
loss and gradients, and greedy generation with the cache (a prefill, then decode steps).

Both runs round to the 16-bit dtype, each within the spec's tolerance of the exact values, so
the two are compared within twice that. A Mamba2 mixer hands its gated norm a float32 scan
output with a 16-bit gate: the models' own norms upcast both, and so must the patched ones."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from hf_conv_families import BUILT
from hf_conv_families import FAMILIES as KERNEL_FAMILIES
from test_transformers import COMMON
from test_transformers import FAMILIES as MODEL_FAMILIES

import cakeops
from cakeops.integrations.transformers import apply_cakeops

FAMILIES = {f: KERNEL_FAMILIES[f] for f in BUILT}
FAMILIES["MiniMax"] = (MODEL_FAMILIES["MiniMax"][0], {**COMMON, **MODEL_FAMILIES["MiniMax"][1]})
HALF = [torch.bfloat16, torch.float16]


def models(family: str, dtype: torch.dtype):
    config_class, sizes = FAMILIES[family]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config_class(**sizes))
    return model.to(dtype), apply_cakeops(copy.deepcopy(model))


def tokens(shape=(2, 12)):
    return torch.randint(3, 64, shape, generator=torch.Generator().manual_seed(1))


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_half_precision_forward_training_step_and_generation(family, dtype):
    tol = 2 * cakeops.tolerance(dtype)
    model, patched = models(family, dtype)
    assert any(type(m).__name__.startswith("Cakeops") for m in patched.modules())
    ids = tokens()
    want, got = model(ids, labels=ids), patched(ids, labels=ids)
    assert got.logits.dtype == want.logits.dtype
    assert cakeops.relative_error(got.logits, want.logits) <= tol
    want.loss.backward()
    got.loss.backward()
    assert cakeops.relative_error(got.loss, want.loss) <= tol
    assert cakeops.relative_error(grads(patched), grads(model)) <= tol

    runs = []
    for m in (model, patched):
        m.eval()
        runs.append(m.generate(ids[:, :6], max_new_tokens=8, min_new_tokens=8, do_sample=False,
                               output_scores=True, return_dict_in_generate=True,
                               pad_token_id=0))  # fmt: skip
    # Each step's scores compared over the rows whose tokens so far agree; a row leaves where
    # the two picks differ, which only a tie within the rounding may cause.
    rows = torch.ones(ids.shape[0], dtype=torch.bool)
    for step, (a, b) in enumerate(zip(runs[0].scores, runs[1].scores, strict=True)):
        a, b = a[rows].double(), b[rows].double()
        assert cakeops.relative_error(b, a) <= tol, step
        mine, theirs = (r.sequences[rows, 6 + step] for r in (runs[1], runs[0]))
        for i in (mine != theirs).nonzero().flatten().tolist():
            assert abs(a[i, mine[i]] - a[i, theirs[i]]) <= tol * a[i].abs().max(), step
        rows[rows.clone()] = mine == theirs
