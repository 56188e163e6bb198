"""Every Hugging Face family whose experts use transformers' ``ExpertsInterface``, with
``experts_implementation="cakeops"`` against the eager experts
(``tests/integrations/hf_families.py`` finds the families and builds them tiny): the model's
loss and every parameter's gradient where the model builds from a generic tiny config, else the
experts module's output and every gradient.
A family cakeops cannot run is refused when the model is built, with the reason. The docs'
table is generated from these checks: ``python tests/integrations/test_hf_families.py``.

Both sides are float32, each within the spec's float32 tolerance of the exact values, so they
are compared within twice that.
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

import cakeops
from cakeops.integrations.transformers import (
    Unsupported,
    apply_cakeops,
    check_model,
    experts_options,
)

sys.path.insert(0, str(Path(__file__).parent))
import hf_families as H

TOLERANCE = 2 * cakeops.tolerance(torch.float32)
#: A gradient this small against the largest one is float32 rounding noise around zero.
NOISE = 1e-6
ROOT = Path(__file__).resolve().parents[2]
NAMES = [f.name for f in H.families()]


@functools.cache
def _refusal(fam: H.Family) -> str | None:
    """Why cakeops refuses the family's experts (None: it runs them)."""
    for experts in fam.experts:
        try:
            experts_options(H.build_experts(experts))
        except Unsupported as exc:
            return str(exc).split(": ", 1)[1].rsplit("; use ", 1)[0]
    return None


def _grads_of_model(model, ids):
    model.zero_grad(set_to_none=True)
    model.eval()  # no dropout, no router sampling (PhiMoE's sparsemixer samples in training)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return [loss.detach()], {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _grads_of_experts(module, inputs):
    x, index, weights = (t.clone() for t in inputs)
    x.requires_grad_()
    weights.requires_grad_()
    out = module(x, index, weights)
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(out, [x, weights, *params.values()], torch.ones_like(out))
    names = ["hidden_states", "top_k_weights", *params]
    return [out.detach()], dict(zip(names, grads, strict=True))


def _assert_close(eager, mine, exact=None):
    """cakeops' values within ``TOLERANCE`` of the eager experts'. Where a model's own
    conditioning spreads two float32 runs further apart (``exact``: the float64 eager run, for
    DeepSeek-V4's hyper-connections), cakeops must be within the float32 tolerance of the exact
    value or of the same order as the eager experts' own float32 error (two
    float32 runs of an ill-conditioned model each wander from the exact value: up to 4 times
    it, since one CPU's rounding put cakeops' run at 3.2 times the eager one's on DeepSeek-V4's
    ``hc_head.hc_base``, 9e-5 against float64)."""
    (want, want_grads), (got, got_grads) = eager, mine
    assert want_grads.keys() == got_grads.keys()
    largest = max(g.norm().item() for g in want_grads.values())
    pairs = [("loss", a, b) for a, b in zip(got, want, strict=True)]
    for name, grad in want_grads.items():
        if grad.norm() <= NOISE * largest:
            # zero by the math (DeepSeek-V4's hash-routed layers): rounding noise on both sides,
            # which must stay noise
            assert got_grads[name].norm() <= NOISE * largest, name
            continue
        pairs.append((name, got_grads[name], grad))
    for name, a, b in pairs:
        err = cakeops.relative_error(a, b)
        if err <= TOLERANCE:
            continue
        assert exact is not None, f"{name}: relative error {err:.2e}"
        values, grads = exact()
        truth = values[0] if name == "loss" else grads[name]
        mine_err, eager_err = cakeops.relative_error(a, truth), cakeops.relative_error(b, truth)
        assert mine_err <= max(cakeops.tolerance(torch.float32), 4 * eager_err), (
            f"{name}: relative error {mine_err:.2e} against float64, eager's {eager_err:.2e}"
        )


def _exact(model: torch.nn.Module) -> torch.nn.Module:
    """The model in float64, its experts eager; a delta-rule layer's kernel on cakeops, whose
    float64 is the recurrence's (transformers' delta-rule fallback computes in float32 whatever
    its inputs' dtype)."""
    from cakeops.integrations.transformers import rebinding

    exact = copy.deepcopy(model).double()
    for m in exact.modules():
        if rebinding.served_names(type(m)):
            m.__class__ = rebinding.kernels_class(type(m))
    return exact


@pytest.mark.parametrize("name", [n for n in NAMES if _refusal(H.family(n)) is None])
def test_family_matches_the_eager_experts(name):
    fam = H.family(name)
    if H.level(name) == "model":
        model = H.build_model(fam)
        model.set_experts_implementation("eager")
        mine = apply_cakeops(copy.deepcopy(model))
        with cakeops.use_backend("nope", op="routed_experts"), pytest.raises(cakeops.BackendError):
            mine(H.tokens())  # proof that the experts run on cakeops
        exact = functools.cache(lambda: _grads_of_model(_exact(model), H.tokens()))
        _assert_close(_grads_of_model(model, H.tokens()), _grads_of_model(mine, H.tokens()), exact)
        return
    for experts in fam.experts:
        module = H.build_experts(experts)
        inputs = H.experts_inputs(module)
        mine = copy.deepcopy(module)
        mine.config._experts_implementation = "cakeops"
        _assert_close(_grads_of_experts(module, inputs), _grads_of_experts(mine, inputs))


@pytest.mark.parametrize("name", [n for n in NAMES if _refusal(H.family(n)) is not None])
def test_refused_family_is_refused_when_built(name):
    """Not at the first forward: ``from_config(..., experts_implementation="cakeops")`` (or,
    for a family without a causal LM, the check on its experts module) raises with the
    reason."""
    fam = H.family(name)
    if H.level(name) == "model":
        config = H.tiny(fam.causal.config_class())
        with pytest.raises(Unsupported, match="does not support"):
            fam.causal._from_config(config, experts_implementation="cakeops")
        return
    module = H.build_experts(fam.experts[0])
    with pytest.raises(Unsupported, match="does not support"):
        check_model(torch.nn.Sequential(module))


@pytest.mark.parametrize("name", [n for n in NAMES if H.level(n) == "model"])
def test_model_built_on_the_meta_device(name):
    """Large-model loading builds on ``torch.device("meta")`` first: both routes to cakeops
    (``experts_implementation="cakeops"``, ``apply_cakeops``) build there (a refused family is
    refused with its reason), and the model, materialised on the CPU with the weights and
    buffers of one built there, computes what that one computes."""
    fam = H.family(name)
    config = H.tiny(fam.causal.config_class())
    if _refusal(fam) is not None:
        with torch.device("meta"), pytest.raises(Unsupported, match="does not support"):
            fam.causal._from_config(config, experts_implementation="cakeops")
        return
    with torch.device("meta"):
        by_name = fam.causal._from_config(config, experts_implementation="cakeops")
        applied = apply_cakeops(fam.causal._from_config(config))
    want = apply_cakeops(H.build_model(fam)).eval()
    for model in (by_name, applied):
        assert all(p.is_meta for p in model.parameters())
        model.to_empty(device="cpu").load_state_dict(want.state_dict())
        buffers = dict(want.named_buffers())  # the rotary tables too, which are not saved
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
        model.eval()
        ids = H.tokens()
        assert cakeops.relative_error(model(ids).logits, want(ids).logits) <= TOLERANCE


def test_expert_parallel_sentinels_are_dropped_slots():
    """transformers' expert parallelism sends ids past the local experts with zero weights:
    with cakeops they add nothing, as with the eager experts."""
    module = H.build_experts(H.family("qwen3_moe").experts[0])
    module._is_expert_parallel = True
    x, index, weights = H.experts_inputs(module)
    index[::2, 1] = module.num_experts  # the sentinel: experts on another rank
    weights = weights.masked_fill(index >= module.num_experts, 0.0)
    mine = copy.deepcopy(module)
    mine.config._experts_implementation = "cakeops"
    eager = copy.deepcopy(module)
    eager.config._experts_implementation = "batched_mm"  # eager's loop has no sentinel branch
    _assert_close(
        _grads_of_experts(eager, (x, index, weights)), _grads_of_experts(mine, (x, index, weights))
    )


#: Training convergence (in the manner of Liger-Kernel's): two families, 30 SGD steps on one
#: batch. Over so many steps float32 differences in any one step grow, so the bounds are those
#: of transformers' own implementations against each other: its batched_mm against its eager
#: experts, same steps, differ by up to 6e-5 in a step's loss and 1.3e-4 in the final
#: parameters (measured, this suite's models); cakeops must stay within these bounds.
STEP_LOSS, FINAL_PARAMETERS, STEPS = 1e-4, 1e-3, 30


@pytest.mark.parametrize("name, config", [("gpt_oss", {}), ("qwen3_moe", {"hidden_act": "gelu"})])
def test_training_converges_like_the_eager_experts(name, config):
    """GPT-OSS (clamped SwiGLU, biases, interleaved transposed weights) and Qwen3-MoE with its
    tester's GELU: per-step losses and final parameters close to the eager experts', and the
    loss falls."""
    fam = H.family(name)
    torch.manual_seed(0)
    model = fam.causal(H.tiny(fam.causal.config_class(**config)))
    model.set_experts_implementation("eager")
    mine = apply_cakeops(copy.deepcopy(model))
    ids = H.tokens()
    losses = {}
    for tag, m in (("eager", model), ("cakeops", mine)):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        losses[tag] = []
        for _ in range(STEPS):
            optimizer.zero_grad()
            loss = m(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            losses[tag].append(loss.detach())
    assert losses["eager"][-1] < 0.5 * losses["eager"][0]  # it learns
    for step, (a, b) in enumerate(zip(losses["cakeops"], losses["eager"], strict=True)):
        assert cakeops.relative_error(a, b) <= STEP_LOSS, f"step {step}"
    for (n, p), q in zip(mine.named_parameters(), model.parameters(), strict=True):
        assert cakeops.relative_error(p, q) <= FINAL_PARAMETERS, n


def families_table() -> str:
    """The docs' table of every family: how cakeops runs its experts, or why not."""
    rows = [
        "| family | experts | cakeops runs it as | checked on | status |",
        "| --- | --- | --- | --- | --- |",
    ]
    for fam in H.families():
        classes = ", ".join(f"`{c.__name__}`" for c in fam.experts)
        reason = _refusal(fam)
        if reason is not None:
            rows.append(f"| {fam.name} | {classes} | - | - | refused: {reason} |")
            continue
        forms = []
        for experts in fam.experts:
            module = H.build_experts(experts)
            options = experts_options(module)
            form = ", ".join(f"{k}={v}" for k, v in options.items() if k != "activation")
            extras = [flag for flag, on in (
                ("biases", getattr(module, "has_bias", False)),
                ("no gate", not getattr(module, "has_gate", True)),
                ("transposed", getattr(module, "is_transposed", False)),
                ("interleaved", not getattr(module, "is_concatenated", True)),
            ) if on]  # fmt: skip
            forms.append(" ".join([options["activation"], *([form] if form else []), *extras]))
        how = "; ".join(dict.fromkeys(forms))
        rows.append(f"| {fam.name} | {classes} | {how} | {H.level(fam.name)} | works |")
    return "\n".join(rows)


def summary() -> str:
    works = sum(_refusal(f) is None for f in H.families())
    return (
        f"With transformers {tf.__version__}, cakeops runs the experts of {works} of the "
        f"{len(H.families())} families that use the `ExpertsInterface`."
    )


BLOCKS = {"docs/content/transformers.md": "hf-families", "README.md": "hf-families-summary"}


def _block(name: str) -> str:
    return families_table() + "\n\n" + summary() if name == "hf-families" else summary()


@pytest.mark.parametrize("page", list(BLOCKS))
def test_families_table_is_current(page):
    """Regenerate with ``python tests/integrations/test_hf_families.py``."""
    name = BLOCKS[page]
    text = (ROOT / page).read_text()
    block = text.split(f"<!-- {name}:start -->\n")[1].split(f"<!-- {name}:end -->")[0]
    assert block.strip() == _block(name), (
        f"{page}: run python tests/integrations/test_hf_families.py"
    )


if __name__ == "__main__":
    for page, name in BLOCKS.items():
        path = ROOT / page
        head, rest = path.read_text().split(f"<!-- {name}:start -->\n")
        tail = rest.split(f"<!-- {name}:end -->")[1]
        path.write_text(f"{head}<!-- {name}:start -->\n{_block(name)}\n<!-- {name}:end -->{tail}")
        print(f"wrote {page}")
