"""The ``reference`` backend: the spec's float64 math, slow, never chosen implicitly.

Force it (``CAKEOPS_BACKEND=reference`` or ``cakeops.use_backend("reference")``) to debug a model.
Each op is the module named after it, beside the op's spec.
"""

from cakeops._spec import FLOAT_DTYPES
from cakeops.registry import Backend, package_kernels

backend = Backend(
    name="reference",
    distribution="cakeops",
    description="float64 reference math of the spec (debugging only)",
    ops=package_kernels(__name__, devices={"*": None}, dtypes=FLOAT_DTYPES),
)
