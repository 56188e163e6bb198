"""Mamba2's scan inside Hugging Face transformers: every family whose mixers call
``mamba_chunk_scan_combined`` / ``selective_state_update`` runs them on
:func:`cakeops.causal_dot_product` after ``apply_cakeops`` (q = C, k = B, v = dt x,
``log_gates = dt A``); loss, every gradient and greedy generation (its recurrent states too)
match the unpatched model; the adapters agree with transformers' fallbacks in every input's
gradient; packed sequences stay apart where the fallback runs them together."""

from __future__ import annotations

import importlib
import itertools
import sys

import hf_kernel_checks as checks
import pytest
import torch
from hf_conv_families import FAMILIES
from hf_kernel_checks import TOLERANCE, tokens
from test_hf_conv1d import pair

import cakeops
from cakeops.integrations.transformers import hub_kernels, rebinding

#: family -> its transformers module: every family whose mixer calls Mamba2's scans
MODULES = {"Mamba2": "mamba2", "Bamba": "bamba", "Granite-4.0-hybrid": "granitemoehybrid",
           "Nemotron-H": "nemotron_h", "Zamba2": "zamba2", "Falcon-H1": "falcon_h1"}  # fmt: skip
BUILT = [f for f in MODULES if FAMILIES.get(f) is not None]


def scan_names(cls: type) -> dict[str, str]:
    return rebinding.served_names(cls, hub_kernels.MAMBA2_SCANS)


def test_every_family_of_the_installed_transformers_is_listed():
    assert checks.modules_calling(hub_kernels.MAMBA2_SCANS) == set(MODULES.values())
    assert list(MODULES) == BUILT


def _mixers(model) -> int:
    return sum(1 for m in model.modules() if scan_names(type(m)))


@pytest.mark.parametrize("family", BUILT)
def test_the_op_runs_once_per_mixer_and_pass(family, monkeypatch):
    """The patched model calls causal_dot_product's kernels once per Mamba2 mixer in a forward
    and once in the backward (counted on the torch backend's kernel module)."""
    from cakeops_torch import causal_dot_product as kernels

    calls = checks.count_calls(monkeypatch, kernels)
    _, patched = pair(family)
    with cakeops.use_backend("torch"):
        patched(tokens(), labels=tokens()).loss.backward()
    assert _mixers(patched) and calls == {"forward": _mixers(patched),
                                          "backward": _mixers(patched)}  # fmt: skip


@pytest.mark.parametrize("family", BUILT)
def test_loss_and_every_gradient_match_the_model(family):
    """The loss and every gradient (A_log, dt_bias, D and the projections among them) within
    the float32 tolerance of the exact values (the patched model in float64) and of the
    unpatched model's. A_log's gradient is a sum that cancels to a small fraction of its
    terms: the op's log gates' gradient summed as crossing terms keeps it (1e-6 of itself; a
    backward sum of q.dq - k.dk lost it, 4e-5 in Bamba)."""
    model, patched = pair(family)
    ids = tokens()
    checks.assert_matches_the_model(model, patched, ids, "causal_dot_product")
    _, grads = checks.loss_and_grads(model, ids)
    _, grads_c = checks.loss_and_grads(patched, ids)
    assert any("A_log" in n for n in grads) and any("dt_bias" in n for n in grads)
    for name, want in grads.items():
        err = cakeops.relative_error(grads_c[name], want)
        assert err <= TOLERANCE, f"{name}: {err:.2e} from the unpatched model's"


@pytest.mark.parametrize("family", BUILT)
def test_greedy_generation_matches(family):
    """32 greedy tokens (the prompt through the chunked scan, then one-token state updates)
    equal the unpatched model's, each step's logits within the tolerance, and the caches'
    recurrent states after the last token equal."""
    runs = checks.generate_both(*pair(family), tokens(shape=(1, 9)))
    compared = 0
    for i in range(8):
        try:
            a, b = (r.past_key_values.get_recurrent_state(i) for r in runs)
        except (AttributeError, IndexError, KeyError, ValueError, TypeError):
            continue
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and cakeops.relative_error(b, a) <= TOLERANCE
            compared += 1
    assert compared >= 1


@pytest.mark.parametrize("family", BUILT)
@pytest.mark.parametrize("mode", ["compile", "checkpointing"])
def test_training_steps(mode, family):
    """Three SGD steps on cakeops (Granite 4.0's hybrid: Mamba2 mixers, attention and MoE
    experts) match the unpatched model's, compiled or with activation checkpointing."""
    from test_transformers import assert_training_matches

    assert_training_matches(*pair(family), mode, tokens())


def _fallbacks():
    m = importlib.import_module("transformers.models.mamba2.modeling_mamba2")
    return m.mamba2_chunk_scan.__wrapped__, m.mamba2_selective_state_update.__wrapped__


def _scan_inputs(L=20, H=4, P=3, G=2, S=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return {"hidden_states": r(1, L, H, P), "dt": r(1, L, H), "A": -torch.rand(H, generator=gen),
            "B": r(1, L, G, S), "C": r(1, L, G, S), "D": r(H), "dt_bias": r(H) * 0.1,
            "initial_states": r(1, H, P, S)}  # fmt: skip


@pytest.mark.parametrize("groups", [1, 2])
def test_the_adapters_agree_with_transformers_fallbacks(groups):
    """The chunk scan from an initial state, with D, dt_bias, softplus and a dt limit, against
    transformers' fallback: the output, the final state and every input's gradient; the state
    update against its fallback (the output and the state written in place)."""
    chunk_scan, state_update = _fallbacks()
    results = []
    for fn in (chunk_scan, hub_kernels._hf_mamba_chunk_scan):
        leaves = {n: t.requires_grad_() for n, t in _scan_inputs(G=groups).items()}
        out, final = fn(**leaves, chunk_size=8, dt_softplus=True, dt_limit=(0.0, 3.0),
                        return_final_states=True)  # fmt: skip
        g = torch.linspace(-1, 1, out.numel()).view_as(out)
        grads = torch.autograd.grad((out * g).sum() + final.sum(), list(leaves.values()))
        results.append((out, final, *grads))
    for a, b in zip(*results, strict=True):
        assert cakeops.relative_error(b, a) <= TOLERANCE
    x = _scan_inputs(G=groups)
    H, P, S = 4, 3, 5
    step = {"hidden_states": x["hidden_states"][:, 0],
            "dt": x["dt"][:, 0, :, None].expand(-1, -1, P),
            "A": x["A"][:, None, None].expand(-1, P, S), "B": x["B"][:, 0], "C": x["C"][:, 0],
            "D": x["D"][:, None].expand(-1, P), "dt_bias": x["dt_bias"][:, None].expand(-1, P),
            "z": torch.randn(1, H, P)}  # fmt: skip
    done = []
    for fn in (state_update, lambda *a, **k: hub_kernels._hf_selective_state_update(
            state_update, *a, **k)):  # fmt: skip
        state = x["initial_states"].clone()
        done.append((fn(state, **step, dt_softplus=True), state))
    for a, b in zip(*done, strict=True):
        assert cakeops.relative_error(b, a) <= TOLERANCE


def test_packed_sequences_stay_apart_where_the_fallback_mixes_them():
    """Documents packed in one row with Mamba's ``seq_idx``: each document's output and every
    input's gradient equal that document scanned alone (the first from the row's initial
    state, the others from zeros; the per-head and shared parameters' gradients summed over
    the documents), the row's final state the last document's (mamba_ssm's rule);
    transformers' fallback ignores ``seq_idx`` and carries each document's state into the
    next."""
    chunk_scan, _ = _fallbacks()
    x = _scan_inputs(L=30)
    cu = torch.tensor([0, 9, 16, 30])
    seq_idx = torch.repeat_interleave(torch.arange(3), cu[1:] - cu[:-1])[None].int()
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    out, final = hub_kernels._hf_mamba_chunk_scan(
        **leaves, chunk_size=8, dt_softplus=True, seq_idx=seq_idx, return_final_states=True
    )
    mixed = chunk_scan(**x, chunk_size=8, dt_softplus=True, seq_idx=seq_idx)
    assert cakeops.relative_error(mixed[:, 9:], out[:, 9:]) > 0.01
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = dict(zip(leaves, torch.autograd.grad((out * g).sum(), list(leaves.values())),
                     strict=True))  # fmt: skip
    shared = {n: torch.zeros_like(t) for n, t in x.items() if t.dim() == 1}
    shared["initial_states"] = torch.zeros_like(x["initial_states"])
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        part = {n: (t[:, s:e] if t.dim() > 1 else t).clone().requires_grad_()
                for n, t in x.items() if n != "initial_states"}  # fmt: skip
        if s == 0:
            part["initial_states"] = x["initial_states"].clone().requires_grad_()
        alone, last = hub_kernels._hf_mamba_chunk_scan(**part, chunk_size=8, dt_softplus=True,
                                                       return_final_states=True)  # fmt: skip
        assert cakeops.relative_error(out[:, s:e], alone) <= TOLERANCE
        want = chunk_scan(**{n: t.detach() for n, t in part.items()}, chunk_size=8,
                          dt_softplus=True)  # fmt: skip
        assert cakeops.relative_error(out[:, s:e], want) <= TOLERANCE
        got = torch.autograd.grad((alone * g[:, s:e]).sum(), list(part.values()))
        for name, d in zip(part, got, strict=True):
            if name in shared:
                shared[name] += d
            else:
                assert cakeops.relative_error(grads[name][:, s:e], d) <= TOLERANCE, name
    assert final.shape == last.shape and cakeops.relative_error(final, last) <= TOLERANCE
    for name, total in shared.items():
        assert cakeops.relative_error(grads[name], total) <= TOLERANCE, name


FUSED_CALL = "mamba_split_conv1d_scan_combined"


def _fused_name(cls: type) -> str | None:
    """The name under which a mixer class (unpatched) calls the fused call cakeops serves."""
    return next((n for n, k in rebinding.served_names(cls).items() if k == FUSED_CALL), None)


def _mixer(model):
    return next(m for m in model.modules() if scan_names(type(m)))


FUSED = [f for f in BUILT if _fused_name(type(_mixer(pair(f)[0])))]


def test_every_mixer_makes_the_fused_call():
    """Every Mamba2 mixer tries mamba_ssm's fused training call first; cakeops serves it for
    all but Falcon-H1's, whose fused call and own norm disagree: it declines that one (the
    reason is listed)."""
    assert FUSED == BUILT
    falcon = type(_mixer(pair("Falcon-H1")[0]))
    assert FUSED_CALL in hub_kernels.DECLINED_CALLS[falcon.__name__]


@pytest.mark.parametrize("family", FUSED)
def test_the_fused_training_call_runs_on_cakeops(family, monkeypatch):
    """In training without a cache (``use_cache=False``) a mixer calls
    ``mamba_split_conv1d_scan_combined`` first:
    the patched model serves it (once per mixer, counted; Falcon-H1's declined, its separate
    calls on cakeops instead), where transformers' fallback answers None and the unpatched model
    runs the separate calls; the loss and every gradient equal the unpatched model's."""
    declined = family == "Falcon-H1"
    model, patched = pair(family)
    cls = type(_mixer(model))
    name = _fused_name(cls)
    # the patched forward reads the served functions from a copy of its module
    scope = sys.modules[f"cakeops._served.{cls.__module__}"].__dict__
    served, answers = scope[name], []

    def counting(*args, **kwargs):
        answers.append(served(*args, **kwargs))
        return answers[-1]

    monkeypatch.setitem(scope, name, counting)

    def loss_and_grads(m):  # training without a cache (use_cache=False, as trainers set it)
        m.train()
        m.zero_grad(set_to_none=True)
        loss = m(tokens(), labels=tokens(), use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads(model)
    loss_c, grads_c = loss_and_grads(patched)
    assert len(answers) == _mixers(patched)
    assert all((a is None) == declined for a in answers)  # declined: the separate calls ran
    assert cakeops.relative_error(loss_c, loss) <= TOLERANCE
    assert grads.keys() == grads_c.keys()
    for p, want in grads.items():
        err = cakeops.relative_error(grads_c[p], want)
        assert err <= TOLERANCE, f"{p}: {err:.2e} from the unpatched model's"


@pytest.mark.parametrize("mode", ["compile", "checkpointing"])
def test_fused_training_steps(mode):
    """Three SGD steps through the fused call (``use_cache=False``) of Granite 4.0's hybrid
    match the unpatched model's, compiled or with activation checkpointing."""
    from test_transformers import assert_training_matches

    model, patched = pair("Granite-4.0-hybrid")
    for m in (model, patched):
        m.config.use_cache = False
        m.train()
    assert_training_matches(model, patched, mode, tokens())


def _packed_pair(family: str):
    """The family's tiny model and its patched copy, Granite 4.0's with Mamba2 layers only (its
    attention, without positions, would mix packed documents: that is not cakeops' part)."""
    config_class, sizes = FAMILIES[family]
    if family == "Granite-4.0-hybrid":
        sizes = {**sizes, "layer_types": ["mamba", "mamba"]}
    return checks.pair({family: (config_class, sizes)}, family)


@pytest.mark.parametrize("family", BUILT)
@pytest.mark.parametrize("training", [False, True])
def test_packed_documents_in_the_model(family, training):
    """Three documents packed in one row (``seq_idx`` and positions restarting, as
    transformers' flattening collator hands them): each document's hidden states equal the
    document run alone, in inference (the separate calls) and in training without a cache
    (the fused call); the unpatched model's fallbacks refuse the packed row."""
    model, patched = _packed_pair(family)
    ids = tokens(shape=(1, 20))
    cu = torch.tensor([0, 5, 12, 20])
    seq_idx = torch.repeat_interleave(torch.arange(3), cu[1:] - cu[:-1])[None].int()
    positions = torch.cat([torch.arange(e - s) for s, e in itertools.pairwise(cu.tolist())])
    for m in (model, patched):
        m.train(training)
    packed = patched.base_model(ids, seq_idx=seq_idx, position_ids=positions[None],
                                use_cache=False).last_hidden_state  # fmt: skip
    for s, e in itertools.pairwise(cu.tolist()):
        alone = patched.base_model(ids[:, s:e], use_cache=False).last_hidden_state
        assert cakeops.relative_error(packed[:, s:e], alone) <= TOLERANCE
    with pytest.raises(ValueError, match="packed sequences"):
        model.base_model(ids, seq_idx=seq_idx, position_ids=positions[None], use_cache=False)


def test_the_fused_call_keeps_packed_documents_apart():
    """The fused call on documents packed in one row (``seq_idx``): each document's output
    equals the document run alone, in the convolution and the scan both (Nemotron-H's two
    groups of B and C)."""
    mixer = _mixer(pair("Nemotron-H")[0])
    cu = torch.tensor([0, 5, 13, 20])
    seq_idx = torch.repeat_interleave(torch.arange(3), cu[1:] - cu[:-1])[None].int()
    zxbcdt = mixer.in_proj(torch.randn(1, 20, mixer.in_proj.in_features))

    def fused(z, **kwargs):
        return hub_kernels._hf_split_conv1d_scan(
            z, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, mixer.dt_bias,
            -torch.exp(mixer.A_log.float()), D=mixer.D, chunk_size=mixer.chunk_size,
            activation=mixer.activation, rmsnorm_weight=mixer.norm.weight,
            rmsnorm_eps=mixer.norm.variance_epsilon, outproj_weight=mixer.out_proj.weight,
            outproj_bias=mixer.out_proj.bias, headdim=mixer.head_dim, ngroups=mixer.n_groups,
            norm_before_gate=False, **kwargs)  # fmt: skip

    assert mixer.n_groups == 2
    packed = fused(zxbcdt, seq_idx=seq_idx)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        alone = fused(zxbcdt[:, s:e])
        assert cakeops.relative_error(packed[:, s:e], alone) <= TOLERANCE
    assert cakeops.relative_error(packed[:, 5:], fused(zxbcdt)[:, 5:]) > 0.01


def test_mamba1_state_update_is_left_to_transformers():
    """Mamba1's mixers also call ``selective_state_update`` (a per-channel A, not a scan
    cakeops serves): their class is patched for the convolution only."""
    m = importlib.import_module("transformers.models.mamba.modeling_mamba")
    assert "selective_state_update" not in rebinding.served_names(m.MambaMixer).values()


def test_mamba2_benchmark_runs_and_writes_its_table(tmp_path, monkeypatch):
    """``python -m cakeops.bench.mamba2 --quick``: the scan's rows, the mixer's and the
    decode's."""
    from cakeops.bench import mamba2

    monkeypatch.setattr(mamba2, "QUICK_SHAPE", (70, 32, 2, 16, 8, 1))
    monkeypatch.setattr(mamba2, "DECODE_TOKENS", 3)
    out = tmp_path / "mamba2.md"
    assert mamba2.main(["--quick", "--markdown", str(out)]) == 0
    table = out.read_text()
    assert "`python -m cakeops.bench.mamba2`" in table
    assert "| SSD scan: cakeops |" in table and "| Mamba2Mixer: cakeops mixer |" in table
    assert "The two models generated the same tokens." in table
