"""Every Hugging Face family whose experts go through transformers' ``ExpertsInterface``, found in
the installed transformers (no list kept by hand), and how to build each one tiny.

A family is tested at the highest level that builds from a generic tiny config: its
``*ForCausalLM`` (loss and every parameter's gradient), else its experts module alone, built
from the family's own config class with tiny sizes (output and every gradient: input, routing
weights, weights and biases). Used by ``tests/integrations/test_hf_families.py`` and the docs'
table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import pathlib
import sys
import warnings

import torch
import transformers as tf

#: Sizes every tiny config takes, where the config has the attribute.
TINY = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 32, "moe_intermediate_size": 16,
    "moe_hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "moe_num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64,
    "shared_expert_intermediate_size": 16, "n_shared_experts": 1, "first_k_dense_replace": 0,
    "n_group": 1, "topk_group": 1, "kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4, "v_head_dim": 8, "decoder_sparse_step": 1, "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2, "moe_latent_size": None,
}  # fmt: skip
#: Sizes of the experts-module check: (tokens, experts, top_k); D and F from the config.
TOKENS, EXPERTS, TOP_K = 12, 4, 2


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # the transformers model directory
    experts: tuple[type, ...]  # its experts classes (decorated with use_experts_implementation)
    causal: type | None  # its *ForCausalLM, if it has one


def _quiet():
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)


@functools.cache
def families() -> tuple[Family, ...]:
    """Every family of the installed transformers with an experts class on the interface."""
    _quiet()
    root = pathlib.Path(tf.__file__).parent / "models"
    found = []
    for path in sorted(root.glob("*/modeling_*.py")):
        if "@use_experts_implementation" not in path.read_text():
            continue
        module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        own = [c for c in vars(module).values() if inspect.isclass(c)
               and c.__module__ == module.__name__]  # fmt: skip
        experts = tuple(c for c in own if hasattr(c, "_apply_gate"))
        causal = next((c for c in own if c.__name__.endswith("ForCausalLM")), None)
        found.append(Family(path.parent.name, experts, causal))
    return tuple(found)


def family(name: str) -> Family:
    return next(f for f in families() if f.name == name)


def tiny(config: tf.PretrainedConfig) -> tf.PretrainedConfig:
    """``config`` with the :data:`TINY` sizes set where it has the attributes; ``head_dim``
    where it has no rope split of its own; hybrid layer patterns cut to one layer of each
    kind."""
    head_dim = {} if _has(config, "qk_rope_head_dim") else {"head_dim": 8}
    for key, value in {**TINY, **head_dim}.items():
        if _has(config, key):
            # a validated field of another type, a per-layer attribute: left as it is
            with contextlib.suppress(Exception):
                setattr(config, key, value)
    kinds = getattr(config, "layer_types", None)
    if isinstance(kinds, list) and kinds:
        distinct = list(dict.fromkeys(kinds))[:2]
        try:
            config.layer_types = distinct
            config.num_hidden_layers = len(distinct)
        except AttributeError:  # a pattern computed from other attributes
            pass
    return config


def _init_parameters(experts: type) -> list[str]:
    return list(inspect.signature(inspect.unwrap(experts.__init__)).parameters)


def _candidate_configs(experts: type):
    """Default configs of the experts' family, and the per-layer configs inside them (a
    family that sets its experts per layer)."""
    for config_class in _config_classes(experts):
        try:
            config = config_class()
        except Exception:
            continue
        yield config
        per_layer = getattr(config, "per_layer_config", None)
        if isinstance(per_layer, dict):
            yield from per_layer.values()


def _has(config, key: str) -> bool:
    """``hasattr``, for configs whose per-layer attributes raise on a global read."""
    try:
        return hasattr(config, key)
    except Exception:
        return False


def _config_classes(experts: type) -> list[type]:
    """The config class the experts class is annotated with, then the family's others."""
    init = inspect.unwrap(experts.__init__)
    annotation = inspect.signature(init).parameters["config"].annotation
    namespace = vars(sys.modules[experts.__module__])
    first = namespace.get(annotation) if isinstance(annotation, str) else annotation
    configuration = sys.modules[experts.__module__.replace(".modeling_", ".configuration_")]
    others = [
        c
        for c in vars(configuration).values()
        if inspect.isclass(c)
        and issubclass(c, tf.PretrainedConfig)
        and c.__module__ == configuration.__name__
    ]
    return [c for c in (first, *others) if inspect.isclass(c)]


def build_model(fam: Family, seed: int = 0) -> torch.nn.Module:
    """The family's ``*ForCausalLM`` from a tiny config, with at least one experts module
    (raises if it has none or does not build)."""
    _quiet()
    torch.manual_seed(seed)
    model = fam.causal(tiny(fam.causal.config_class()))
    if not any(isinstance(m, fam.experts) for m in model.modules()):
        raise LookupError(f"{fam.causal.__name__} built from a tiny config has no experts")
    ids = tokens()
    model(ids, labels=ids)  # it runs eagerly
    return model


@functools.cache
def level(name: str) -> str:
    """``"model"`` if the family's model builds and runs from a tiny config, else
    ``"experts module"``."""
    fam = family(name)
    if fam.causal is None:
        return "experts module"
    try:
        build_model(fam)
    except Exception:
        return "experts module"
    return "model"


def build_experts(experts: type, seed: int = 0) -> torch.nn.Module:
    """The experts module from its family's config class with tiny sizes, its parameters set
    to small random values (biases included)."""
    _quiet()
    torch.manual_seed(seed)
    extra = {"intermediate_size": 16} if "intermediate_size" in _init_parameters(experts) else {}
    for config in _candidate_configs(experts):
        try:
            module = experts(tiny(config), **extra)
            break
        except Exception:  # another of the family's configs
            continue
    else:
        raise LookupError(f"no config of its family builds {experts.__name__}")
    module.config._experts_implementation = "eager"
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return module


def experts_inputs(module: torch.nn.Module, seed: int = 1):
    """``(hidden_states, top_k_index, top_k_weights)`` for an experts module: distinct experts
    per token, softmax weights."""
    gen = torch.Generator().manual_seed(seed)
    D = (
        module.down_proj.shape[1]
        if not getattr(module, "is_transposed", False)
        else (module.down_proj.shape[2])
    )
    E = module.down_proj.shape[0]
    x = torch.randn(TOKENS, D, generator=gen)
    index = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    weights = torch.softmax(torch.randn(TOKENS, TOP_K, generator=gen), -1)
    return x, index, weights


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(
        0, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(seed)
    )
