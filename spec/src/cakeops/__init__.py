"""cakeops: fused training ops for PyTorch with one op spec and pluggable backends."""

from importlib.metadata import PackageNotFoundError, version

from cakeops import nn
from cakeops._spec import TOLERANCES, compute_dtype, relative_error, tolerance
from cakeops.ops import explain
from cakeops.ops.causal_dot_product import CausalDotProduct, causal_dot_product
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

try:
    __version__ = version("cakeops")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "TOLERANCES",
    "Backend",
    "BackendError",
    "CausalDotProduct",
    "Explanation",
    "OpKernels",
    "RMSNormSiLUGateFunction",
    "backends",
    "causal_dot_product",
    "compute_dtype",
    "explain",
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


def __getattr__(name: str):
    """The public function of an op module added without an import here."""
    from cakeops.ops import SPECS

    if name in SPECS:
        import importlib

        return getattr(importlib.import_module(f"cakeops.ops.{name}"), name)
    raise AttributeError(f"module 'cakeops' has no attribute {name!r}")
