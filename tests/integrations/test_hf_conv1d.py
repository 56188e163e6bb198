"""The causal convolution inside Hugging Face transformers: every family whose layers call
``causal_conv1d_fn`` / ``causal_conv1d_update`` runs them on :func:`cakeops.causal_conv1d`
after ``apply_cakeops``; loss, every gradient and greedy generation (its convolution caches
too) match the unpatched model; packed sequences stay apart where transformers' fallback runs
one document into the next; and the adapter agrees with transformers' own fallbacks."""

from __future__ import annotations

import importlib

import hf_kernel_checks as checks
import pytest
import torch
from hf_conv_families import BUILT, FAMILIES, MODULES, NOT_BUILT
from hf_kernel_checks import TOLERANCE, tokens

import cakeops
from cakeops.integrations.transformers import hub_kernels, rebinding


def conv_names(cls: type) -> dict[str, str]:
    """The convolution kernels ``cls.forward`` calls."""
    return rebinding.served_names(cls, hub_kernels.CONVOLUTIONS)


def pair(family: str):
    return checks.pair(FAMILIES, family)


def test_every_family_of_the_installed_transformers_is_listed():
    """Each family calling the convolution kernels is built here or says why not."""
    assert checks.modules_calling(hub_kernels.CONVOLUTIONS) == set(MODULES.values())
    for family in MODULES:
        assert family in BUILT or MODULES[family] in NOT_BUILT, family


@pytest.mark.parametrize("family", BUILT)
def test_the_op_runs_once_per_layer_and_pass(family, monkeypatch):
    """The patched model calls the op's kernels once per convolution layer in a forward and once
    in the backward (counted on the torch backend's kernel module)."""
    from cakeops_torch import causal_conv1d as kernels

    calls = checks.count_calls(monkeypatch, kernels)
    _, patched = pair(family)
    layers = sum(1 for m in patched.modules() if conv_names(type(m)))
    with cakeops.use_backend("torch"):
        patched(tokens(), labels=tokens()).loss.backward()
    assert layers and calls == {"forward": layers, "backward": layers}


@pytest.mark.parametrize("family", BUILT)
def test_loss_and_every_gradient_match_the_model(family):
    """The patched model's loss is within the float32 tolerance of the unpatched model's, and
    its loss and every gradient within it of the exact values (the patched model in float64;
    transformers' delta-rule fallback computes in float32 whatever its inputs)."""
    model, patched = pair(family)
    checks.assert_matches_the_model(model, patched, tokens(), "causal_conv1d")


def _conv_states(cache, layers: int) -> list[torch.Tensor]:
    states = []
    for i in range(layers):
        try:
            state = cache.get_conv_state(i)
        except (AttributeError, IndexError, KeyError, ValueError, TypeError):
            continue
        if isinstance(state, torch.Tensor):
            states.append(state)
    return states


@pytest.mark.parametrize("family", BUILT)
def test_greedy_generation_matches(family):
    """32 greedy tokens (the prompt through the convolution, then one-token updates of the
    cached state) equal the unpatched model's, each step's logits within the tolerance, and
    the caches' convolution states after the last token equal."""
    model, patched = pair(family)
    runs = checks.generate_both(model, patched, tokens(shape=(1, 9)))
    layers = len([m for m in model.modules() if conv_names(type(m))])
    states = [_conv_states(r.past_key_values, 64) for r in runs]
    assert len(states[0]) == len(states[1]) >= min(layers, 1)
    for a, b in zip(*states, strict=True):
        assert a.dtype == b.dtype and cakeops.relative_error(b, a) <= TOLERANCE


@pytest.mark.parametrize("family", ["Mamba2", "LFM2"])
@pytest.mark.parametrize("mode", ["compile", "checkpointing"])
def test_training_steps(mode, family):
    """Three SGD steps on cakeops match the unpatched model's, compiled or with activation
    checkpointing."""
    from test_transformers import assert_training_matches

    assert_training_matches(*pair(family), mode, tokens())


def _fallbacks():
    module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    return module.causal_conv1d_fn.__wrapped__, module.causal_conv1d_update.__wrapped__


def _conv_inputs(L=30, C=6, W=4, seed=0):
    """x in the models' layout (a transposed view), weight, bias: leaves."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, L, C, generator=gen).transpose(1, 2)
    weight, bias = torch.randn(C, W, generator=gen) * 0.5, torch.randn(C, generator=gen) * 0.1
    return [t.requires_grad_() for t in (x, weight, bias)]


@pytest.mark.parametrize("activation", [None, "silu", "gelu"])
def test_the_adapters_agree_with_transformers_fallbacks(activation):
    """``causal_conv1d_fn`` and ``causal_conv1d_update`` against transformers' own fallbacks:
    the output and every gradient, the updated cache state (of transformers' length, ``W``);
    an activation other than SiLU is applied after the op."""
    fallback_fn, fallback_update = _fallbacks()
    outs = []
    for fn in (fallback_fn, hub_kernels._hf_causal_conv1d_fn):
        leaves = [t.detach().clone().requires_grad_() for t in _conv_inputs()]
        out = fn(*leaves, activation=activation)
        outs.append((out, *torch.autograd.grad(out.square().sum(), leaves)))
    for a, b in zip(*outs, strict=True):
        assert cakeops.relative_error(b, a) <= TOLERANCE
    x, weight, bias = (t.detach() for t in _conv_inputs(L=1, seed=1))
    state = torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(2))
    results = []
    for fn in (fallback_update, hub_kernels._hf_causal_conv1d_update):
        cache = state.clone()
        results.append((fn(x, cache, weight, bias, activation), cache))
    for a, b in zip(*results, strict=True):
        assert cakeops.relative_error(b, a) <= TOLERANCE


@pytest.mark.parametrize("given", ["cu_seq_lens_q", "seq_idx"])
def test_packed_sequences_stay_apart_where_the_fallback_mixes_them(given):
    """Packed documents (``cu_seq_lens_q`` as transformers' flattening collator passes them, or
    Mamba's ``seq_idx``) through the adapter: each document's output and gradients equal that
    document run alone; transformers' fallback ignores the packing and runs each document's
    first positions over the end of the one before."""
    fallback_fn, _ = _fallbacks()
    x, weight, bias = _conv_inputs(L=30)
    cu = torch.tensor([0, 7, 7, 9, 30])
    seq_idx = torch.repeat_interleave(torch.arange(4), cu[1:] - cu[:-1])[None]
    kwargs = {"cu_seq_lens_q": cu} if given == "cu_seq_lens_q" else {"seq_idx": seq_idx}
    out = hub_kernels._hf_causal_conv1d_fn(x, weight, bias, activation="silu", **kwargs)
    mixed = fallback_fn(x, weight, bias, activation="silu", **kwargs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad((out * g).sum(), [x, weight, bias])
    assert cakeops.relative_error(mixed[:, :, 7:], out[:, :, 7:]) > 0.01
    total = [torch.zeros_like(weight), torch.zeros_like(bias)]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        alone = x.detach()[:, :, s:e].clone().requires_grad_()
        w, b = weight.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
        o = hub_kernels._hf_causal_conv1d_fn(alone, w, b, activation="silu")
        assert cakeops.relative_error(out[:, :, s:e], o) <= TOLERANCE
        if e > s:  # (the fallback refuses an empty document)
            want = fallback_fn(alone.detach(), w.detach(), b.detach(), activation="silu")
            assert cakeops.relative_error(out[:, :, s:e], want) <= TOLERANCE
            dx, dw, db = torch.autograd.grad((o * g[:, :, s:e]).sum(), [alone, w, b])
            assert cakeops.relative_error(grads[0][:, :, s:e], dx) <= TOLERANCE
            total[0], total[1] = total[0] + dw, total[1] + db
    assert cakeops.relative_error(grads[1], total[0]) <= TOLERANCE
    assert cakeops.relative_error(grads[2], total[1]) <= TOLERANCE


def conv_table() -> str:
    """The docs' table of the families whose convolution cakeops serves: what this module finds
    and tests."""
    rows = ["| family | module | layer on cakeops | checked |", "| --- | --- | --- | --- |"]
    for family, module in MODULES.items():
        models = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        layers = sorted(obj.__name__ for obj in vars(models).values()
                        if isinstance(obj, type) and issubclass(obj, torch.nn.Module)
                        and obj.__module__ == models.__name__ and conv_names(obj))  # fmt: skip
        checked = ("tiny model: loss, gradients, generation" if family in BUILT
                   else f"layer found; no tiny model: {NOT_BUILT[module]}")  # fmt: skip
        rows.append(f"| {family} | `{module}` | {', '.join(f'`{n}`' for n in layers)} "
                    f"| {checked} |")  # fmt: skip
    return "\n".join(rows)


def test_conv1d_table_is_current():
    """Regenerate with ``python tests/integrations/test_hf_conv1d.py``."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs/content/transformers.md").read_text()
    block = text.split("<!-- hf-conv1d:start -->\n")[1].split("<!-- hf-conv1d:end -->")[0]
    assert block.strip() == conv_table(), "run python tests/integrations/test_hf_conv1d.py"


if __name__ == "__main__":
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs/content/transformers.md"
    head, rest = path.read_text().split("<!-- hf-conv1d:start -->\n")
    tail = rest.split("<!-- hf-conv1d:end -->")[1]
    path.write_text(f"{head}<!-- hf-conv1d:start -->\n{conv_table()}\n"
                    f"<!-- hf-conv1d:end -->{tail}")  # fmt: skip
    print(f"wrote {path}")
