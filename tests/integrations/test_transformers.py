"""cakeops inside Hugging Face transformers, on tiny random configs of the real package (no
downloads): each family's loss and every parameter's gradient match the unpatched model; a few
training steps under torch.compile and activation checkpointing; save and reload.

Both runs are float32; each is within the spec's float32 tolerance of the exact values, so the
two are compared within twice that."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import pytest
import torch
import transformers as tf

import cakeops
from cakeops.integrations.transformers import Unsupported, apply_cakeops

COMMON = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
#: family -> (config class, its MoE and attention sizes); FAMILIES feeds the docs' table too
FAMILIES = {
    "Qwen2-MoE": (tf.Qwen2MoeConfig, {"intermediate_size": 48, "moe_intermediate_size": 16,
                  "shared_expert_intermediate_size": 24, "num_experts": 4,
                  "num_experts_per_tok": 2}),
    "Qwen3-MoE": (tf.Qwen3MoeConfig, {"intermediate_size": 48, "moe_intermediate_size": 16,
                  "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 8}),
    "Mixtral": (tf.MixtralConfig, {"intermediate_size": 16, "num_local_experts": 4,
                "num_experts_per_tok": 2}),
    "OLMoE": (tf.OlmoeConfig, {"intermediate_size": 16, "num_experts": 4,
              "num_experts_per_tok": 2, "eos_token_id": 1, "pad_token_id": 0}),
    "DeepSeek-V3": (tf.DeepseekV3Config, {"intermediate_size": 48, "moe_intermediate_size": 16,
                    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
                    "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1,
                    "kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 4,
                    "qk_nope_head_dim": 4, "v_head_dim": 8}),
    "Qwen3-Next": (tf.Qwen3NextConfig, {"intermediate_size": 48, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 16, "num_experts": 4,
                   "num_experts_per_tok": 2, "head_dim": 8, "linear_num_value_heads": 2,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 8,
                   "linear_value_head_dim": 8, "linear_conv_kernel_dim": 2,
                   "layer_types": ["linear_attention", "full_attention"]}),
    "MiniMax": (tf.MiniMaxConfig, {"intermediate_size": 16, "num_local_experts": 4,
                "num_experts_per_tok": 2, "head_dim": 8, "block_size": 4,
                "layer_types": ["linear_attention", "full_attention"]}),
}  # fmt: skip
TOLERANCE = 2 * cakeops.tolerance(torch.float32)
ROOT = Path(__file__).resolve().parents[2]


def pair(family: str):
    """The unpatched model and a copy running on cakeops, same weights."""
    config_class, sizes = FAMILIES[family]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config_class(**COMMON, **sizes))
    return model, apply_cakeops(copy.deepcopy(model))


def tokens(seed: int = 1):
    return torch.randint(
        0, COMMON["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed)
    )


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_and_every_gradient_match_the_model(family):
    model, patched = pair(family)
    # proof that cakeops runs the experts: a backend that does not exist is refused
    with cakeops.use_backend("nope", op="routed_experts"), pytest.raises(cakeops.BackendError):
        patched(tokens())
    ids = tokens()
    loss, grads = loss_and_grads(model, ids)
    loss_c, grads_c = loss_and_grads(patched, ids)
    assert cakeops.relative_error(loss_c, loss) <= TOLERANCE
    assert grads.keys() == grads_c.keys()
    for name, grad in grads.items():
        err = cakeops.relative_error(grads_c[name], grad)
        assert err <= TOLERANCE, f"{name}: relative error {err:.2e}"


def test_gated_norms_swapped_keeping_parameters_and_names():
    model, patched = pair("Qwen3-Next")
    names = [type(m).__name__ for m in patched.modules()]
    assert "CakeopsQwen3NextRMSNormGated" in names
    assert list(model.state_dict()) == list(patched.state_dict())


def test_experts_implementation_by_name_at_construction(tmp_path):
    """``from_config(..., experts_implementation="cakeops")``, then save and reload with it."""
    config_class, sizes = FAMILIES["Qwen3-MoE"]
    model = tf.AutoModelForCausalLM.from_config(
        config_class(**COMMON, **sizes), experts_implementation="cakeops"
    )
    ids = tokens()
    out = model(ids).logits
    model.save_pretrained(tmp_path)
    again = tf.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="cakeops")
    torch.testing.assert_close(again(ids).logits, out, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["Qwen3-Next", "MiniMax"])
@pytest.mark.parametrize("mode", ["compile", "checkpointing"])
def test_training_steps(mode, family):
    """A few optimiser steps on cakeops match the unpatched model's, compiled or with
    activation checkpointing (Qwen3-Next: its experts and gated norms on cakeops; MiniMax: its
    experts and lightning attention)."""
    assert_training_matches(*pair(family), mode, tokens())


@pytest.mark.parametrize(
    "family, before",
    [(f, b) for f in ("Mixtral", "Qwen3-Next") for b in ("no-grad forward", "training step")]
    # Qwen3-Next with only its experts on cakeops runs transformers' delta-rule fallback,
    # whose backward fails compiled whole (unpatched too: a view of a non-contiguous tensor)
    + [("Mixtral", "set by name")],
)
def test_compiles_whole_whatever_ran_before(family, before):
    """``torch.compile(model, fullgraph=True)`` traces the patched model in one graph after
    an eager no-grad forward (a decode's cached expert views: keyed on data pointers, which a
    graph cannot compare), an eager training step, or ``set_experts_implementation
    ("cakeops")`` (the experts' options then found eagerly: their probe compares values, which
    a graph cannot); forward and backward as eager. The ``aot_eager`` backend: the tracing is
    what is checked; inductor's code generation costs minutes and checks nothing of cakeops."""
    model, patched = pair(family)
    ids = tokens()
    if before == "set by name":
        patched = copy.deepcopy(model)
        patched.set_experts_implementation("cakeops")
    elif before == "no-grad forward":
        with torch.no_grad():
            patched(ids)
    else:
        patched(ids, labels=ids).loss.backward()
    torch._dynamo.reset()
    compiled = torch.compile(patched, fullgraph=True, backend="aot_eager")
    with torch.no_grad():  # a compiled decode's path, then a training step's
        assert cakeops.relative_error(compiled(ids).logits, model(ids).logits) <= TOLERANCE
    loss, grads = loss_and_grads(model, ids)
    loss_c, grads_c = loss_and_grads(compiled, ids)
    assert cakeops.relative_error(loss_c, loss) <= TOLERANCE
    grads_c = {n.removeprefix("_orig_mod."): g for n, g in grads_c.items()}
    assert grads_c.keys() == grads.keys()
    for name, grad in grads.items():
        assert cakeops.relative_error(grads_c[name], grad) <= TOLERANCE, name
    with cakeops.use_backend("nope", op="routed_experts"), pytest.raises(cakeops.BackendError):
        compiled(ids)  # the experts run on cakeops, compiled


def test_set_experts_implementation_refuses_before_it_switches():
    """A model whose experts cakeops cannot run keeps its implementation when refused."""
    model, _ = pair("Mixtral")
    for m in model.modules():
        if hasattr(m, "has_gate"):
            m.act_fn = torch.nn.Softsign()  # none of cakeops' activations
    with pytest.raises(Unsupported, match="does not support"):
        model.set_experts_implementation("cakeops")
    assert model.config._experts_implementation != "cakeops"


def assert_training_matches(model, patched, mode: str, ids) -> None:
    """Three SGD steps of ``patched`` give the losses of ``model``'s (within the tolerance),
    compiled (``mode="compile"``: the patched model compiled, the reference eager; compiling
    transformers' own PyTorch fallbacks costs minutes and checks nothing of cakeops) or with
    activation checkpointing, and the loss falls."""
    losses = {}
    for name, m in (("model", model), ("cakeops", patched)):
        if mode == "checkpointing":
            m.activation_checkpointing_enable({"use_reentrant": False})
            m.train()
        step = torch.compile(m) if mode == "compile" and name == "cakeops" else m
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        losses[name] = []
        for _ in range(3):
            optimizer.zero_grad()
            loss = step(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            losses[name].append(loss.detach())
    for a, b in zip(losses["cakeops"], losses["model"], strict=True):
        assert cakeops.relative_error(a, b) <= TOLERANCE
    assert losses["cakeops"][-1] < losses["cakeops"][0]


def models_table() -> str:
    """The supported-models table of the README and docs: what this module tests."""
    version = tf.__version__
    rows = [
        "| family | config | experts | also on cakeops | transformers |",
        "| --- | --- | --- | --- | --- |",
    ]
    for family, (config_class, _) in FAMILIES.items():
        model = pair(family)[1]
        norms = sorted({type(m).__name__.removeprefix("Cakeops") for m in model.modules()
                        if type(m).__name__.startswith("Cakeops")})  # fmt: skip
        norm = ", ".join(f"`{n}`" for n in norms) or "-"
        rows.append(
            f"| {family} | `{config_class.__name__}` | routed_experts | {norm} | {version} |"
        )
    return "\n".join(rows)


@pytest.mark.parametrize("page", ["README.md", "docs/content/transformers.md"])
def test_supported_models_table_is_current(page):
    """Regenerate with ``python tests/integrations/test_transformers.py``."""
    text = (ROOT / page).read_text()
    block = text.split("<!-- hf-models:start -->\n")[1].split("<!-- hf-models:end -->")[0]
    assert block.strip() == models_table(), (
        f"{page}: run python tests/integrations/test_transformers.py"
    )


if __name__ == "__main__":
    for page in ("README.md", "docs/content/transformers.md"):
        path = ROOT / page
        head, rest = path.read_text().split("<!-- hf-models:start -->\n")
        tail = rest.split("<!-- hf-models:end -->")[1]
        path.write_text(
            f"{head}<!-- hf-models:start -->\n{models_table()}\n<!-- hf-models:end -->{tail}"
        )
        print(f"wrote {page}")


def _gated_norm_classes() -> dict[str, type]:
    """Every ``*RMSNormGated`` class of the installed transformers (found in its modeling files,
    then imported), by name."""
    import importlib
    import re

    found = {}
    for path in sorted(Path(tf.__file__).parent.glob("models/*/modeling_*.py")):
        names = re.findall(r"^class (\w+RMSNormGated)\(", path.read_text(), re.MULTILINE)
        if names:
            module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
            found.update({name: getattr(module, name) for name in names})
    return found


GATED_NORM_CLASSES = _gated_norm_classes()


def test_every_gated_norm_is_served_or_says_why():
    from cakeops.integrations.transformers import GATED_NORMS, NOT_SERVED_NORMS

    unknown = set(GATED_NORM_CLASSES) - set(GATED_NORMS) - set(NOT_SERVED_NORMS)
    assert not unknown, f"gated norms neither served nor listed as not served: {sorted(unknown)}"
    assert "Qwen3NextRMSNormGated" in GATED_NORM_CLASSES and "MambaRMSNormGated" in GATED_NORMS


def _norm_variants(cls: type) -> list[dict]:
    """Constructor arguments of a 32-wide norm: groups of 8 where the class takes them, and
    Falcon-H1's gate both before and after the norm."""
    params = inspect.signature(cls.__init__).parameters
    kwargs = {"eps": 1e-5}
    if "group_size" in params:
        kwargs["group_size"] = 8
    if "n_groups" in params:
        return [{**kwargs, "n_groups": 4, "norm_before_gate": nbg} for nbg in (True, False)]
    return [kwargs]


@pytest.mark.parametrize("name", sorted(GATED_NORM_CLASSES))
def test_gated_norm_swapped_matches_the_models_own(name, monkeypatch):
    """Each served gated norm, swapped by apply_cakeops, dispatches rmsnorm_silu_gate and
    matches the model's own forward and gradients; called without a gate (where the model's
    own accepts that) it stays the model's own; one not served keeps its class."""
    from cakeops.integrations.transformers import NOT_SERVED_NORMS, norms

    calls = []
    op = norms.rmsnorm_silu_gate
    monkeypatch.setattr(norms, "rmsnorm_silu_gate", lambda *a, **k: calls.append(1) or op(*a, **k))
    cls = GATED_NORM_CLASSES[name]
    for kwargs in _norm_variants(cls):
        torch.manual_seed(0)
        norm = cls(32, **kwargs)
        norm.weight.data.uniform_(0.5, 1.5)
        holder = torch.nn.Sequential(copy.deepcopy(norm))
        apply_cakeops(holder)
        patched = holder[0]
        if name in NOT_SERVED_NORMS:
            assert type(patched) is cls
            continue
        assert type(patched).__name__ == f"Cakeops{name}"
        assert dict(patched.state_dict()).keys() == dict(norm.state_dict()).keys()
        x = torch.randn(2, 3, 32, requires_grad=True)
        z = torch.randn(2, 3, 32, requires_grad=True)
        before = len(calls)
        got, want = patched(x, z), norm(x, z)
        assert len(calls) == before + 1, "rmsnorm_silu_gate was not dispatched"
        assert cakeops.relative_error(got, want) <= TOLERANCE
        g = torch.randn_like(want)
        leaves = (x, z, patched.weight)
        mine = torch.autograd.grad(got, leaves, g)
        theirs = torch.autograd.grad(want, (x, z, norm.weight), g)
        for a, b in zip(mine, theirs, strict=True):
            assert cakeops.relative_error(a, b) <= TOLERANCE
        try:
            want = norm(x)
        except (AttributeError, TypeError):  # the model's own needs a gate
            continue
        before = len(calls)
        assert cakeops.relative_error(patched(x), want) <= TOLERANCE
        assert len(calls) == before


def test_hf_models_benchmark_runs_and_writes_its_table(tmp_path, monkeypatch):
    """``python -m cakeops.bench.hf_models --quick`` (the row per family of the docs' table):
    every family, every implementation, in a table naming the machine and the command."""
    from cakeops.bench import hf_models

    monkeypatch.setattr(hf_models, "COMMON", {**hf_models.COMMON, "num_hidden_layers": 1})
    out = tmp_path / "hf_models.md"
    assert hf_models.main(["--quick", "--markdown", str(out)]) == 0
    table = out.read_text()
    assert "`python -m cakeops.bench.hf_models`" in table and "float32" in table
    for family in hf_models.FAMILIES:
        for impl in hf_models.IMPLEMENTATIONS:
            assert f"| {family} | 64 | {impl} |" in table


def test_minimax_benchmark_runs_and_writes_its_table(tmp_path, monkeypatch):
    """``python -m cakeops.bench.minimax --quick``: the layer's rows, the core's and the
    decode's, in a table naming the machine and the command."""
    from cakeops.bench import minimax

    monkeypatch.setattr(minimax, "QUICK_SHAPE", (64, 2, 8))
    monkeypatch.setattr(minimax, "DECODE_TOKENS", 3)
    out = tmp_path / "minimax.md"
    assert minimax.main(["--quick", "--markdown", str(out)]) == 0
    table = out.read_text()
    assert "`python -m cakeops.bench.minimax`" in table and "L = 64" in table
    for row in ("| Hugging Face layer |", "| cakeops layer |", "| layer without its core |",
                "| the core alone: cakeops |", "| decode, 3 tokens"):  # fmt: skip
        assert row in table


def test_minimax_lightning_attention_runs_on_the_op():
    """The core of MiniMax's lightning attention is causal_dot_product (a backend that does not
    exist is refused), its parameters, buffers and names kept."""
    model, patched = pair("MiniMax")
    assert "CakeopsMiniMaxLightningAttention" in {type(m).__name__ for m in patched.modules()}
    assert list(model.state_dict()) == list(patched.state_dict())
    with (
        cakeops.use_backend("nope", op="causal_dot_product"),
        pytest.raises(cakeops.BackendError),
    ):
        patched(tokens())


def test_minimax_greedy_generation_with_the_cache_is_the_model_s():
    """32 greedy tokens with the cache (a prefill, then a decode step per token from the
    cached state): the same tokens as the unpatched model, in float32."""
    model, patched = pair("MiniMax")
    prompt = tokens()[:1, :7]
    kwargs = {"max_new_tokens": 32, "do_sample": False, "use_cache": True,
              "pad_token_id": 0, "min_new_tokens": 32}  # fmt: skip
    want = model.generate(prompt, **kwargs)
    got = patched.generate(prompt, **kwargs)
    assert want.shape == (1, 7 + 32)
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["Qwen3-Next", "MiniMax"])
def test_patched_model_pickles_and_saves_whole(tmp_path, family):
    """``torch.save(model)``/``pickle`` of a model after ``apply_cakeops`` (its patched classes
    are built at run time), loaded here and in a fresh process that imported nothing of
    cakeops: the same classes, the same logits."""
    import pickle
    import subprocess
    import sys

    _, patched = pair(family)
    ids = tokens()
    with torch.no_grad():
        want = patched(ids).logits
    again = pickle.loads(pickle.dumps(patched))
    assert [type(m).__name__ for m in again.modules()] == [
        type(m).__name__ for m in patched.modules()
    ]
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=0)
    torch.save(patched, tmp_path / "model.pt")
    torch.save((ids, want), tmp_path / "want.pt")
    script = (
        "import torch\n"
        f"m = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        f"ids, want = torch.load({str(tmp_path / 'want.pt')!r})\n"
        "names = {type(x).__name__ for x in m.modules()}\n"
        "assert any(n.startswith('Cakeops') for n in names), names\n"
        "with torch.no_grad():\n"
        "    torch.testing.assert_close(m(ids).logits, want, rtol=0, atol=0)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)


@pytest.mark.parametrize("family", ["Mixtral", "Qwen3-MoE"])
@pytest.mark.parametrize("route", ["from_config", "set_experts_implementation"])
def test_model_on_cakeops_experts_alone_pickles_and_loads_anywhere(tmp_path, family, route):
    """A model whose only cakeops part is its experts (no patched class), saved whole, loads
    in a fresh process that imported nothing of cakeops and runs its experts on cakeops (the
    name was unknown there: a KeyError at the first forward), as a copy here does."""
    import subprocess
    import sys

    config_class, sizes = FAMILIES[family]
    torch.manual_seed(0)
    config = config_class(**COMMON, **sizes)
    if route == "from_config":
        model = tf.AutoModelForCausalLM.from_config(config, experts_implementation="cakeops")
    else:
        model = tf.AutoModelForCausalLM.from_config(config)
        model.set_experts_implementation("cakeops")
    ids = tokens()
    with torch.no_grad():
        want = model(ids).logits
    for again in (copy.deepcopy(model), torch.load(_saved(model, tmp_path), weights_only=False)):
        assert again.config._experts_implementation == "cakeops"
        with torch.no_grad():
            torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=0)
    torch.save((ids, want), tmp_path / "want.pt")
    script = (
        "import sys, torch\n"
        f"m = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        f"ids, want = torch.load({str(tmp_path / 'want.pt')!r})\n"
        "with torch.no_grad():\n"
        "    torch.testing.assert_close(m(ids).logits, want, rtol=0, atol=0)\n"
        "import cakeops\n"
        "with cakeops.use_backend('nope', op='routed_experts'):\n"
        "    try:\n"
        "        m(ids)\n"
        "    except cakeops.BackendError:\n"
        "        print('runs on cakeops')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.stdout.strip() == "runs on cakeops", proc.stderr[-3000:]


def _saved(model, folder) -> Path:
    torch.save(model, folder / "model.pt")
    return folder / "model.pt"


@pytest.mark.parametrize("order", ["cakeops-first", "transformers-first"])
def test_experts_implementation_resolves_after_import_cakeops(order):
    """``from_pretrained/from_config(..., experts_implementation="cakeops")`` with a plain
    ``import cakeops`` (before or after transformers), no import of the integration: the name
    resolves and the experts run on cakeops (transformers refused the name before)."""
    import subprocess
    import sys

    imports = ["import cakeops", "import transformers as tf"]
    if order == "transformers-first":  # transformers' model code imported before cakeops
        imports = ["import transformers as tf", "tf.PreTrainedModel", "import cakeops"]
    config_class, sizes = FAMILIES["Qwen3-MoE"]
    script = "\n".join(
        [
            *imports,
            "import torch",
            f"config = tf.{config_class.__name__}(**{COMMON!r}, **{sizes!r})",
            "model = tf.AutoModelForCausalLM.from_config(config, experts_implementation='cakeops')",
            "ids = torch.randint(0, 64, (2, 8))",
            "with cakeops.use_backend('nope', op='routed_experts'):",
            "    try:",
            "        model(ids)",
            "    except cakeops.BackendError:",
            "        print('runs on cakeops')",
        ]
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.stdout.strip() == "runs on cakeops", proc.stderr[-3000:]


def test_decode_keeps_the_experts_views_while_the_parameters_stay():
    """Without grad mode the experts' weight views are kept on the module between calls: an
    in-place update of a parameter (an optimizer step), a new parameter and new ``.data`` all
    reach the next call; with grad mode nothing is kept."""
    from cakeops.integrations.transformers import experts_forward

    model, _ = pair("Qwen3-MoE")
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, COMMON["hidden_size"], generator=gen)
    index = torch.tensor([[0, 1], [2, 3], [1, 2]])
    weights = torch.rand(3, 2, generator=gen)
    with torch.no_grad():
        first = experts_forward(experts, x, index, weights)
        assert "_cakeops_arguments" in experts.__dict__
        experts.down_proj.mul_(2)
        torch.testing.assert_close(experts_forward(experts, x, index, weights), 2 * first)
        experts.down_proj = torch.nn.Parameter(experts.down_proj * 0.5)
        torch.testing.assert_close(experts_forward(experts, x, index, weights), first)
        experts.down_proj.data = experts.down_proj.data * 3
        torch.testing.assert_close(experts_forward(experts, x, index, weights), 3 * first)
    experts.__dict__.pop("_cakeops_arguments")
    out = experts_forward(experts, x, index, weights)
    assert out.requires_grad and "_cakeops_arguments" not in experts.__dict__
    torch.testing.assert_close(out.detach(), 3 * first)
