"""The ``reference`` backend: the spec's float64 math, slow, never chosen implicitly.

Force it (``CAKEOPS_BACKEND=reference`` or ``cakeops.use_backend("reference")``) to debug a model.
"""

from cakeops._spec import FLOAT_DTYPES
from cakeops.registry import Backend, OpKernels

backend = Backend(
    name="reference",
    distribution="cakeops",
    description="float64 reference math of the spec (debugging only)",
    ops={
        "rmsnorm_silu_gate": OpKernels(
            module="cakeops.reference.rmsnorm_silu_gate",
            devices={"*": None},
            dtypes=FLOAT_DTYPES,
        ),
        "causal_dot_product": OpKernels(
            module="cakeops.reference.causal_dot_product",
            devices={"*": None},
            dtypes=FLOAT_DTYPES,
        ),
        "moe_experts": OpKernels(
            module="cakeops.reference.moe_experts",
            devices={"*": None},
            dtypes=FLOAT_DTYPES,
        ),
    },
)
