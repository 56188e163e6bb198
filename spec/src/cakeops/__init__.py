"""cakeops: fused training ops for PyTorch with one op spec and pluggable backends.

The public names load on first use when torch is not imported yet (``cakeops --help`` answers
without importing torch); with torch already imported, ``import cakeops`` loads them at once,
registering the ops' ``torch.library`` custom ops.
"""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from cakeops.integrations import install_transformers_hook

try:
    __version__ = version("cakeops")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

#: public name -> the module that defines it (None: the name is a submodule)
_PUBLIC: dict[str, str | None] = {
    "nn": None,
    "TOLERANCES": "cakeops._spec",
    "compute_dtype": "cakeops._spec",
    "relative_error": "cakeops._spec",
    "tolerance": "cakeops._spec",
    "explain": "cakeops.ops",
    "CausalDotProduct": "cakeops.ops.causal_dot_product",
    "causal_conv1d": "cakeops.ops.causal_conv1d",
    "causal_dot_product": "cakeops.ops.causal_dot_product",
    "gated_delta_rule": "cakeops.ops.gated_delta_rule",
    "moe_experts": "cakeops.ops.moe_experts",
    "RMSNormSiLUGateFunction": "cakeops.ops.rmsnorm_silu_gate",
    "rmsnorm_silu_gate": "cakeops.ops.rmsnorm_silu_gate",
    "routed_experts": "cakeops.ops.routed_experts",
    **dict.fromkeys(
        ("Backend", "BackendError", "Explanation", "OpKernels", "backends", "rediscover",
         "register_backend", "unregister_backend", "use_backend"),
        "cakeops.registry",
    ),
}  # fmt: skip
__all__ = [
    "TOLERANCES",
    "Backend",
    "BackendError",
    "CausalDotProduct",
    "Explanation",
    "OpKernels",
    "RMSNormSiLUGateFunction",
    "backends",
    "causal_conv1d",
    "causal_dot_product",
    "compute_dtype",
    "explain",
    "gated_delta_rule",
    "moe_experts",
    "nn",
    "rediscover",
    "register_backend",
    "relative_error",
    "rmsnorm_silu_gate",
    "routed_experts",
    "tolerance",
    "unregister_backend",
    "use_backend",
]

if TYPE_CHECKING:
    from cakeops import nn
    from cakeops._spec import TOLERANCES, compute_dtype, relative_error, tolerance
    from cakeops.ops import explain
    from cakeops.ops.causal_conv1d import causal_conv1d
    from cakeops.ops.causal_dot_product import CausalDotProduct, causal_dot_product
    from cakeops.ops.gated_delta_rule import gated_delta_rule
    from cakeops.ops.moe_experts import moe_experts
    from cakeops.ops.rmsnorm_silu_gate import RMSNormSiLUGateFunction, rmsnorm_silu_gate
    from cakeops.ops.routed_experts import routed_experts
    from cakeops.registry import (
        Backend,
        BackendError,
        Explanation,
        OpKernels,
        backends,
        rediscover,
        register_backend,
        unregister_backend,
        use_backend,
    )


def _load() -> None:
    """Import the ops (registering their custom ops) and bind every public name."""
    names = globals()
    for name, module in _PUBLIC.items():
        if module is None:
            names[name] = importlib.import_module(f"cakeops.{name}")
        else:
            names[name] = getattr(importlib.import_module(module), name)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        _load()
        return globals()[name]
    if name.startswith("_"):  # ``from cakeops import _spec`` then imports the submodule
        raise AttributeError(f"module 'cakeops' has no attribute {name!r}")
    from cakeops.ops import SPECS  # the public function of an op module added without an entry

    if name in SPECS:
        return getattr(importlib.import_module(f"cakeops.ops.{name}"), name)
    raise AttributeError(f"module 'cakeops' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


if "torch" in sys.modules:
    _load()
install_transformers_hook()
