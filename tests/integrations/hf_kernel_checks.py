"""What the tests of transformers' hub kernels served by cakeops (the delta rules, the causal
convolution) share: the families' modules found from the installed transformers, the model
pairs, the counted kernel calls, and the checks of a patched model against its own."""

from __future__ import annotations

import copy
import importlib
import pkgutil

import pytest
import torch
import transformers as tf

import cakeops
from cakeops.integrations.transformers import apply_cakeops, rebinding

TOLERANCE = 2 * cakeops.tolerance(torch.float32)


def pair(families: dict, family: str):
    """The tiny random model of ``family`` and its patched copy."""
    config_class, sizes = families[family]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config_class(**sizes))
    return model, apply_cakeops(copy.deepcopy(model))


def tokens(seed: int = 1, shape=(2, 12)):
    return torch.randint(3, 64, shape, generator=torch.Generator().manual_seed(seed))


def modules_calling(kernels) -> set[str]:
    """The transformers model modules with a layer whose forward calls one of ``kernels``."""
    found = set()
    for info in pkgutil.iter_modules(tf.models.__path__):
        name = f"transformers.models.{info.name}.modeling_{info.name}"
        if importlib.util.find_spec(f"transformers.models.{info.name}") is None:
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # a model needing an absent extra
            continue
        for obj in vars(module).values():
            layer = isinstance(obj, type) and issubclass(obj, torch.nn.Module)
            if layer and obj.__module__ == name and rebinding.served_names(obj, kernels):
                found.add(info.name)
    return found


def count_calls(monkeypatch, kernels) -> dict[str, int]:
    """Counts, from now on, the calls of a backend's kernel module's forward and backward."""
    calls = {"forward": 0, "backward": 0}
    for kind in calls:
        real = getattr(kernels, kind)

        def counted(*args, _real=real, _kind=kind):
            calls[_kind] += 1
            return _real(*args)

        monkeypatch.setattr(kernels, kind, counted)
    return calls


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_matches_the_model(model, patched, ids, op: str) -> None:
    """``op`` really runs (a backend that does not exist is refused); the patched model's loss
    within the float32 tolerance of the unpatched model's; its loss and every gradient within
    it of the exact values (the patched model in float64: the ops in float64 are their
    references' to 1e-12); the state-dict names unchanged."""
    with cakeops.use_backend("nope", op=op), pytest.raises(cakeops.BackendError):
        patched(ids)
    loss, grads = loss_and_grads(model, ids)
    loss_c, grads_c = loss_and_grads(patched, ids)
    loss_x, grads_x = loss_and_grads(copy.deepcopy(patched).double(), ids)
    assert cakeops.relative_error(loss_c, loss) <= TOLERANCE
    assert cakeops.relative_error(loss_c, loss_x) <= TOLERANCE
    assert grads.keys() == grads_c.keys() == grads_x.keys()
    for name, exact in grads_x.items():
        err = cakeops.relative_error(grads_c[name], exact)
        assert err <= TOLERANCE, f"{name}: relative error {err:.2e}"
    assert list(model.state_dict()) == list(patched.state_dict())


def generate_both(model, patched, ids):
    """32 greedy tokens of each model: the same tokens, each step's logits within the
    tolerance; returns both runs (their caches)."""
    runs = []
    for m in (model, patched):
        m.eval()
        runs.append(m.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                               output_scores=True, return_dict_in_generate=True))  # fmt: skip
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for a, b in zip(runs[0].scores, runs[1].scores, strict=True):
        assert cakeops.relative_error(b, a) <= TOLERANCE
    return runs
