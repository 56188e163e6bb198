"""The gated delta rule and KDA inside Hugging Face transformers: every family whose layers call
``chunk_gated_delta_rule`` / ``chunk_kda`` (and their recurrent forms) runs them on
:func:`cakeops.gated_delta_rule` after ``apply_cakeops``; loss, every gradient and greedy
generation match the unpatched model; packed sequences stay apart where transformers' fallback
refuses them; and the op agrees with transformers' own fallbacks."""

from __future__ import annotations

import importlib

import hf_kernel_checks as checks
import pytest
import torch
from hf_delta_rule_families import BUILT, FAMILIES, MODULES, NOT_BUILT
from hf_kernel_checks import TOLERANCE, tokens

import cakeops
from cakeops.integrations.transformers import hub_kernels, rebinding


def pair(family: str):
    return checks.pair(FAMILIES, family)


def delta_rule_names(cls: type) -> dict[str, str]:
    """The delta-rule kernels ``cls.forward`` calls (its convolution aside)."""
    return rebinding.served_names(cls, hub_kernels.DELTA_RULES)


def test_every_family_of_the_installed_transformers_is_listed():
    """Each family calling the delta-rule kernels is built here or says why not."""
    assert checks.modules_calling(hub_kernels.DELTA_RULES) == set(MODULES.values())
    for family in MODULES:
        assert family in BUILT or MODULES[family] in NOT_BUILT


@pytest.mark.parametrize("family", BUILT)
def test_the_op_runs_once_per_layer_and_pass(family, monkeypatch):
    """The patched model calls the op's kernels once per delta-rule layer in a forward and once
    in the backward (counted on the torch backend's kernel module)."""
    from cakeops_torch import gated_delta_rule as kernels

    calls = checks.count_calls(monkeypatch, kernels)
    _, patched = pair(family)
    layers = sum(1 for m in patched.modules() if delta_rule_names(type(m)))
    with cakeops.use_backend("torch"):
        patched(tokens(), labels=tokens()).loss.backward()
    assert layers and calls == {"forward": layers, "backward": layers}


@pytest.mark.parametrize("family", BUILT)
def test_loss_and_every_gradient_match_the_model(family):
    """The patched model's loss matches the unpatched model's, and its loss and every gradient
    are within the float32 tolerance of the exact values: the patched model in float64 (the op
    in float64 is the float64 recurrence's to 1e-12, by the conformance suite). transformers'
    float32 fallback is itself further than that from them in some gradients (``dt_bias``:
    5.7e-5 on Qwen3.5), from its ``exp(b_i - b_j)`` of running sums of the gates."""
    model, patched = pair(family)
    assert any(delta_rule_names(type(m)) for m in patched.modules())
    checks.assert_matches_the_model(model, patched, tokens(), "gated_delta_rule")


@pytest.mark.parametrize("family", BUILT)
def test_greedy_generation_matches(family):
    """32 greedy tokens (prefill through the chunked op, then one-token steps from the cached
    state) equal the unpatched model's, each step's logits within the tolerance."""
    model, patched = pair(family)
    runs = checks.generate_both(model, patched, tokens(shape=(1, 9)))
    # the caches after the last token: every delta-rule layer's recurrent state
    linear = [i for i, kind in enumerate(model.config.layer_types) if kind == "linear_attention"]
    assert linear
    for i in linear:
        a, b = (r.past_key_values.get_recurrent_state(i) for r in runs)
        assert a is not None and b is not None and a.dtype == b.dtype
        assert cakeops.relative_error(b, a) <= TOLERANCE


@pytest.mark.parametrize("family", ["Qwen3-Next", "Kimi-Linear"])
@pytest.mark.parametrize("mode", ["compile", "checkpointing"])
def test_training_steps(mode, family):
    """Three SGD steps on cakeops match the unpatched model's, compiled or with activation
    checkpointing."""
    from test_transformers import assert_training_matches

    assert_training_matches(*pair(family), mode, tokens())


def _inputs(kda: bool, L: int = 40, heads=(2, 4), seed=0):
    gen = torch.Generator().manual_seed(seed)
    H, Hv = heads
    q, k = (torch.randn(1, L, H, 8, generator=gen) for _ in "qk")
    v = torch.randn(1, L, Hv, 8, generator=gen)
    g = -torch.rand(1, L, Hv, *((8,) if kda else ()), generator=gen) * 0.5
    beta = torch.rand(1, L, Hv, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


FALLBACKS = {
    "chunk_gated_delta_rule": ("qwen3_next", "torch_chunk_gated_delta_rule", False),
    "fused_recurrent_gated_delta_rule": ("qwen3_next", "torch_recurrent_gated_delta_rule",
                                         False),
    "chunk_kda": ("kimi_linear", "chunk_kimi_delta_attention", True),
    "fused_recurrent_kda": ("kimi_linear", "recurrent_kimi_delta_attention", True),
}  # fmt: skip


@pytest.mark.parametrize("kernel", list(FALLBACKS))
def test_the_op_agrees_with_transformers_fallbacks(kernel):
    """cakeops' adapter against transformers' own PyTorch fallbacks (float32): output, final
    state and every gradient, from an initial state, with l2-normalised q and k."""
    module, name, kda = FALLBACKS[kernel]
    fallback = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"),
                       name).__wrapped__  # fmt: skip
    heads = (4, 4) if kda else (2, 4)
    state = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    results = []
    for fn in (fallback, hub_kernels._hf_delta_rule):
        leaves = [t.detach().clone().requires_grad_() for t in _inputs(kda, heads=heads)]
        s0 = state.clone().requires_grad_()
        out, final = fn(*leaves, initial_state=s0, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)  # fmt: skip
        loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + final.sum()
        results.append((out, final, *torch.autograd.grad(loss, [*leaves, s0])))
    for a, b in zip(*results, strict=True):
        assert cakeops.relative_error(b, a) <= TOLERANCE


@pytest.mark.parametrize("kda", [False, True])
def test_packed_sequences_stay_apart_where_the_fallback_refuses(kda):
    """``cu_seqlens`` through the adapter: each document's output, final state and gradients
    equal that document run alone; transformers' fallback raises on the same call."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    heads = (4, 4) if kda else (2, 4)
    leaves = _inputs(kda, L=40, heads=heads)
    cu = torch.tensor([0, 7, 7, 30, 40])
    if not kda:
        with pytest.raises(ValueError, match="packed sequences"):
            torch_chunk_gated_delta_rule(*leaves, cu_seqlens=cu)
    out, final = hub_kernels._hf_delta_rule(*leaves, output_final_state=True, cu_seqlens=cu,
                                            use_qk_l2norm_in_kernel=True)  # fmt: skip
    grads = torch.autograd.grad(out.sum() + final.sum(), leaves)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        alone = [t.detach()[:, s:e].clone().requires_grad_() for t in leaves]
        o, f = hub_kernels._hf_delta_rule(*alone, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)  # fmt: skip
        torch.testing.assert_close(out[:, s:e], o, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(final[i : i + 1], f, rtol=1e-5, atol=1e-6)
        if e > s:
            parts = torch.autograd.grad(o.sum() + f.sum(), alone)
            for whole, part in zip(grads, parts, strict=True):
                torch.testing.assert_close(whole[:, s:e], part, rtol=1e-5, atol=1e-6)


def delta_rule_table() -> str:
    """The docs' table of the families whose delta rule cakeops serves: what this module
    finds and tests."""
    rows = ["| family | module | layer on cakeops | kernels served | checked |",
            "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for family, module in MODULES.items():
        models = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        layers, kernels = [], set()
        for obj in vars(models).values():
            is_layer = isinstance(obj, type) and issubclass(obj, torch.nn.Module)
            if is_layer and obj.__module__ == models.__name__ and delta_rule_names(obj):
                layers.append(obj.__name__)
                scope = vars(models)
                kernels |= {hub_kernels.hub_name(scope[n]) for n in
                            delta_rule_names(obj)}  # fmt: skip
        checked = ("tiny model: loss, gradients, generation" if family in BUILT
                   else f"layer found; no tiny model: {NOT_BUILT[module]}")  # fmt: skip
        rows.append(f"| {family} | `{module}` | {', '.join(f'`{n}`' for n in sorted(layers))} "
                    f"| {', '.join(f'`{k}`' for k in sorted(kernels))} | {checked} |")  # fmt: skip
    return "\n".join(rows)


def test_delta_rule_table_is_current():
    """Regenerate with ``python tests/integrations/test_hf_delta_rule.py``."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs/content/transformers.md").read_text()
    block = text.split("<!-- hf-delta-rule:start -->\n")[1].split("<!-- hf-delta-rule:end -->")[0]
    assert block.strip() == delta_rule_table(), (
        "run python tests/integrations/test_hf_delta_rule.py"
    )


if __name__ == "__main__":
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs/content/transformers.md"
    head, rest = path.read_text().split("<!-- hf-delta-rule:start -->\n")
    tail = rest.split("<!-- hf-delta-rule:end -->")[1]
    path.write_text(f"{head}<!-- hf-delta-rule:start -->\n{delta_rule_table()}\n"
                    f"<!-- hf-delta-rule:end -->{tail}")  # fmt: skip
    print(f"wrote {path}")


@pytest.mark.parametrize("name, shape", [("qwen3_next", (70, 32, 2, 4, 8)),
                                         ("kimi_linear", (70, 32, 2, 8))])  # fmt: skip
def test_layer_benchmark_runs_and_writes_its_table(tmp_path, monkeypatch, name, shape):
    """``python -m cakeops.bench.<name> --quick`` (Qwen3-Next's Gated DeltaNet layer, Kimi
    Linear's KDA layer): the layer's rows and the decode's."""
    import importlib

    bench = importlib.import_module(f"cakeops.bench.{name}")
    monkeypatch.setattr(bench, "QUICK_SHAPES", {"tiny": shape})
    monkeypatch.setattr(bench, "DECODE_TOKENS", 3)
    out = tmp_path / f"{name}.md"
    assert bench.main(["--quick", "--markdown", str(out)]) == 0
    table = out.read_text()
    assert f"`python -m cakeops.bench.{name}`" in table
    assert "| cakeops layer, tiny | 70 |" in table
    assert "The two models generated the same tokens." in table
