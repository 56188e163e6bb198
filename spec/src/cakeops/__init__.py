"""cakeops: fused training ops for PyTorch with one op spec and pluggable backends."""

from importlib.metadata import PackageNotFoundError, version

from cakeops import nn
from cakeops._spec import TOLERANCES, relative_error, tolerance
from cakeops.ops.rmsnorm_silu_gate import RMSNormSiLUGateFunction, rmsnorm_silu_gate
from cakeops.registry import (
    Backend,
    BackendError,
    Explanation,
    OpKernels,
    backends,
    register_backend,
    unregister_backend,
    use_backend,
)
from cakeops.ops import explain

try:
    __version__ = version("cakeops")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "TOLERANCES",
    "Backend",
    "BackendError",
    "Explanation",
    "OpKernels",
    "RMSNormSiLUGateFunction",
    "backends",
    "explain",
    "nn",
    "register_backend",
    "relative_error",
    "rmsnorm_silu_gate",
    "tolerance",
    "unregister_backend",
    "use_backend",
]
